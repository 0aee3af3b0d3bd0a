"""Per-role S3 identities: the grants as an IAM policy, the stack's identities file, the permission
matrix against a real SeaweedFS started as the stack starts it, and token identities added and revoked
live (same SeaweedFS process throughout)."""

from __future__ import annotations

import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import SecretStr

from infra.ports import free_seaweed_base
from infra.roles import WORKER_ROLES
from infra.s3_identities import (
    ADMIN,
    IDENTITIES_FILE,
    Access,
    Attempt,
    Role,
    RoleCredentials,
    S3IdentityError,
    add_token_identity,
    grants,
    iam_policy,
    matrix_counts,
    revoke_token_identity,
    role_credentials,
    s3_permission_matrix,
    write_identities,
)
from infra.seaweed import spawn_seaweed, wait_seaweed
from infra.server_process import ServerRecord, is_running, stop_servers
from infra.stack_security import StackSecurity
from infra.stack_settings import StackSection
from pipeline.blobstore import S3BlobStore
from pipeline.config import S3BlobSettings
from pipeline.errors import BlobAccessDenied, TransientError
from pipeline.eventlog import EventLog
from schemas import decode_event
from tests.events import trajectory
from tests.servers import HANG_GUARD_S, START_TIMEOUT_S, new_run_id

RUN = "r1"
BUCKET = "sprawl"
KINDS = ("policy", "prompts", "traj", "reward", "metrics", "heartbeat", "deadletter", "trainer")

# What each role may do, written out by hand (not derived from the grants under test): (operation, target).
EXPECTED_ALLOWED: dict[str, set[tuple[str, str]]] = {
    "trainer": {
        *{(op, t) for op in ("put", "get") for t in ("policy", "lineage", "checkpoints")},
        *{("put", f"claims/{k}") for k in ("policy", "trainer", "metrics", "prompts", "deadletter")},
        # It reads every stream (its feeds, its chain, its leases, the fleet's metrics and dead letters).
        *{("get", f"claims/{k}") for k in KINDS},
    },
    "sampler": {
        ("get", "policy"),
        *{("get", f"claims/{k}") for k in ("prompts", "policy")},
        *{("put", f"claims/{k}") for k in ("traj", "heartbeat", "deadletter")},
    },
    "rewards": {
        *{("get", f"claims/{k}") for k in ("traj", "prompts")},
        *{("put", f"claims/{k}") for k in ("reward", "deadletter")},
    },
    "archiver": {
        *{("get", f"claims/{k}") for k in KINDS},
        ("put", "claims/deadletter"),
        *{(op, "archive") for op in ("put", "get", "list")},
    },
    "auditor": {
        (op, t)
        for op in ("get", "list")
        for t in ("policy", "lineage", "checkpoints", "archive", *(f"claims/{k}" for k in KINDS))
    },
}


# ---------------------------------------------------------------- the grants as IAM policies (no server)


@pytest.mark.parametrize("role", list(WORKER_ROLES))
def test_iam_policy_grants_exactly_the_roles_prefixes(role: Role):
    policy = iam_policy(role, RUN, BUCKET)
    granted: set[tuple[Access, str]] = set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        assert not any("Delete" in action or action.endswith("*") for action in statement["Action"])
        if statement["Action"] == ["s3:ListBucket"]:
            assert statement["Resource"] == [f"arn:aws:s3:::{BUCKET}"]
            granted |= {(Access.LIST, p.removesuffix("*")) for p in statement["Condition"]["StringLike"]["s3:prefix"]}
            continue
        access = Access.READ if statement["Action"] == ["s3:GetObject"] else Access.WRITE
        assert access == Access.READ or "s3:PutObject" in statement["Action"]
        for resource in statement["Resource"]:
            assert resource.startswith(f"arn:aws:s3:::{BUCKET}/") and resource.endswith("/*")
            granted.add((access, resource.removeprefix(f"arn:aws:s3:::{BUCKET}/").removesuffix("*")))
    assert granted == {(g.access, g.prefix) for g in grants(role, RUN)}
    assert all(f"/{RUN}/" in p or f"={RUN}/" in p for _, p in granted), "every grant is scoped to the run"


def test_only_the_trainer_writes_version_blobs_and_nobody_writes_another_roles_claims():
    def writes_versions(role: Role) -> bool:
        return any(g.access == Access.WRITE and "runs/r1/policy/".startswith(g.prefix) for g in grants(role, RUN))

    writers = {role for role in WORKER_ROLES if writes_versions(role)}
    assert writers == {Role.TRAINER}
    for role in (Role.SAMPLER, Role.REWARDS, Role.AUDITOR):
        assert not any(g.access == Access.WRITE and g.prefix.startswith("runs/") for g in grants(role, RUN))
    assert not any(g.access == Access.WRITE for g in grants(Role.AUDITOR, RUN))


