"""Configuration shared by every worker: where the log and the blobs are, and how to talk to them.

Each worker has one settings model (a subclass of `SprawlSettings`), read from command-line flags
(derived from the model: `sprawl <command> --help`), `SPRAWL_...` environment variables (nested
with `__`, e.g. `SPRAWL_NATS__URL`) and an optional TOML file (`--config` or `SPRAWL_CONFIG`).
Precedence: flags > explicit arguments > environment > TOML file > defaults.

Every value is checked when the settings are built: fixed choices are `Literal`s, numbers have
bounds, and rules across fields are validators, so a bad value fails at start and names its field
instead of misbehaving later. `settings_toml` / `write_settings_file` write a model back as the TOML
file a worker validates at start (how `sprawl up` configures its workers).
"""

from __future__ import annotations

import contextvars
import math
import os
import re
import tomllib
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from pipeline.errors import SprawlError

_toml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("sprawl_toml_file", default=None)

MIB = 1024 * 1024


class ConfigError(SprawlError):
    """Settings that cannot be used: a missing file, or values that fail validation."""


def registered(value: str, registry: Mapping[str, object], what: str) -> str:
    """A settings value that must name an entry of an extension registry (engines, sandbox backends)."""
    if value not in registry:
        raise ValueError(f"unknown {what} {value!r}: one of {', '.join(sorted(registry))}")
    return value


class Section(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)


