"""Join tokens: made by the stack's owner, used by a worker on any machine, revoked by the owner.

A token gets its own identities — a NATS user (JWT signed by the stack's account key, expiring with the
token) and an S3 IAM user with the role's grants — so revoking one island leaves every other running.
The stack keeps a list of issued tokens (`<stack>/auth/tokens.json`: ids, roles, public keys, never
secrets) for `sprawl token list` and `revoke`.

Revoking: the NATS user goes on the account's revocation list and nats-server reloads (its open
connections are closed at once, and it cannot connect again); the S3 user and its key are deleted.
An expired token is refused by nats-server by itself; its S3 key stays until it is revoked (S3 keys
have no expiry here), so `sprawl token revoke --expired` cleans those up.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from infra import s3_identities
from infra.nats_auth import signal_reload
from infra.nats_permissions import inbox_prefix
from infra.pki import write_private
from infra.roles import Role
from infra.server_process import is_running
from infra.stack import admin_blobs
from infra.stack_security import StackSecurity
from infra.stack_state import StackStatus, stack_dir
from pipeline.config import SprawlSettings
from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from schemas.join_token import JOIN_TOKEN_PREFIX, JoinS3, JoinToken

log = get_logger(__name__)

JOINABLE = (Role.SAMPLER, Role.REWARDS, Role.AUDITOR, Role.ARCHIVER)
"""Roles a token can carry: the trainer and the stack's admin stay in the cluster."""


class JoinTokenError(SprawlError):
    """A token that cannot be made or used: malformed, expired, or for a stack that is not secure."""


def encode(token: JoinToken) -> str:
    return JOIN_TOKEN_PREFIX + base64.urlsafe_b64encode(msgspec.json.encode(token)).rstrip(b"=").decode()


def decode(text: str) -> JoinToken:
    """The token in `text`, or JoinTokenError saying what is wrong with it (never what it holds)."""
    text = text.strip()
    if not text.startswith(JOIN_TOKEN_PREFIX):
        raise JoinTokenError(
            "this is not a sprawl join token", hint=f"a token starts with {JOIN_TOKEN_PREFIX!r}: copy it whole"
        )
    body = text.removeprefix(JOIN_TOKEN_PREFIX)
    try:
        token = msgspec.json.decode(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), type=JoinToken)
    except (binascii.Error, ValueError, msgspec.DecodeError) as exc:
        raise JoinTokenError(
            f"the join token is damaged ({type(exc).__name__})", hint="copy it again, whole, from `sprawl token create`"
        ) from None
    if token.expires_at is not None and token.expires_at <= time.time():
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(token.expires_at))
        raise JoinTokenError(f"join token {token.token_id} expired at {when}", hint="ask the run's owner for a new one")
    return token


@dataclass(frozen=True)
class IssuedToken:
    text: str
    token: JoinToken


def _registry(directory: Path) -> Path:
    return directory / "auth" / "tokens.json"


def _read_registry(directory: Path) -> dict[str, dict]:
    path = _registry(directory)
    return json.loads(path.read_text()) if path.exists() else {}


def create_token(
    settings: SprawlSettings,
    st: StackStatus,
    role: Role | str,
    *,
    ttl_s: float | None,
    nats_urls: list[str] | None = None,
    s3_endpoint: str | None = None,
    version_public_key: str,
) -> IssuedToken:
    """A token for `role` in `settings.run_id` on the running stack `st`. `nats_urls`/`s3_endpoint`: how
    the worker reaches the stack from where it runs (default: as recorded, 127.0.0.1: this machine)."""
    role = Role(role)
    if role not in JOINABLE:
        raise JoinTokenError(
            f"a join token cannot carry the {role.value} role",
            hint=f"one of: {', '.join(r.value for r in JOINABLE)} (the trainer runs beside the stack)",
        )
    if not st.secure:
        raise JoinTokenError(
            "the stack is not secure: there are no identities to hand out",
            hint="start it with stack.secure on (the default): `sprawl stack down && sprawl stack up`",
        )
    directory = stack_dir(settings)
    security = StackSecurity(directory)
    token_id = secrets.token_hex(6)
    now = int(time.time())
    expires_at = int(now + ttl_s) if ttl_s else None
    identity = f"{role.value}-{token_id}"
    creds = security.issue(role, settings.run_id, token_id, expires_at=expires_at)
    admin = admin_blobs(settings, st)
    s3_key = s3_identities.add_token_identity(admin, role.value, settings.run_id, token_id)
    registry = _read_registry(directory)
    registry[token_id] = {
        "role": role.value,
        "run_id": settings.run_id,
        "nats_user": creds.public_key,
        "s3_identity": s3_key.identity,
        "issued_at": now,
        "expires_at": expires_at,
        "revoked_at": None,
    }
    write_private(_registry(directory), json.dumps(registry, indent=1).encode())
    token = JoinToken(
        token_id=token_id,
        run_id=settings.run_id,
        role=role.value,
        nats_urls=nats_urls or [u.strip() for u in st.nats_url.split(",")],
        nats_ca_pem=security.ca_file.read_text(),
        nats_creds=creds.creds_text(),
        inbox_prefix=inbox_prefix(role, token_id),
        s3=JoinS3(
            endpoint_url=s3_endpoint or st.s3_endpoint,
            region=admin.region,
            bucket=admin.bucket,
            access_key_id=s3_key.access_key_id,
            secret_access_key=s3_key.secret_access_key.get_secret_value(),
            ca_pem=security.ca_file.read_text() if (s3_endpoint or st.s3_endpoint).startswith("https") else "",
        ),
        version_public_key=version_public_key,
        expires_at=expires_at,
        issued_at=now,
    )
    log.info("join token created", token_id=token_id, role=role.value, identity=identity, expires_at=expires_at)
    return IssuedToken(encode(token), token)


