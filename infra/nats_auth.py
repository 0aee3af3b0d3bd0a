"""Who may connect to the log: NATS's decentralized auth (an operator, one account, user JWTs).

Why JWTs rather than users listed in the server's config: a join token must carry an identity that
expires by itself (`--ttl`) and can be revoked without restarting the log; with JWTs both are the
server's own mechanisms (a user JWT's `exp`, the account's revocation list), every user is a key pair
whose private half never reaches the server, and a new island needs no server change at all: the
stack signs a JWT for it with the account key, offline. Users listed in the config would need a
config edit and reload per island and have no expiry.

Layout, in `<stack>/auth/` (owner-only): the operator's, the account's and the system account's
nkey seeds, and the revocation list. The server is configured with the operator JWT and the two
account JWTs preloaded (`resolver: MEMORY`); a revocation rewrites the account JWT and reloads the
server (SIGHUP), which closes the revoked user's connections.

A JWT here is what the NATS JWT v2 library writes: base64url(header).base64url(claims).base64url(
ed25519 signature by the issuer's nkey over the first two parts), header `{"typ":"JWT","alg":"ed25519-nkey"}`.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys

from infra.pki import write_private

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
UNLIMITED = -1

ACCOUNT_LIMITS = {"conn": 4096, "subs": 262_144, "streams": 256, "consumer": 100_000}
"""Bounds on the whole account, so a hostile island cannot exhaust the server's connections and consumers.
Far above what runs use: a run declares 7 streams and about 10 durable consumers, and each worker holds
a few connections. Storage is bounded by `storage_limits`."""


def storage_limits(store: Path) -> dict[str, int]:
    """The account's JetStream storage: a quarter of this machine's memory and half the free disk under
    `store`, both below what nats-server reserves for itself by default (75% of each), which it checks:
    an account asking for more than the server has gets no JetStream at all."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"mem_storage": memory // 4, "disk_storage": shutil.disk_usage(store).free // 2}


WORKER_MAX_SUBSCRIPTIONS = 256
"""Subscriptions one worker connection may hold (its inbox, a live feed or two, a handful of consumers)."""


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_seed(prefix: int) -> str:
    return nkeys.encode_seed(secrets.token_bytes(32), prefix).decode()


def _keypair(seed: str) -> nkeys.KeyPair:
    return nkeys.from_seed(seed.encode())


def public_key(seed: str) -> str:
    return _keypair(seed).public_key.decode()


def encode_jwt(issuer_seed: str, subject: str, name: str, nats: dict, *, expires_at: int | None = None) -> str:
    """Sign claims about `subject` (a public nkey) with the issuer's seed."""
    issuer = _keypair(issuer_seed)
    claims: dict[str, object] = {
        "jti": secrets.token_hex(16),
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": nats,
    }
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    body = f"{_b64url(json.dumps(_HEADER).encode())}.{_b64url(json.dumps(claims, separators=(',', ':')).encode())}"
    return f"{body}.{_b64url(issuer.sign(body.encode()))}"


