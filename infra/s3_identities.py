"""S3 identities per role: what each role may do in the bucket (as data), the same grants as an AWS IAM
policy, the local stack's identities file, per-token identities added and revoked live, and the
permission matrix that proves the grants hold.

One source for every grant: `GRANTS` below. From it come
- `iam_policy(role, run, bucket)`: an AWS IAM policy document (production S3: AWS; any S3 that takes
  IAM policies). SeaweedFS 4.x evaluates the very same document: the identities file attaches it to
  each role's identity by `policyNames` (its legacy `actions` strings, `Read:bucket/prefix*`, cannot
  tell a put from a delete: `Write` allows DeleteObject);
- `write_identities(...)`: `<stack>/s3-identities.json`, the file `weed mini -s3.config` reads at start:
  `admin` (the configured credentials, every action) and one identity per role of the stack's run;
- `add_token_identity` / `revoke_token_identity`: an IAM user with its own access key and the role's
  policy, through the IAM API. SeaweedFS serves that API on its S3 port (`-s3.iam.readOnly=false`,
  admin credentials only) and applies a change at once, without a restart; AWS IAM takes the same calls.
- `s3_permission_matrix(...)`: every role tries every operation on every prefix; the expected outcome
  is `allows(...)`, computed from the same grants.

Key layout (one bucket): `runs/<run>/policy/` version blobs, `runs/<run>/lineage/`, `runs/<run>/trainer/`
checkpoints, `claims/<run>/<kind>/` claim checks per event kind, `archive/run_id=<run>/` the archive.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import structlog
from pydantic import SecretStr

from infra.roles import GRANTS, WORKER_ROLES, Role
from pipeline.config import S3BlobSettings
from pipeline.errors import SprawlError
from pipeline.eventlog import claims_prefix
from pipeline.topology import Kind, token
from schemas.archive import run_prefix as archive_prefix

log = structlog.get_logger(__name__)

IDENTITIES_FILE = "s3-identities.json"
"""In the stack folder: what `weed mini -s3.config` reads (secrets inside: mode 0600)."""
ADMIN = "admin"
"""The stack's own identity (`sprawl stack`, `sprawl infra apply`, benchmarks): every action."""
ADMIN_ACTIONS = ["Admin", "Read", "Write", "List", "Tagging"]


class Access(StrEnum):
    """What a grant lets an identity do under a key prefix."""

    READ = "read"
    """GetObject (and HeadObject, which S3 authorises as GetObject)."""
    WRITE = "write"
    """PutObject, multipart uploads included. Never DeleteObject: no role deletes anything."""
    LIST = "list"
    """ListObjectsV2 with a prefix under this one."""


class S3IdentityError(SprawlError):
    pass


# ---------------------------------------------------------------- the grants, as data


@dataclass(frozen=True)
class Grant:
    access: Access
    prefix: str
    """A key prefix of one run, ending in `/`."""

    def covers(self, access: Access, key: str) -> bool:
        return access == self.access and key.startswith(self.prefix)


def run_prefix(run_id: str) -> str:
    """`runs/<run>/`: version blobs (`policy/`), lineage (`lineage/`), trainer checkpoints (`trainer/`)."""
    return f"runs/{run_id}/"


def policy_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}policy/"


def claim_prefix(run_id: str, kind: Kind) -> str:
    return f"{claims_prefix(run_id, kind.value)}/"


def run_claims_prefix(run_id: str) -> str:
    return f"claims/{run_id}/"