def test_a_run_id_that_is_not_a_token_cannot_widen_a_grant():
    with pytest.raises(ValueError, match="cannot be a subject token"):
        grants(Role.SAMPLER, "*")


# ---------------------------------------------------------------- the identities file (no server)


def test_identities_file_is_private_keeps_role_keys_and_knows_each_role(tmp_path: Path):
    admin = S3BlobSettings()
    path = write_identities(tmp_path, admin, RUN, BUCKET)
    assert path == tmp_path / IDENTITIES_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = {role: role_credentials(tmp_path, role, RUN) for role in WORKER_ROLES}
    assert len({c.access_key_id for c in first.values()}) == len(WORKER_ROLES)
    assert admin.access_key_id not in {c.access_key_id for c in first.values()}
    assert first[Role.SAMPLER].secret_access_key.get_secret_value() not in repr(first[Role.SAMPLER])

    write_identities(tmp_path, admin, "r2", BUCKET)  # another run: both runs' roles, the first ones' keys kept
    write_identities(tmp_path, admin, None, BUCKET)  # a restart: nothing new
    assert {role: role_credentials(tmp_path, role, RUN) for role in WORKER_ROLES} == first
    assert role_credentials(tmp_path, Role.SAMPLER, "r2") != first[Role.SAMPLER]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(S3IdentityError, match="no S3 identity for role sampler of run r3"):
        role_credentials(tmp_path, Role.SAMPLER, "r3")


# ---------------------------------------------------------------- against SeaweedFS


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory):
    """SeaweedFS started by the stack's own code (spawn_seaweed, wait_seaweed: its port-clash retries),
    with the identities of run RUN: (admin settings, stack folder, its process)."""
    directory = tmp_path_factory.mktemp("seaweed-identities")
    section = StackSection(s3_port=0, seaweed_port_base=0, start_timeout_s=START_TIMEOUT_S)
    admin = S3BlobSettings(bucket=BUCKET)
    started = [spawn_seaweed(directory, section, admin, free_seaweed_base(0), run_id=RUN)]
    try:
        wait_seaweed(directory, section, admin, started, time.monotonic() + START_TIMEOUT_S, attempts=8, s3_port=0)
        record: ServerRecord = started[-1]
        # A secure stack (the default) serves S3 over TLS with a certificate from its own CA: pin it.
        ca_file = StackSecurity(directory).ca_file if section.secure else None
        yield admin.model_copy(update={"endpoint_url": record.endpoint, "ca_file": ca_file}), directory, record
    finally:
        stop_servers(started)


def _failed(attempts: list[Attempt]) -> list[Attempt]:
    return [a for a in attempts if not a.ok]


def _allowed_by_role(attempts: list[Attempt]) -> dict[str, set[tuple[str, str]]]:
    allowed: dict[str, set[tuple[str, str]]] = {role.value: set() for role in WORKER_ROLES}
    for a in attempts:
        if a.expected_allowed:
            allowed[a.role].add((a.operation, a.target))
    return allowed


@pytest.mark.integration
def test_every_role_is_refused_everything_but_its_grants(seaweed):
    admin, directory, _ = seaweed
    creds = {role: role_credentials(directory, role, RUN) for role in WORKER_ROLES}
    attempts = s3_permission_matrix(admin, RUN, creds)

    assert _failed(attempts) == []
    assert _allowed_by_role(attempts) == EXPECTED_ALLOWED
    counts = matrix_counts(attempts)
    print("S3 permission matrix (stack identities):", counts)
    assert counts["forbidden_refused"] == counts["forbidden_attempted"] > 0
    assert counts["allowed_ok"] == counts["allowed_attempted"] > 0
    # Every role tried put, get, list and delete on 12 prefixes of its run and 12 of another run, and
    # the two admin operations (create a bucket, create an IAM user).
    assert len(attempts) == len(WORKER_ROLES) * (4 * 12 * 2 + 2)
    assert {a.outcome for a in attempts if a.operation == "delete"} == {"refused"}
    assert {a.outcome for a in attempts if a.target.startswith("other-run")} == {"refused"}


@pytest.mark.integration
def test_the_admin_identity_is_the_configured_one(seaweed):
    admin, directory, _ = seaweed
    store = S3BlobStore(admin)
    ref = store.put_bytes(b"admin can", key=f"anything/{new_run_id()}")
    assert store.get_bytes(ref.uri) == b"admin can"
    identities = (directory / IDENTITIES_FILE).read_text()
    assert f'"name": "{ADMIN}"' in identities and admin.access_key_id in identities


