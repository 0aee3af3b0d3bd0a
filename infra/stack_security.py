"""The stack's credentials: TLS for the log, and one identity per role and run (or per join token).

`<stack>/tls/` holds the CA and the server certificates (`infra/pki.py`), `<stack>/auth/` the log's
operator and account keys (`infra/nats_auth.py`) and the users issued so far. A worker started by
this machine gets its role's credentials from here (`role_settings`); a worker elsewhere gets them
in a join token (`infra/join_token.py`).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from pydantic import SecretStr

from infra import s3_identities
from infra.nats_auth import (
    UNLIMITED,
    WORKER_MAX_SUBSCRIPTIONS,
    NatsAuthority,
    Permissions,
    UserCredentials,
    decode_claims,
)
from infra.nats_permissions import inbox_prefix, permissions_for
from infra.pki import SERVER_AND_CLIENT, ServerCertificate, ensure_server_certificate, write_private
from infra.roles import Role
from pipeline.config import NatsSettings, S3BlobSettings

LOCAL_HOSTS = ["127.0.0.1", "localhost"]


class StackSecurity:
    def __init__(self, stack_directory: Path):
        self.directory = stack_directory
        self.tls_dir = stack_directory / "tls"
        self.authority = NatsAuthority(stack_directory / "auth")
        self.users_dir = stack_directory / "auth" / "users"

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.pem"

    def server_certificate(self, server: str, hosts: list[str]) -> ServerCertificate:
        return ensure_server_certificate(self.tls_dir, server, [*LOCAL_HOSTS, *hosts])

    def route_certificate(self) -> ServerCertificate:
        """The certificate a cluster's nodes present to one another (mutual TLS on 127.0.0.1)."""
        return ensure_server_certificate(self.tls_dir, "nats-route", LOCAL_HOSTS, SERVER_AND_CLIENT)

    def nats_config(self, hosts: list[str]) -> list[str]:
        """nats.conf lines: TLS with this stack's certificate, and the operator that signs every user."""
        cert = self.server_certificate("nats", hosts)
        return [
            "tls {",
            f"  cert_file: {json.dumps(str(cert.cert_file))}",
            f"  key_file: {json.dumps(str(cert.key_file))}",
            "  timeout: 5",  # seconds for a handshake: a slow link's first round trips
            "}",
            # Its own file, so a revocation rewrites it and reloads the server without touching the rest.
            f"include {json.dumps(str(self.write_auth_conf().name))}",
        ]

    def write_auth_conf(self) -> Path:
        """`<stack>/auth.conf`: the operator and the accounts, revocations included (public material)."""
        path = self.directory / "auth.conf"
        # Replaced whole, never rewritten in place: a cluster's nodes (and a reloading server) read it
        # while it is written, and a half-written file would start a node that trusts no operator.
        staging = path.with_name(f".auth.conf.{os.getpid()}.tmp")
        staging.write_text(self.authority.server_config() + "\n")
        staging.replace(path)
        return path

    def issue(self, role: Role | str, run_id: str, identity: str, *, expires_at: int | None = None) -> UserCredentials:
        role = Role(role)
        permissions = permissions_for(role, run_id, inbox_prefix(role, identity))
        name = f"{role.value}:{run_id}:{identity}"
        return self.authority.issue(
            name, permissions, expires_at=expires_at, max_subscriptions=_max_subscriptions(role)
        )

    def role_creds_file(self, role: Role | str, run_id: str) -> Path:
        """The credentials of `role` in `run_id` for workers on this machine, issued once and kept."""
        role = Role(role)
        path = self.users_dir / f"{role.value}-{run_id}.creds"
        permissions = permissions_for(role, run_id, inbox_prefix(role, run_id))
        if not path.exists() or self._unusable(path, permissions, _max_subscriptions(role)):
            self.issue(role, run_id, run_id).write(path)
        return path

    def _unusable(self, creds_file: Path, permissions: Permissions, max_subscriptions: int) -> bool:
        """Revoked, expired, or issued with other permissions than the role has now (a newer sprawl)."""
        jwt = creds_file.read_text().split("-----BEGIN NATS USER JWT-----\n", 1)[1].split("\n", 1)[0]
        claims = decode_claims(jwt)
        revoked_at = self.authority.revocations().get(claims["sub"])
        expired = claims.get("exp") is not None and claims["exp"] <= time.time()
        granted = {key: claims["nats"].get(key) for key in ("pub", "sub")}
        outdated = granted != permissions.claims() or claims["nats"].get("subs") != max_subscriptions
        return expired or outdated or (revoked_at is not None and claims["iat"] <= revoked_at)

    def blob_settings(self, admin: S3BlobSettings, role: Role | str, run_id: str) -> S3BlobSettings:
        """`admin` (the stack's endpoint and bucket) with the S3 identity of `role` in `run_id`: made
        through the IAM API on first use (a live change, no restart) and kept in the stack folder."""
        role = Role(role)
        if role is Role.ADMIN:
            return admin
        path = self.users_dir / f"{role.value}-{run_id}.s3.json"
        self.users_dir.mkdir(parents=True, exist_ok=True)
        # Workers of one role start together (islands): one of them makes the identity, the others read it.
        with open(self.users_dir / ".s3-identities.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                saved = json.loads(path.read_text())
                key = s3_identities.RoleCredentials(
                    saved["access_key_id"], SecretStr(saved["secret"]), saved["identity"]
                )
            else:
                name = f"role-{role.value}-{run_id}"
                try:
                    key = s3_identities.add_token_identity(admin, role.value, run_id, name)
                except s3_identities.S3IdentityError as exc:
                    if "EntityAlreadyExists" not in str(exc):
                        raise
                    # Made before, its keys lost with a crash before they were written down: start over.
                    s3_identities.revoke_token_identity(admin, name)
                    key = s3_identities.add_token_identity(admin, role.value, run_id, name)
                record = {"access_key_id": key.access_key_id, "secret": key.secret_access_key.get_secret_value()}
                write_private(path, json.dumps({**record, "identity": key.identity}).encode())
        return key.applied_to(admin)

    def nats_settings(self, nats: NatsSettings, url: str, role: Role | str, run_id: str) -> NatsSettings:
        """`nats` pointed at this stack as `role` of `run_id`: TLS pinned to its CA, the role's creds."""
        return nats.model_copy(
            update={
                "url": url,
                "tls_ca_file": self.ca_file,
                "creds_file": self.role_creds_file(role, run_id),
                "inbox_prefix": inbox_prefix(role, run_id),
                "user": None,
                "password": None,
            }
        )


def _max_subscriptions(role: Role) -> int:
    """The admin (the stack's own commands, `sprawl up`) is trusted; every worker role is bounded."""
    return UNLIMITED if role is Role.ADMIN else WORKER_MAX_SUBSCRIPTIONS