def grants(role: Role | str, run_id: str) -> tuple[Grant, ...]:
    """Everything `role` may do in run `run_id`; anything else is refused."""
    role, run = Role(role), token(run_id, "run_id")  # a run id is a subject token: no `*`, `?` or `/`
    reads = [Grant(Access.READ, claim_prefix(run, kind)) for kind in GRANTS[role].consumes]
    writes = [Grant(Access.WRITE, claim_prefix(run, kind)) for kind in GRANTS[role].publishes]
    match role:
        case Role.TRAINER:  # version blobs, lineage, checkpoints: written and read back on resume
            own = [Grant(Access.READ, run_prefix(run)), Grant(Access.WRITE, run_prefix(run))]
        case Role.SAMPLER:  # materialize: GETs of the blobs a version names; never lists
            own = [Grant(Access.READ, policy_prefix(run))]
        case Role.REWARDS:
            own = []
        case Role.ARCHIVER:  # lists its files to resume, reads the last one back, writes new ones
            own = [Grant(access, archive_prefix(run)) for access in Access]
        case Role.AUDITOR:  # `sprawl audit` / `sprawl sql` (DuckDB globs list), lineage, version blobs
            prefixes = (run_prefix(run), run_claims_prefix(run), archive_prefix(run))
            own = [Grant(access, p) for p in prefixes for access in (Access.READ, Access.LIST)]
            reads = []  # covered by the whole run's claims
    return tuple(own + reads + writes)


def allows(role: Role | str, run_id: str, access: Access, key: str) -> bool:
    """Whether `role` in `run_id` may do `access` on `key` (a LIST: on the listing's prefix)."""
    return any(g.covers(access, key) for g in grants(role, run_id))


# ---------------------------------------------------------------- the grants as an IAM policy

_WRITE_ACTIONS = ["s3:PutObject", "s3:AbortMultipartUpload"]
"""PutObject also authorises CreateMultipartUpload, UploadPart and CompleteMultipartUpload; boto3 aborts
a failed multipart upload, which needs its own action. No s3:DeleteObject."""


def iam_policy(role: Role | str, run_id: str, bucket: str) -> dict[str, Any]:
    """The AWS IAM policy document granting exactly `grants(role, run_id)` in `bucket`."""
    by_access: dict[Access, list[str]] = {access: [] for access in Access}
    for grant in grants(role, run_id):
        by_access[grant.access].append(grant.prefix)
    statements: list[dict[str, Any]] = []
    if by_access[Access.READ]:
        statements.append(_objects("Read", ["s3:GetObject"], bucket, by_access[Access.READ]))
    if by_access[Access.WRITE]:
        statements.append(_objects("Write", _WRITE_ACTIONS, bucket, by_access[Access.WRITE]))
    if by_access[Access.LIST]:
        # ListBucket is a bucket action: the prefix a listing may ask for is a condition on it.
        statements.append(
            {
                "Sid": "List",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in by_access[Access.LIST]]}},
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def _objects(sid: str, actions: list[str], bucket: str, prefixes: list[str]) -> dict[str, Any]:
    resources = [f"arn:aws:s3:::{bucket}/{p}*" for p in prefixes]
    return {"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": resources}


# ---------------------------------------------------------------- credentials