def decode_claims(token: str) -> dict:
    """The claims of a JWT, unverified (for showing what a token holds)."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


@dataclass(frozen=True)
class Permissions:
    """What one user may publish and subscribe to (NATS subjects, wildcards allowed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    """Exceptions to `publish` (a deny wins over an allow in NATS)."""

    def claims(self) -> dict:
        pub: dict[str, list[str]] = {"allow": list(self.publish)}
        if self.deny_publish:
            pub["deny"] = list(self.deny_publish)
        return {"pub": pub, "sub": {"allow": list(self.subscribe)}}


@dataclass(frozen=True)
class UserCredentials:
    """One connecting identity: its JWT, its private seed, and the NATS creds file text holding both."""

    jwt: str
    seed: str

    @property
    def public_key(self) -> str:
        return public_key(self.seed)

    def creds_text(self) -> str:
        """The `.creds` format nats clients read (`nats.creds_file`)."""
        return (
            "-----BEGIN NATS USER JWT-----\n"
            f"{self.jwt}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{self.seed}\n"
            "------END USER NKEY SEED------\n\n"
            "*************************************************************\n"
        )

    def write(self, path: Path) -> Path:
        return write_private(path, self.creds_text().encode())


class NatsAuthority:
    """The operator and accounts of one stack folder, created on first use and kept (clients' JWTs stay
    valid across stack restarts)."""

    def __init__(self, directory: Path):
        self.directory = directory
        keys_file = directory / "nkeys.json"
        if keys_file.exists():
            keys = json.loads(keys_file.read_text())
        else:
            keys = {
                "operator": _new_seed(nkeys.PREFIX_BYTE_OPERATOR),
                "account": _new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
                "system": _new_seed(nkeys.PREFIX_BYTE_ACCOUNT),
            }
            write_private(keys_file, json.dumps(keys).encode())
        self._operator_seed: str = keys["operator"]
        self._account_seed: str = keys["account"]
        self._system_seed: str = keys["system"]
        self._revocations_file = directory / "revocations.json"

    @property
    def account(self) -> str:
        return public_key(self._account_seed)

    @property
    def system_account(self) -> str:
        return public_key(self._system_seed)

    def revocations(self) -> dict[str, int]:
        """Revoked user public keys -> when (unix seconds): JWTs of that user issued before are refused."""
        if not self._revocations_file.exists():
            return {}
        return json.loads(self._revocations_file.read_text())

    def revoke(self, user_public_key: str) -> None:
        """Add a user to the account's revocation list (the server learns it at its next reload)."""
        revoked = self.revocations()
        # The second after now: NATS refuses JWTs issued at or before the revocation time.
        revoked[user_public_key] = int(time.time()) + 1
        write_private(self._revocations_file, json.dumps(revoked, indent=1).encode())

    def _kept(self, name: str, make) -> str:
        """A JWT made once and kept: nats-server refuses a reload whose operator differs in any claim."""
        path = self.directory / f"{name}.jwt"
        if not path.exists():
            write_private(path, make().encode())
        return path.read_text()

    def operator_jwt(self) -> str:
        operator = public_key(self._operator_seed)
        nats = {"type": "operator", "version": 2, "system_account": self.system_account}
        return self._kept("operator", lambda: encode_jwt(self._operator_seed, operator, "sprawl", nats))

    def account_jwt(self) -> str:
        limits = {
            "data": UNLIMITED,
            "payload": UNLIMITED,
            "imports": UNLIMITED,
            "exports": UNLIMITED,
            "wildcards": True,
            "leaf": UNLIMITED,
            **ACCOUNT_LIMITS,
            # JetStream is on for an account whose storage limits are not 0.
            **storage_limits(self.directory),
        }
        nats: dict[str, object] = {
            "limits": limits,
            # A user's permissions are always its own JWT's; with no default nothing is allowed.
            "default_permissions": {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}},
            "type": "account",
            "version": 2,
        }
        if revoked := self.revocations():
            nats["revocations"] = revoked
        return encode_jwt(self._operator_seed, self.account, "sprawl", nats)

    def system_account_jwt(self) -> str:
        nats = {"limits": {"subs": -1, "data": -1, "payload": -1, "conn": -1}, "type": "account", "version": 2}
        return self._kept("system", lambda: encode_jwt(self._operator_seed, self.system_account, "SYS", nats))

    def server_config(self) -> str:
        """The nats.conf lines that make the server trust this operator and know its accounts."""
        preload = {self.account: self.account_jwt(), self.system_account: self.system_account_jwt()}
        lines = [
            f"operator: {json.dumps(self.operator_jwt())}",
            f"system_account: {self.system_account}",
            "resolver: MEMORY",
            "resolver_preload: {",
            *(f"  {key}: {json.dumps(jwt)}" for key, jwt in preload.items()),
            "}",
        ]
        return "\n".join(lines)

    def issue(
        self, name: str, permissions: Permissions, *, expires_at: int | None = None, max_subscriptions: int = UNLIMITED
    ) -> UserCredentials:
        """A new user of the account: its own key pair, a JWT with `permissions`, expiring at `expires_at`,
        holding at most `max_subscriptions` at once (per connection)."""
        seed = _new_seed(nkeys.PREFIX_BYTE_USER)
        nats = {**permissions.claims(), "subs": max_subscriptions, "data": UNLIMITED, "payload": UNLIMITED}
        nats.update({"type": "user", "version": 2})
        jwt = encode_jwt(self._account_seed, public_key(seed), name, nats, expires_at=expires_at)
        return UserCredentials(jwt=jwt, seed=seed)


def signal_reload(pid: int) -> None:
    """Make nats-server read its config again (new revocations; clients of revoked users are closed)."""
    os.kill(pid, 1)  # SIGHUP