def list_tokens(settings: SprawlSettings) -> dict[str, dict]:
    return _read_registry(stack_dir(settings))


def revoke_expired(settings: SprawlSettings, st: StackStatus) -> list[str]:
    """Delete the S3 identities of tokens past their expiry (nats-server refuses them by itself; S3 keys
    have no expiry here: SeaweedFS does not evaluate time conditions). Run by every `sprawl token` and
    `sprawl stack` command and by `sprawl up`; returns the ids swept."""
    directory = stack_dir(settings)
    registry = _read_registry(directory)
    now = time.time()
    expired = [tid for tid, e in registry.items() if e["expires_at"] and e["expires_at"] <= now and not e["revoked_at"]]
    for token_id in expired:
        s3_identities.revoke_token_identity(admin_blobs(settings, st), token_id)
        registry[token_id]["revoked_at"] = int(now)
        log.info("expired join token's S3 identity deleted", token_id=token_id)
    if expired:
        write_private(_registry(directory), json.dumps(registry, indent=1).encode())
    return expired


def revoke_token(settings: SprawlSettings, st: StackStatus, token_id: str) -> list[str]:
    """Revoke `token_id` on the log and the blob store; returns what was done."""
    directory = stack_dir(settings)
    registry = _read_registry(directory)
    entry = registry.get(token_id)
    if entry is None:
        raise JoinTokenError(f"no token {token_id!r} was issued by this stack", hint="`sprawl token list` shows them")
    security = StackSecurity(directory)
    security.authority.revoke(entry["nats_user"])
    security.write_auth_conf()
    # Every node holds the revocation list in its own config: each live one reloads it now, and a dead
    # one reads it when `stack up` starts it again (before it takes a client).
    nodes = st.nats_servers()
    live = [node for node in nodes if is_running(node)]
    for node in live:
        with contextlib.suppress(ProcessLookupError):  # died since: it reads the file when restarted
            signal_reload(node.pid)
    if len(nodes) == 1:
        reloaded = "nats-server reloaded" if live else "nats-server is down: it reads it when started"
    else:
        reloaded = (
            f"{len(live)} of {len(nodes)} nats-server nodes reloaded"
            if len(live) < len(nodes)
            else (f"all {len(nodes)} nats-server nodes reloaded")
        )
    done = [f"NATS user {entry['nats_user'][:12]}… revoked ({reloaded})"]
    if s3_identities.revoke_token_identity(admin_blobs(settings, st), token_id):
        done.append(f"S3 identity {entry['s3_identity']} deleted")
    entry["revoked_at"] = int(time.time())
    write_private(_registry(directory), json.dumps(registry, indent=1).encode())
    log.warning("join token revoked", token_id=token_id, role=entry["role"])
    return done


def join_settings(text: str, state_dir: Path) -> dict[str, object]:
    """The settings a worker joining with token `text` runs with (the credentials are written as files
    under `<state_dir>/join/<token id>/`, owner-only): a dict of overrides for its settings model."""
    token = decode(text)
    folder = state_dir.resolve() / "join" / token.token_id
    ca_file = folder / "ca.pem"
    ca_file.parent.mkdir(parents=True, exist_ok=True)
    ca_file.write_text(token.nats_ca_pem)
    creds_file = write_private(folder / "user.creds", token.nats_creds.encode())
    s3_ca = None
    if token.s3.ca_pem:
        s3_ca = folder / "s3-ca.pem"
        s3_ca.write_text(token.s3.ca_pem)
    nats = {
        "url": ",".join(token.nats_urls),
        "creds_file": creds_file,
        "tls_ca_file": ca_file,
        "inbox_prefix": token.inbox_prefix,
    }
    if token.nats_server_name:
        nats["tls_server_name"] = token.nats_server_name
    blobs = {
        "type": "s3",
        "endpoint_url": token.s3.endpoint_url,
        "region": token.s3.region,
        "bucket": token.s3.bucket,
        "access_key_id": token.s3.access_key_id,
        "secret_access_key": token.s3.secret_access_key,
        "ca_file": s3_ca,
    }
    return {
        "run_id": token.run_id,
        "nats": nats,
        "blobs": blobs,
        "trust": {"version_public_key": token.version_public_key},
    }