def _check_url(value: str, schemes: tuple[str, ...], what: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"{value!r} is not a {what} URL: expected {' or '.join(f'{s}://host:port' for s in schemes)}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number or out of range)
    except ValueError as exc:
        raise ValueError(f"{value!r}: {exc}") from None
    return value


class NatsSettings(Section):
    url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma-separated for a cluster."""
    user: str | None = None
    """User name, if the server requires one."""
    password: SecretStr | None = None
    """Password for `user`."""
    creds_file: Path | None = None
    """NATS credentials file (JWT + nkey) for production clusters."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout of one connection attempt."""
    reconnect_wait_s: float = Field(0.5, ge=0)
    """Wait between reconnect attempts; once connected, the client reconnects forever."""
    ping_interval_s: float = Field(5.0, gt=0)
    """How often the client pings its server. A server that stalls (a frozen VM, a SIGSTOPped process)
    keeps its TCP connection open: only unanswered pings tell the client to move to another server of
    the cluster (nats-py's default, 120 s, left clients on a frozen node for minutes)."""
    max_outstanding_pings: int = Field(3, ge=1)
    """Unanswered pings after which the connection counts as dead and the client reconnects elsewhere:
    a stalled server is left after about ping_interval_s x (this + 1)."""
    connect_attempts: int = Field(3, ge=2)
    """Attempts per server of the first connection before giving up with an error (the worker
    exits non-zero and its supervisor restarts it, visibly); at least 2, as the client counts."""
    tls_ca_file: Path | None = None
    """CA certificate (PEM) that signed the server's certificate. Set: every connection is TLS and the
    server must prove it holds a certificate from this CA (the local stack makes one)."""
    inbox_prefix: str = Field("_INBOX", pattern=r"^_INBOX[A-Za-z0-9_-]*$")
    """Prefix of this client's reply subjects. The stack's credentials allow each identity to subscribe
    to its own prefix only (`_INBOX_<role>_<id>`), so one island cannot read another's replies."""
    tls_server_name: str | None = None
    """Name the server's certificate must carry, when it is not the host in the URL (an island that
    reaches the stack by an address the certificate does not list). None: the URL's host."""

    @field_validator("url")
    @classmethod
    def _urls(cls, value: str) -> str:
        servers = [part.strip() for part in value.split(",")]
        if not all(servers):
            raise ValueError(f"{value!r} has an empty server: separate URLs with single commas")
        for server in servers:
            _check_url(server, ("nats", "tls", "ws", "wss"), "NATS")
        return value

    @field_validator("password")
    @classmethod
    def _password_needs_user(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is not None and not info.data.get("user"):
            raise ValueError("a password without a `user`: set both, or neither")
        return value


class S3BlobSettings(Section):
    type: Literal["s3"] = "s3"
    endpoint_url: str | None = "http://127.0.0.1:8333"
    """S3 endpoint; None (or "" in a file or variable) means AWS's default for `region`."""
    region: str = Field("us-east-1", min_length=1)
    """Region to sign requests for."""
    access_key_id: str = Field("sprawl", min_length=1)
    """Access key id (the local stack creates this identity)."""
    secret_access_key: SecretStr = SecretStr("sprawl-local-secret")
    """Secret for `access_key_id`."""
    bucket: str = Field("sprawl", pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    """Bucket for every blob of the run (keyframes, patches, claim checks, archive); an S3 bucket name:
    3 to 63 lowercase letters, digits, dots and hyphens."""
    multipart_threshold_bytes: int = Field(64 * MIB, gt=0)
    """Uploads above this size go multipart."""
    multipart_chunk_bytes: int = Field(16 * MIB, ge=5 * MIB, le=5 * 1024 * MIB)
    """Part size of multipart uploads (S3 takes parts of 5 MiB to 5 GiB)."""
    max_attempts: int = Field(5, ge=1)
    """Bounded retries (with backoff) for throttling and transient errors."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout to open a connection to the endpoint."""
    read_timeout_s: float = Field(60.0, gt=0)
    """Timeout of a read on an open connection."""
    outage_patience_s: float = Field(120.0, ge=0)
    """How long a write waits out an unavailable store (refused, timed out, throttled), retrying with
    backoff from 1 s to 10 s, before it fails: a publish, a checkpoint or a claim-checked append rides
    out a store restart instead of stopping the worker. 0: fail after one attempt's `max_attempts`."""
    ca_file: Path | None = None
    """CA certificate (PEM) to verify an https endpoint with (the local stack's own CA, whose server
    certificate lists the addresses islands use); None: the system's trust store."""
    max_download_mbps: float | None = Field(None, gt=0)
    """Cap on this process's download rate in megabits/s (None: no cap). Keeps a sampler from
    saturating a shared cross-region link; `sprawl bench sync` uses it to model one."""

    @field_validator("endpoint_url", mode="before")
    @classmethod
    def _endpoint(cls, value: object) -> object:
        if value == "":
            return None  # a TOML file or a variable cannot say None
        if isinstance(value, str):
            return _check_url(value, ("http", "https"), "S3 endpoint")
        return value


class LocalBlobSettings(Section):
    type: Literal["local"] = "local"
    root: Path = Path(".sprawl/blobs")
    """Directory that stands in for a bucket (single-machine runs without S3)."""


def _blob_backend(value: object) -> str:
    """The backend named by `type`; S3 when unset, so `SPRAWL_BLOBS__ENDPOINT_URL=...` alone works."""
    if isinstance(value, dict):
        return str(value.get("type", "s3"))
    return str(getattr(value, "type", "s3"))


BlobSettings = Annotated[
    Annotated[S3BlobSettings, Tag("s3")] | Annotated[LocalBlobSettings, Tag("local")],
    Discriminator(
        _blob_backend,
        custom_error_type="unknown_blob_backend",
        custom_error_message="blobs.type must be 's3' or 'local'",
    ),
]


class LogSettings(Section):
    claim_check_threshold_bytes: int = Field(256 * 1024, ge=1024)
    """Encoded events larger than this go to the blob store; the log carries a claim check."""
    max_claim_bytes: int = Field(256 * MIB, ge=1024)
    """The largest encoded event a claim check may carry. A producer refuses to append a larger one; a
    reader dead-letters a claim that says it is larger, and stops reading a blob that turns out larger
    than its claim says: a forged claim (any sampler can write claims) must not exhaust the memory of
    every worker that reads it, again after each restart."""
    publish_timeout_s: float = Field(5.0, gt=0)
    """How long one publish waits for the stream's ack."""
    publish_attempts: int = Field(20, ge=1)
    """Attempts for a publish that times out or finds no responders (same Nats-Msg-Id each time). With
    the backoff capped at 1 s, 20 fast failures span about 19 s: a cluster's stream leader election
    (4 to 9 s once the old leader is missed) with room to spare, before the append gives up."""
    publish_backoff_s: float = Field(0.25, ge=0)
    """First retry delay; doubles per attempt."""
    stream_missing_grace_s: float = Field(30.0, gt=0)
    """How long a stream or consumer that a reader has already used may be reported missing before that
    is believed (the reader then stops loudly): a restarted nats-server answers "not found" while
    JetStream is still restoring its streams (seen under load), which is an outage, not a deletion."""

    @field_validator("max_claim_bytes")
    @classmethod
    def _claims_above_threshold(cls, value: int, info: ValidationInfo) -> int:
        threshold = info.data.get("claim_check_threshold_bytes")
        if threshold is not None and value <= threshold:
            raise ValueError(f"{value} is not above claim_check_threshold_bytes={threshold}: no claim could be made")
        return value


class StreamSettings(Section):
    replicas: int | None = Field(None, ge=1, le=5)
    """Stream and consumer replicas (JetStream allows at most 5). None: 3 when the log is a cluster (a
    stream then survives losing one of its servers; a cluster of fewer than 3 cannot place it and
    `apply` fails loudly), 1 when it is one server, never fewer than a declared stream already has."""
    duplicate_window_s: float = Field(120.0, gt=0)
    """How long JetStream remembers a Nats-Msg-Id to drop re-published events."""
    policy_duplicate_window_s: float = Field(24 * 3600.0, gt=0)
    """Dedup window of the policy stream (versions are rare and must never double)."""
    storage: Literal["file", "memory"] = "file"
    """Stream storage; the log is durable, so `file` outside of throwaway tests."""
    ack_wait_s: float = Field(10.0, gt=0)
    """How long a consumer waits for an ack before redelivering, when no `backoff_s` is set. Short, so a
    killed worker's messages return within seconds; a live handler keeps its message by sending
    in-progress every third of it (`pipeline/consumer.py`)."""
    max_deliver: int = Field(48, ge=1)
    """Deliveries after which the server stops redelivering; the worker dead-letters a message before
    or at this: poison at once, a bug after `bug_attempts`, a transient failure after
    `transient_retry_s`. Enough for a transient failure's naks (capped at 30 s apart) to fill that time."""
    backoff_s: list[Annotated[float, Field(gt=0)]] = Field([10.0, 20.0, 30.0, 60.0], validate_default=True)
    """Redelivery delays after ack timeouts, per delivery (JetStream uses the first as the ack wait, so a
    message whose worker was SIGKILLed returns after it); fewer than `max_deliver`."""
    max_ack_pending: int = Field(512, ge=1)
    """Unacked messages a consumer may have out at once (flow control)."""
    transient_retry_s: float = Field(900.0, gt=0)
    """How long a consumer retries a message whose handling fails transiently (the log or the blob store
    down, a prompt group not seen yet) before dead-lettering it; counted from its first failure."""
    bug_attempts: int = Field(3, ge=1)
    """Deliveries a message gets when its handler fails with an error that is neither poison nor
    transient (a bug): then it is dead-lettered with the error."""

    @field_validator("backoff_s")
    @classmethod
    def _backoff_fits_deliveries(cls, value: list[float], info: ValidationInfo) -> list[float]:
        max_deliver = info.data.get("max_deliver")
        if max_deliver is not None and len(value) >= max_deliver:
            raise ValueError(
                f"{len(value)} delays but max_deliver is {max_deliver}: JetStream needs fewer delays than deliveries"
            )
        return value

    @field_validator("bug_attempts")
    @classmethod
    def _attempts_fit_deliveries(cls, value: int, info: ValidationInfo) -> int:
        max_deliver = info.data.get("max_deliver")
        if max_deliver is not None and value > max_deliver:
            raise ValueError(
                f"{value} attempts but the server delivers a message at most max_deliver={max_deliver} times"
            )
        return value


class ChainSettings(Section):
    views: list[str] = Field(["bf16"], min_length=1)
    """Served views the trainer publishes for every version (`bf16`, `fp8_e4m3`, `mxfp4`)."""
    keyframe_every: int = Field(20, ge=1)
    """A full keyframe every K versions (and at version 0); patches in between."""
    keyframe_patches: bool = True
    """A keyframe also ships a patch from the version before it (as a skip patch), so a follower never
    downloads a whole keyframe just because the trainer wrote one. Off only for baselines (benchmarks)."""
    skip_distances: list[Annotated[int, Field(ge=2)]] = []
    """Also publish skip-patches v-k -> v for these k (>= 2: k = 1 is the ordinary patch), so laggards
    catch up in one hop (costs k views of memory)."""
    max_shard_bytes: int = Field(2 * 1024**3, ge=MIB)
    """Largest safetensors shard of a keyframe (estimated as bf16: 2 bytes an element); patches are cut
    along the same shards."""
    publish_units: int = Field(4, ge=1)
    """At least this many shards a version is cut into (`pipeline/publish_layout.py`), however small
    the model: the units sharded ranks share when they publish. Part of the chain's layout, so a 1-rank
    and an N-rank trainer with the same value publish identical files; it matters only for models
    under `publish_units x max_shard_bytes` (bigger ones are cut finer anyway). 4 lets 2 to 4 ranks
    share a small model's work, at the price of a few more (small) blobs per version; raise it for
    more ranks on a small model."""
    chunk_elements: int = Field(1 << 22, ge=1024)
    """Elements per codec chunk (the unit of parallel work and of buffer memory)."""
    zstd_level: int = Field(3, ge=1, le=22)
    """zstd level for patch streams (chosen by `sprawl bench delta`)."""

    @field_validator("views", "skip_distances")
    @classmethod
    def _no_repeats(cls, value: list) -> list:
        repeated = sorted({str(v) for v in value if value.count(v) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return value


class MaterializeSettings(Section):
    cache_dir: Path = Path(".sprawl/versions")
    """Where materialized versions live, one HF-layout directory per version."""
    keep_versions: int = Field(2, ge=1)
    """Materialized versions kept on disk; older ones are garbage-collected (never the one served or one
    an engine has pinned). 2 is A/B: the served version and the standby slot that the next version is
    patched into in place; 1 makes every version pay a full copy of the served one."""
    wait_for_version_s: float = Field(60.0, gt=0)
    """How long to wait for a version that is not in the log yet."""


class TrustSettings(Section):
    """Who may publish the weights an island serves: the trainer signs each version's manifest with an
    Ed25519 key, and islands serve only versions signed by the public key pinned here."""

    version_public_key: str | None = None
    """The trainer's Ed25519 public key (PEM, or base64 of the 32 raw bytes). Set: an island refuses a
    version that is unsigned, signed by another key, or whose blobs differ from its signed digests."""
    signing_key_file: Path | None = None
    """The trainer's Ed25519 private key (PEM). Only the trainer reads it; it signs every version."""
    allow_unsigned_versions: bool = False
    """Serve (island) or publish (trainer) versions without signatures when no key is configured.
    Off: a worker with no key refuses to start, so an unverified fleet is a choice, never an accident."""


LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class SprawlSettings(BaseSettings):
    """Settings every worker shares. Workers subclass this and add their own section."""

    model_config = SettingsConfigDict(
        env_prefix="SPRAWL_",
        env_nested_delimiter="__",
        use_attribute_docstrings=True,
        extra="forbid",
    )

    run_id: str = "local"
    """The run: second token of every subject, partition of every table (letters, digits, '_', '-')."""
    state_dir: Path = Path(".sprawl")
    """Local state folder (stack data, pid files, caches). Git-ignored."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """Log rendering: JSON lines, or pretty on a TTY with `auto`."""
    log_level: LogLevel = "INFO"
    """Minimum log level."""
    nats: NatsSettings = NatsSettings()
    """How to reach the log."""
    blobs: BlobSettings = S3BlobSettings()
    """Where blobs live."""
    log: LogSettings = LogSettings()
    """How events are appended."""
    streams: StreamSettings = StreamSettings()
    """How streams and consumers are declared (`sprawl infra apply`)."""
    join: SecretStr | None = None
    """A join token (`sprawl token create`): the run, the endpoints, this worker's own credentials and
    the trainer's public key, for a worker on another machine. What it sets wins over the environment and
    files; flags given beside it still win (`--island.view`, another route to the same stack).
    `@FILE` reads it from a file (or use SPRAWL_JOIN): on a command line it is visible in `ps`."""
    trust: TrustSettings = TrustSettings()
    """Which signed versions islands serve, and the key the trainer signs them with."""

    @field_validator("run_id")
    @classmethod
    def _run_is_a_token(cls, value: str) -> str:
        from pipeline.subjects import token

        token(value, "run_id")  # raises ValueError naming the allowed characters
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = _toml_file.get() or (Path(p) if (p := os.environ.get("SPRAWL_CONFIG")) else None)
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


SettingsT = TypeVar("SettingsT", bound=SprawlSettings)


class CommandOptions(BaseSettings):
    """A command's own options (`sprawl up --quick`, `sprawl sql --format`): flags and keyword arguments
    only, never the environment or a file, so they cannot leak from one command into another."""

    model_config = SettingsConfigDict(use_attribute_docstrings=True, extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def load_settings(
    cls: type[SettingsT], config_file: Path | None = None, *, cli_source: Any = None, **overrides: object
) -> SettingsT:
    """Build a worker's settings from flags (a parsed `CliSettingsSource`), overrides, the environment
    and an optional TOML file. A missing file is a `ConfigError`; bad values raise pydantic's
    `ValidationError` (one entry per bad field; `validation_lines` prints them)."""
    if config_file is not None and not Path(config_file).is_file():
        raise ConfigError(f"config file {config_file} does not exist", hint="check the path given to --config")
    token = _toml_file.set(Path(config_file) if config_file is not None else None)
    try:
        if cli_source is not None:
            return cls(_cli_settings_source=cli_source, **overrides)  # type: ignore[arg-type,call-arg]
        return cls(**overrides)  # type: ignore[arg-type]
    finally:
        _toml_file.reset(token)


# ------------------------------------------------------------------ validation errors, one line each

_SECRET_NAMES = re.compile(r"secret|password|credential|creds", re.IGNORECASE)


def validation_lines(exc: ValidationError) -> list[str]:
    """One line per bad field: `trainer.checkpoint_every: Input should be greater than or equal to 1 (got 0)`.

    The value is shown when it is a plain scalar of a field whose name does not suggest a secret."""
    lines = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(p) for p in error["loc"] if not _is_union_tag(p))
        message = error["msg"].removeprefix("Value error, ")
        value = error.get("input")
        shown = ""
        plain = isinstance(value, str | int | float | bool) and not _SECRET_NAMES.search(path)
        if plain and error["type"] != "missing" and not (isinstance(value, str) and repr(value) in message):
            shown = f" (got {value!r})"
        lines.append(f"{path}: {message}{shown}" if path else f"{message}{shown}")
    return lines


def _is_union_tag(part: object) -> bool:
    return part in ("s3", "local") or (isinstance(part, str) and part.startswith("function-"))


# ------------------------------------------------------------------ settings as a TOML file


def settings_toml(settings: BaseModel) -> str:
    """The model as a TOML document that validates back to an equal model (secrets in clear: write
    it with `write_settings_file`, which makes the file private)."""
    data = _plain(settings, type(settings))
    lines: list[str] = []
    _toml_table(data, [], lines)
    text = "\n".join(lines).strip() + "\n"
    reloaded = type(settings).model_validate(tomllib.loads(text)) if not isinstance(settings, BaseSettings) else None
    if reloaded is not None and reloaded != settings:
        raise ConfigError(f"{type(settings).__name__} does not survive a TOML round trip", hint="a bug: report it")
    return text


def write_settings_file(settings: BaseModel, path: Path) -> Path:
    """Write `settings` as TOML to `path`, readable by its owner only (it may hold credentials)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = settings_toml(settings)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(staging, 0o600)  # whatever the umask did
    os.replace(staging, path)
    return path


def _plain(value: Any, model: type[BaseModel] | None = None) -> Any:
    """Python values TOML can hold: models and mappings as dicts (None left out when that is the
    field's default; "" where a field reads "" as None), secrets revealed, paths as strings."""
    if isinstance(value, BaseModel):
        out = {}
        for name, field in type(value).model_fields.items():
            item = getattr(value, name)
            if item is None:
                if field.default is None:
                    continue
                item = ""  # e.g. `endpoint_url`: its validator reads "" as None
            out[name] = _plain(item)
        return out
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if value is None:
        raise ConfigError("TOML has no null", hint="a None inside a list cannot be written to a settings file")
    return value


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {type(value).__name__} to TOML", hint="a bug: report it")


def _toml_table(data: dict, path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in data.items() if not (isinstance(v, dict) and v)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict) and v}
    if path and (scalars or not tables):
        lines += ["", "[" + ".".join(_toml_key(p) for p in path) + "]"]
    for key, value in scalars.items():
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in tables.items():
        _toml_table(value, [*path, key], lines)
