"""The permission matrix: try, as each role, what it must not do and what it must be able to do.

Run against a live secure stack (`sprawl check permissions`) and by the tests. Each role connects
with credentials issued for a throwaway run of its own (`permcheck-<hex>`), so the allowed publishes
land in no real run. A forbidden attempt counts as refused only when the server says so (a
permissions violation for exactly that subject, seen before the PONG of a flush: the server answers
in order); an allowed attempt counts as working when the server answers it (a JetStream API reply,
whatever its content, or a publish with no violation).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
from dataclasses import asdict, dataclass
from pathlib import Path

import nats
import nats.errors

from infra import s3_identities, stack
from infra.nats_permissions import inbox_prefix
from infra.roles import GRANTS, WORKER_ROLES, Role
from infra.stack_security import StackSecurity
from infra.stack_state import StackStatus
from pipeline.config import SprawlSettings
from pipeline.errors import StackError
from pipeline.topology import STREAMS, SUBJECT_ROOT, Kind, consumers_of_run, follower_name

OTHER_RUN = "permcheck-other"
"""A run no identity of the check belongs to."""


@dataclass(frozen=True)
class Attempt:
    role: str
    what: str
    """`publish <subject>`, `subscribe <subject>` or `request <JetStream API subject>`."""
    should_work: bool
    worked: bool

    @property
    def as_expected(self) -> bool:
        return self.worked == self.should_work


def _forbidden_publishes(role: Role, run: str) -> list[str]:
    grant = GRANTS[role]
    subjects = [f"{SUBJECT_ROOT}.{run}.{kind.value}.check" for kind in Kind if kind not in grant.publishes]
    subjects += [f"{SUBJECT_ROOT}.{OTHER_RUN}.{kind.value}.check" for kind in grant.publishes]
    if Kind.DEAD_LETTERS in grant.publishes:
        subjects += [
            f"{SUBJECT_ROOT}.{run}.{Kind.DEAD_LETTERS.value}.{s.label}.1" for s in STREAMS if s not in grant.reads
        ]
    for stream in STREAMS:
        s = stream.name
        subjects += [f"$JS.API.STREAM.{op}.{s}" for op in ("CREATE", "UPDATE", "DELETE", "PURGE", "MSG.DELETE")]
        reads_back = any(p.kind in grant.publishes for p in stream.patterns)
        if stream not in grant.reads and not reads_back:
            subjects += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.MSG.GET.{s}"]
        if stream not in grant.reads:
            subjects += [
                f"$JS.API.DIRECT.GET.{s}",
                f"$JS.API.CONSUMER.CREATE.{s}",
                f"$JS.API.CONSUMER.CREATE.{s}.check.{SUBJECT_ROOT}.{run}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{s}.check",
            ]
        else:
            subjects.append(f"$JS.API.CONSUMER.CREATE.{s}.check.{SUBJECT_ROOT}.{OTHER_RUN}.>")
    binds = {"samplers": Role.SAMPLER, "rewards": Role.REWARDS, "archiver": Role.ARCHIVER}
    for consumer in consumers_of_run(run):
        s, name = consumer.stream.name, consumer.name
        subjects += [
            f"$JS.API.CONSUMER.DELETE.{s}.{name}",
            f"$JS.API.CONSUMER.CREATE.{s}.{name}",
            f"$JS.API.CONSUMER.CREATE.{s}.{name}.{SUBJECT_ROOT}.{run}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.{name}",
        ]
        if binds[consumer.role.value] is not role:
            subjects += [f"$JS.API.CONSUMER.MSG.NEXT.{s}.{name}", f"$JS.ACK.{s}.{name}.1.1.1.1.1"]
    if role is not Role.TRAINER:
        for stream in STREAMS:
            name = follower_name(run, "trainer", stream)
            subjects += [f"$JS.API.CONSUMER.{op}.{stream.name}.{name}" for op in ("CREATE", "DELETE", "MSG.NEXT")]
    subjects += [f"$JS.API.CONSUMER.NAMES.{stream.name}" for stream in STREAMS]
    subjects += ["$JS.API.ACCOUNT.PURGE.check", "$SYS.REQ.SERVER.PING", "$JS.API.META.LEADER.STEPDOWN"]
    return subjects


def _forbidden_subscriptions(role: Role, run: str) -> list[str]:
    other_inbox = inbox_prefix(Role.SAMPLER if role is not Role.SAMPLER else Role.REWARDS, run)
    return [
        ">",
        f"{SUBJECT_ROOT}.>",
        f"{SUBJECT_ROOT}.{run}.>",
        "_INBOX.>",
        f"{other_inbox}.>",
        "$JS.API.>",
        "$JS.ACK.>",
    ]


def _allowed_publishes(role: Role, run: str) -> list[str]:
    grant = GRANTS[role]
    subjects = [f"{SUBJECT_ROOT}.{run}.{kind.value}.check" for kind in grant.publishes if kind is not Kind.DEAD_LETTERS]
    if Kind.DEAD_LETTERS in grant.publishes:
        subjects += [f"{SUBJECT_ROOT}.{run}.{Kind.DEAD_LETTERS.value}.{s.label}.1" for s in grant.reads]
    return subjects


def _allowed_requests(role: Role, run: str) -> list[tuple[str, bytes]]:
    requests: list[tuple[str, bytes]] = [("$JS.API.INFO", b"")]
    for stream in GRANTS[role].reads:
        s = stream.name
        filter_subject = f"{SUBJECT_ROOT}.{run}.>"
        config = {
            "stream_name": s,
            "config": {"name": f"check-{secrets.token_hex(4)}", "filter_subject": filter_subject},
        }
        config["config"].update({"ack_policy": "none", "inactive_threshold": 5_000_000_000})
        name = config["config"]["name"]
        requests += [
            (f"$JS.API.STREAM.INFO.{s}", b""),
            (f"$JS.API.STREAM.MSG.GET.{s}", json.dumps({"last_by_subj": f"{SUBJECT_ROOT}.{run}.check"}).encode()),
            (f"$JS.API.CONSUMER.CREATE.{s}.{name}.{filter_subject}", json.dumps(config).encode()),
            (f"$JS.API.CONSUMER.DELETE.{s}.{name}", b""),
        ]
    return requests


class _Session:
    """One role's connection, collecting the server's permission violations."""

    def __init__(self, role: Role):
        self.role = role
        self.violations: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, creds: Path, ca_file: Path, inbox: str) -> None:
        async def on_error(exc: Exception) -> None:
            text = str(exc)
            if "permissions violation" in text.lower():
                self.violations.append(text.lower())

        context = ssl.create_default_context(cafile=str(ca_file))
        self.nc = await nats.connect(
            url,
            tls=context,
            user_credentials=str(creds),
            inbox_prefix=inbox,
            error_cb=on_error,
            max_reconnect_attempts=2,
            name=f"permission-check-{self.role.value}",
        )

    async def refused(self, subject: str, *, subscribe: bool = False) -> bool:
        assert self.nc is not None
        before = len(self.violations)
        if subscribe:
            sub = await self.nc.subscribe(subject)
        else:
            await self.nc.publish(subject, b"{}", reply=self.nc.new_inbox())
        await self.nc.flush(timeout=30)
        for _ in range(20):  # the error callback runs as its own task, after the read loop saw the -ERR
            if len(self.violations) > before:
                break
            await asyncio.sleep(0.01)
        if subscribe:
            await sub.unsubscribe()
        kind = "subscription" if subscribe else "publish"
        needle = f'{kind} to "{subject.lower()}"'
        return any(needle in v for v in self.violations[before:])

    async def answered(self, subject: str, payload: bytes) -> bool:
        assert self.nc is not None
        try:
            await self.nc.request(subject, payload, timeout=30)
        except nats.errors.TimeoutError:
            return False
        return True


async def nats_permission_matrix(security: StackSecurity, url: str, roles: list[Role] | None = None) -> list[Attempt]:
    """Every forbidden and allowed attempt for each role (default: all but admin), as it went."""
    run = f"permcheck-{secrets.token_hex(4)}"
    attempts: list[Attempt] = []
    folder = security.users_dir / "permission-check"
    for role in roles or WORKER_ROLES:
        creds = security.issue(role, run, run).write(folder / f"{role.value}.creds")
        session = _Session(role)
        await session.connect(url, creds, security.ca_file, inbox_prefix(role, run))
        try:
            for subject in _forbidden_publishes(role, run):
                worked = not await session.refused(subject)
                attempts.append(Attempt(role.value, f"publish {subject}", False, worked))
            for subject in _forbidden_subscriptions(role, run):
                worked = not await session.refused(subject, subscribe=True)
                attempts.append(Attempt(role.value, f"subscribe {subject}", False, worked))
            for subject in _allowed_publishes(role, run):
                attempts.append(Attempt(role.value, f"publish {subject}", True, not await session.refused(subject)))
            own_inbox = f"{inbox_prefix(role, run)}.check"
            worked = not await session.refused(own_inbox, subscribe=True)
            attempts.append(Attempt(role.value, f"subscribe {own_inbox}", True, worked))
            for subject, payload in _allowed_requests(role, run):
                attempts.append(
                    Attempt(role.value, f"request {subject}", True, await session.answered(subject, payload))
                )
        finally:
            assert session.nc is not None
            await session.nc.close()
    return attempts


def summary(attempts: list[Attempt]) -> dict[str, int]:
    forbidden = [a for a in attempts if not a.should_work]
    allowed = [a for a in attempts if a.should_work]
    return {
        "forbidden_attempted": len(forbidden),
        "forbidden_refused": sum(not a.worked for a in forbidden),
        "allowed_attempted": len(allowed),
        "allowed_ok": sum(a.worked for a in allowed),
    }


def surprises(attempts: list[Attempt]) -> list[dict]:
    return [asdict(a) for a in attempts if not a.as_expected]


def check_stack_permissions(settings: SprawlSettings, st: StackStatus) -> tuple[dict[str, int], list[dict]]:
    """Both halves of the matrix against the running stack `st`: the log (roles on a throwaway run) and
    the bucket (an S3 identity per role of that run, made through the IAM API and deleted afterwards).
    Returns the counts (`sprawl check permissions --json`) and every attempt that went unexpectedly."""
    if not st.secure:
        raise StackError(
            "the stack is not secure: every client may do everything",
            hint="restart it with stack.secure on (the default)",
        )
    security = StackSecurity(Path(st.state_dir) / "stack")
    log_attempts = asyncio.run(nats_permission_matrix(security, st.nats_url))
    admin = stack.admin_blobs(settings, st)
    run = f"permcheck-{secrets.token_hex(4)}"
    roles = list(WORKER_ROLES)
    creds = {}
    try:
        for role in roles:
            creds[role] = s3_identities.add_token_identity(admin, role, run, f"{run}-{role.value}")
        blob_attempts = s3_identities.s3_permission_matrix(admin, run, creds)
    finally:
        for role in creds:
            s3_identities.revoke_token_identity(admin, f"{run}-{role.value}")
    blob_counts = s3_identities.matrix_counts(blob_attempts)
    counts = {key: value + blob_counts[key] for key, value in summary(log_attempts).items()}
    unexpected = surprises(log_attempts) + [asdict(a) for a in blob_attempts if not a.ok]
    return counts, unexpected