@pytest.mark.integration
def test_a_token_identity_works_once_added_and_is_refused_once_revoked_without_a_restart(seaweed):
    admin, _, record = seaweed
    run, token_id = new_run_id(), new_run_id()
    seeded = S3BlobStore(admin).put_bytes(b"version blob", key=f"runs/{run}/policy/v1/blob")
    token = add_token_identity(admin, Role.SAMPLER, run, token_id)
    as_token = S3BlobStore(token.applied_to(admin).model_copy(update={"max_attempts": 1}))

    _wait_until(lambda: _reads(as_token, seeded.uri), "the token's key to be accepted")
    attempts = s3_permission_matrix(admin, run, {Role.SAMPLER: token})
    assert _failed(attempts) == []
    assert _allowed_by_role(attempts)["sampler"] == EXPECTED_ALLOWED["sampler"]
    print("S3 permission matrix (token identity):", matrix_counts(attempts))

    assert revoke_token_identity(admin, token_id)
    _wait_until(lambda: not _reads(as_token, seeded.uri), "the revoked key to be refused")
    with pytest.raises(BlobAccessDenied, match=f"access key {token.access_key_id}.*InvalidAccessKeyId"):
        as_token.get_bytes(seeded.uri)
    assert not revoke_token_identity(admin, token_id), "revoking twice is not an error"
    assert is_running(record), "the same SeaweedFS process served the whole test"


@pytest.mark.integration
def test_a_token_for_one_run_is_refused_in_another_and_its_refusal_names_key_and_operation(seaweed):
    admin, _, _ = seaweed
    run, token_id = new_run_id(), new_run_id()
    token = add_token_identity(admin, Role.REWARDS, run, token_id)
    try:
        as_token = S3BlobStore(token.applied_to(admin).model_copy(update={"max_attempts": 1}))
        _wait_until(lambda: _writes(as_token, f"claims/{run}/reward/x"), "the token's key to be accepted")
        with pytest.raises(BlobAccessDenied) as refused:
            as_token.put_bytes(b"forged", key=f"runs/{run}/policy/v1/blob")
        assert not isinstance(refused.value, TransientError)
        assert "PutObject" in str(refused.value) and token.access_key_id in str(refused.value)
        assert "AccessDenied" in str(refused.value) and "role" in refused.value.hint
        with pytest.raises(BlobAccessDenied):
            as_token.put_bytes(b"elsewhere", key=f"claims/{new_run_id()}/reward/x")
    finally:
        revoke_token_identity(admin, token_id)


def _reads(store: S3BlobStore, uri: str) -> bool:
    try:
        store.get_bytes(uri)
    except BlobAccessDenied:
        return False
    return True


def _writes(store: S3BlobStore, key: str) -> bool:
    try:
        store.put_bytes(b"x", key=key)
    except BlobAccessDenied:
        return False
    return True


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll for an identity change to take effect; the bound only turns a hang into a failure."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {HANG_GUARD_S:.0f}s for {what}"
        time.sleep(0.05)


def test_role_credentials_apply_to_blob_settings():
    creds = RoleCredentials("AKID", SecretStr("s3cret"), "sampler-r1")
    applied = creds.applied_to(S3BlobSettings(bucket="other-bucket"))
    assert applied.access_key_id == "AKID" and applied.secret_access_key.get_secret_value() == "s3cret"
    assert applied.bucket == "other-bucket"


@pytest.mark.integration
async def test_claim_checks_go_under_their_kind_and_cross_roles_with_each_roles_own_key(event_log, settings):
    """A sampler's large trajectory is claim-checked under `claims/<run>/traj/` with the sampler's key alone,
    and a reward worker resolves it with its own key (session stack; identities added live)."""
    run = settings.run_id
    sampler = add_token_identity(settings.blobs, Role.SAMPLER, run, f"{run}-s")
    rewards = add_token_identity(settings.blobs, Role.REWARDS, run, f"{run}-r")
    logs = []
    try:
        for creds in (sampler, rewards):
            _wait_until(lambda c=creds: _lists_nothing_refused(c, settings.blobs), "the new key to be accepted")
            logs.append(
                await EventLog.connect(settings.model_copy(update={"blobs": creds.applied_to(settings.blobs)}), "t")
            )
        as_sampler, as_rewards = logs
        big = trajectory(run, "big-1", output_tokens=20_000)
        result = await as_sampler.append(big)
        assert result.claim_checked
        msg = await event_log.js.get_msg("TRAJECTORIES", result.seq)
        claim = decode_event(msg.data)
        assert claim.uri.startswith(f"s3://{settings.blobs.bucket}/claims/{run}/traj/")
        assert (await as_rewards.resolve(msg.data, subject=msg.subject)).event_id == big.event_id
    finally:
        for log in logs:
            await log.close()
        revoke_token_identity(settings.blobs, f"{run}-s")
        revoke_token_identity(settings.blobs, f"{run}-r")


def _lists_nothing_refused(creds: RoleCredentials, blobs: S3BlobSettings) -> bool:
    """Whether the key is known yet: an unknown key is InvalidAccessKeyId, a known one AccessDenied here."""
    try:
        S3BlobStore(creds.applied_to(blobs).model_copy(update={"max_attempts": 1})).list_keys("nobody-lists-this/")
    except BlobAccessDenied as exc:
        return "InvalidAccessKeyId" not in str(exc)
    return True