@dataclass(frozen=True)
class RoleCredentials:
    access_key_id: str
    secret_access_key: SecretStr = field(repr=False)
    identity: str = ""
    """The identity (IAM user) name the key belongs to."""

    def applied_to(self, blobs: S3BlobSettings) -> S3BlobSettings:
        """`blobs` (endpoint, region, bucket, CA) with this identity's key."""
        return blobs.model_copy(
            update={"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        )

    @classmethod
    def of(cls, blobs: S3BlobSettings, identity: str = ADMIN) -> RoleCredentials:
        return cls(blobs.access_key_id, blobs.secret_access_key, identity)


def role_identity(role: Role | str, run_id: str) -> str:
    """The identity (and policy) name of a role in a run, as the stack's identities file names it."""
    return f"{Role(role).value}-{token(run_id, 'run_id')}"


# ---------------------------------------------------------------- the stack's identities file


def write_identities(stack_dir: Path, admin: S3BlobSettings, run_id: str | None, bucket: str) -> Path:
    """Write `<stack_dir>/s3-identities.json` (mode 0600): `admin` with the configured credentials and
    every action, and one identity per role of `run_id` (random keys; None: no new run) with its IAM
    policy in `bucket` attached.

    A role's keys, once generated, are kept: starting SeaweedFS again (a repair, another `stack up`)
    must not invalidate the credentials already handed to workers and join tokens. Roles of other
    runs named in the file are kept too."""
    path = stack_dir / IDENTITIES_FILE
    current = _read(path)
    kept = {i["name"]: i for i in current.get("identities", []) if i.get("name") != ADMIN}
    policies = {p["name"]: p for p in current.get("policies", [])}
    for role in WORKER_ROLES if run_id is not None else ():
        name = role_identity(role, run_id)
        if name not in kept:
            key = RoleCredentials(f"{role.value[:4].upper()}{secrets.token_hex(8).upper()}", _new_secret(), name)
            kept[name] = _identity(name, key, policy_names=[name])
        policies[name] = {"name": name, "content": json.dumps(iam_policy(role, run_id, bucket))}
    config = {
        "identities": [_identity(ADMIN, RoleCredentials.of(admin), actions=ADMIN_ACTIONS), *kept.values()],
        "policies": list(policies.values()),
    }
    _write_private(path, json.dumps(config, indent=2))
    return path


def role_credentials(stack_dir: Path, role: Role | str, run_id: str) -> RoleCredentials:
    """The keys of `role` in `run_id`, as `write_identities` generated them."""
    name = role_identity(role, run_id)
    for identity in _read(stack_dir / IDENTITIES_FILE).get("identities", []):
        if identity.get("name") == name:
            cred = identity["credentials"][0]
            return RoleCredentials(cred["accessKey"], SecretStr(cred["secretKey"]), name)
    raise S3IdentityError(
        f"no S3 identity for role {Role(role).value} of run {run_id} in {stack_dir / IDENTITIES_FILE}",
        hint="the stack writes one per role of its own run when SeaweedFS starts (`sprawl stack up`); "
        "for another run, issue a token identity (`add_token_identity`)",
    )


def _identity(
    name: str, key: RoleCredentials, *, actions: list[str] | None = None, policy_names: list[str] | None = None
) -> dict[str, Any]:
    identity: dict[str, Any] = {
        "name": name,
        "credentials": [{"accessKey": key.access_key_id, "secretKey": key.secret_access_key.get_secret_value()}],
    }
    if actions:
        identity["actions"] = actions
    if policy_names:
        identity["policyNames"] = policy_names
    return identity


def _new_secret() -> SecretStr:
    return SecretStr(secrets.token_urlsafe(30))


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise S3IdentityError(
            f"{path} is not valid JSON: {exc}", hint="remove it; the stack writes it again when SeaweedFS starts"
        ) from exc


def _write_private(path: Path, text: str) -> None:
    """Write `text` readable by the owner only, from its first byte (never world-readable, even briefly),
    and atomically (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- per-token identities, live

_IAM_NAME = re.compile(r"^[A-Za-z0-9_+=,.@-]{1,48}$")
TOKEN_POLICY = "sprawl-grants"
"""The name of the inline policy a token identity carries."""


def token_identity(token_id: str) -> str:
    """The IAM user a token's key belongs to."""
    if not _IAM_NAME.fullmatch(token_id):
        raise S3IdentityError(
            f"token id {token_id!r} cannot name an IAM user", hint="use at most 48 letters, digits or _+=,.@-"
        )
    return f"sprawl-token-{token_id}"


def add_token_identity(admin: S3BlobSettings, role: Role | str, run_id: str, token_id: str) -> RoleCredentials:
    """A new IAM user for token `token_id`, with `role`'s grants in `run_id` (in `admin.bucket`) and its own
    access key, which it returns. Effective at once on SeaweedFS (its S3 server applies IAM API calls to
    the identities it serves; no restart); AWS IAM may take seconds to propagate."""
    user = token_identity(token_id)
    policy = json.dumps(iam_policy(role, run_id, admin.bucket))
    iam = _iam_client(admin)
    _iam_call(admin, f"create IAM user {user}", iam.create_user, UserName=user)
    grants_of = f"attach the grants of {user}"
    _iam_call(admin, grants_of, iam.put_user_policy, UserName=user, PolicyName=TOKEN_POLICY, PolicyDocument=policy)
    key = _iam_call(admin, f"create an access key for {user}", iam.create_access_key, UserName=user)["AccessKey"]
    log.info("S3 token identity added", identity=user, role=Role(role).value, run_id=run_id)
    return RoleCredentials(key["AccessKeyId"], SecretStr(key["SecretAccessKey"]), user)


def revoke_token_identity(admin: S3BlobSettings, token_id: str) -> bool:
    """Delete token `token_id`'s access keys, its grants and its IAM user: its key is refused from then on.
    False if it did not exist (revoking twice is not an error)."""
    user = token_identity(token_id)
    iam = _iam_client(admin)
    try:
        _iam_call(admin, f"look up IAM user {user}", iam.get_user, UserName=user)
    except _NoSuchEntity:
        return False
    keys = _iam_call(admin, f"list the keys of {user}", iam.list_access_keys, UserName=user)
    # The keys first: from the moment they are gone the token is refused, whatever happens after.
    for key in keys.get("AccessKeyMetadata", []):
        key_id = key["AccessKeyId"]
        _iam_call(admin, f"delete key {key_id} of {user}", iam.delete_access_key, UserName=user, AccessKeyId=key_id)
    with contextlib.suppress(_NoSuchEntity):  # an earlier revoke that stopped half-way
        _iam_call(admin, f"delete the grants of {user}", iam.delete_user_policy, UserName=user, PolicyName=TOKEN_POLICY)
    with contextlib.suppress(_NoSuchEntity):
        _iam_call(admin, f"delete IAM user {user}", iam.delete_user, UserName=user)
    log.info("S3 token identity revoked", identity=user)
    return True


class _NoSuchEntity(S3IdentityError):
    pass


def _iam_client(admin: S3BlobSettings):
    import boto3

    return boto3.client(
        "iam",
        endpoint_url=admin.endpoint_url,  # SeaweedFS: its S3 port; None: AWS IAM
        region_name=admin.region,
        aws_access_key_id=admin.access_key_id,
        aws_secret_access_key=admin.secret_access_key.get_secret_value(),
        verify=str(admin.ca_file) if admin.ca_file else None,
    )


def _iam_call(admin: S3BlobSettings, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(**kwargs)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchEntity":
            raise _NoSuchEntity(f"could not {what}: no such IAM entity") from exc
        raise S3IdentityError(
            f"could not {what} at {admin.endpoint_url or 'AWS IAM'}: {code}: {exc}",
            hint="the IAM API needs the admin credentials; SeaweedFS serves it with -s3.iam.readOnly=false",
        ) from exc
    except BotoCoreError as exc:
        raise S3IdentityError(
            f"could not {what}: {exc}", hint=f"is S3 at {admin.endpoint_url} running? `sprawl stack status`"
        ) from exc


# ---------------------------------------------------------------- the permission matrix


class Operation(StrEnum):
    PUT = "put"
    GET = "get"
    LIST = "list"
    DELETE = "delete"


_NEEDS: Mapping[Operation, Access | None] = {
    Operation.PUT: Access.WRITE,
    Operation.GET: Access.READ,
    Operation.LIST: Access.LIST,
    Operation.DELETE: None,  # no role may delete
}
_REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
PROBE = "sprawl-permission-probe"
"""The name of the objects the matrix writes (and removes with the admin key afterwards)."""


@dataclass(frozen=True)
class Attempt:
    role: str
    operation: str
    target: str
    """What was tried on: a key prefix, or `bucket` / `iam` for the admin operations."""
    expected_allowed: bool
    outcome: str
    """`allowed`, `refused`, or `error: <what happened>` (neither: the matrix could not tell)."""

    @property
    def ok(self) -> bool:
        return self.outcome == ("allowed" if self.expected_allowed else "refused")


def matrix_targets(run_id: str) -> dict[str, str]:
    """The prefixes the matrix tries, by label: everything of the run, per kind of claim."""
    return {
        "policy": policy_prefix(run_id),
        "lineage": f"{run_prefix(run_id)}lineage/",
        "checkpoints": f"{run_prefix(run_id)}trainer/",
        **{f"claims/{kind.value}": claim_prefix(run_id, kind) for kind in Kind},
        "archive": archive_prefix(run_id),
    }


def s3_permission_matrix(
    admin: S3BlobSettings,
    run_id: str,
    creds_by_role: Mapping[Role | str, RoleCredentials],
    *,
    other_run_id: str | None = None,
    probe_iam: bool = True,
) -> list[Attempt]:
    """Each role (its credentials for `run_id`) tries put, get, list and delete on every prefix of
    `run_id` and of `other_run_id` (default `<run>-other`), and the admin operations (create a bucket,
    create an IAM user: `probe_iam`, for endpoints that serve IAM); returns every attempt with what was
    expected (`allows`) and what happened. `admin` (endpoint, bucket, CA, admin key) seeds one object per
    prefix first and removes what the matrix wrote afterwards."""
    other = other_run_id or f"{run_id}-other"
    targets = {**matrix_targets(run_id), **{f"other-run {k}": v for k, v in matrix_targets(other).items()}}
    seeded = [f"{prefix}{PROBE}" for prefix in targets.values()]
    admin_s3 = _s3_client(admin, RoleCredentials.of(admin))
    for key in seeded:
        admin_s3.put_object(Bucket=admin.bucket, Key=key, Body=b"probe")
    attempts: list[Attempt] = []
    written: list[str] = []
    try:
        for role_name, creds in creds_by_role.items():
            role = Role(role_name)
            s3 = _s3_client(admin, creds)
            for operation in Operation:  # delete last: a wrongful delete must not hide a get
                for label, prefix in targets.items():
                    needs = _NEEDS[operation]
                    on = prefix if operation == Operation.LIST else prefix + PROBE
                    expected = needs is not None and allows(role, run_id, needs, on)
                    outcome = _try(_object_call(s3, admin.bucket, operation, prefix, role, written))
                    attempts.append(Attempt(role.value, operation.value, label, expected, outcome))
            bucket = f"{admin.bucket}-{role.value}-probe"
            attempts.append(
                Attempt(role.value, "create-bucket", "bucket", False, _try(s3.create_bucket, Bucket=bucket))
            )
            if probe_iam:
                iam = _iam_client(creds.applied_to(admin))
                user = f"{PROBE}-{role.value}"
                attempts.append(
                    Attempt(role.value, "iam-create-user", "iam", False, _try(iam.create_user, UserName=user))
                )
    finally:
        for key in seeded + written:
            admin_s3.delete_object(Bucket=admin.bucket, Key=key)
    return attempts


def matrix_counts(attempts: Iterable[Attempt]) -> dict[str, int]:
    """The summary `sprawl check permissions --json` prints."""
    attempts = list(attempts)
    forbidden = [a for a in attempts if not a.expected_allowed]
    allowed = [a for a in attempts if a.expected_allowed]
    return {
        "forbidden_attempted": len(forbidden),
        "forbidden_refused": sum(a.ok for a in forbidden),
        "allowed_attempted": len(allowed),
        "allowed_ok": sum(a.ok for a in allowed),
    }


def _object_call(s3, bucket: str, operation: Operation, prefix: str, role: Role, written: list[str]):
    seeded = f"{prefix}{PROBE}"
    match operation:
        case Operation.PUT:
            key = f"{prefix}{PROBE}-{role.value}"
            written.append(key)
            return lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"probe")
        case Operation.GET:
            return lambda: s3.get_object(Bucket=bucket, Key=seeded)["Body"].read()
        case Operation.LIST:
            return lambda: s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
        case Operation.DELETE:
            return lambda: s3.delete_object(Bucket=bucket, Key=seeded)


def _try(call: Callable[..., Any], **kwargs: Any) -> str:
    """`allowed`, `refused` or `error: ...`: what became of `call(**kwargs)`."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        call(**kwargs)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _REFUSED or status == 403:
            return "refused"
        return f"error: {code or status}: {exc}"
    except BotoCoreError as exc:
        return f"error: {type(exc).__name__}: {exc}"
    return "allowed"


def _s3_client(settings: S3BlobSettings, creds: RoleCredentials):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=creds.access_key_id,
        aws_secret_access_key=creds.secret_access_key.get_secret_value(),
        verify=str(settings.ca_file) if settings.ca_file else None,
        # One attempt: a refusal is the answer, and retrying one would only slow the matrix down.
        config=Config(retries={"max_attempts": 1, "mode": "standard"}, s3={"addressing_style": "path"}),
    )
