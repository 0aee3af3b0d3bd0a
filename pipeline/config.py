"""Configuration shared by every worker: where the log and the blobs are, and how to talk to them.

Each worker has one settings model (a subclass of `SprawlSettings`), read from
`SPRAWL_...` environment variables (nested with `__`, e.g.
`SPRAWL_NATS__URL`) and an optional TOML file (`--config` or `SPRAWL_CONFIG`).
Precedence: explicit arguments > environment > TOML file > defaults.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, SecretStr, Tag
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

_toml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("sprawl_toml_file", default=None)


class Section(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)


class NatsSettings(Section):
    url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma-separated for a cluster."""
    user: str | None = None
    """User name, if the server requires one."""
    password: SecretStr | None = None
    """Password for `user`."""
    creds_file: Path | None = None
    """NATS credentials file (JWT + nkey) for production clusters."""
    connect_timeout_s: float = 5.0
    """Timeout of one connection attempt."""
    reconnect_wait_s: float = 0.5
    """Wait between reconnect attempts; the client reconnects forever."""


class S3BlobSettings(Section):
    type: Literal["s3"] = "s3"
    endpoint_url: str | None = "http://127.0.0.1:8333"
    """S3 endpoint; None means AWS's default for `region`."""
    region: str = "us-east-1"
    """Region to sign requests for."""
    access_key_id: str = "sprawl"
    """Access key id (the local stack creates this identity)."""
    secret_access_key: SecretStr = SecretStr("sprawl-local-secret")
    """Secret for `access_key_id`."""
    bucket: str = "sprawl"
    """Bucket for every blob of the run (keyframes, patches, claim checks, archive)."""
    multipart_threshold_bytes: int = 64 * 1024 * 1024
    """Uploads above this size go multipart."""
    multipart_chunk_bytes: int = 16 * 1024 * 1024
    """Part size of multipart uploads."""
    max_attempts: int = 5
    """Bounded retries (with backoff) for throttling and transient errors."""
    connect_timeout_s: float = 5.0
    """Timeout to open a connection to the endpoint."""
    read_timeout_s: float = 60.0
    """Timeout of a read on an open connection."""
    max_download_mbps: float | None = None
    """Cap on this process's download rate in megabits/s (None: no cap). Keeps a sampler from
    saturating a shared cross-region link; `sprawl bench sync` uses it to model one."""


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
    Discriminator(_blob_backend),
]


class LogSettings(Section):
    claim_check_threshold_bytes: int = 256 * 1024
    """Encoded events larger than this go to the blob store; the log carries a claim check."""
    publish_timeout_s: float = 5.0
    """How long one publish waits for the stream's ack."""
    publish_attempts: int = 6
    """Attempts for a publish that times out or finds no responders (same Nats-Msg-Id each time)."""
    publish_backoff_s: float = 0.25
    """First retry delay; doubles per attempt."""


class StreamSettings(Section):
    replicas: int = 1
    """Stream and consumer replicas: 1 locally, 3 on a cluster."""
    duplicate_window_s: float = 120.0
    """How long JetStream remembers a Nats-Msg-Id to drop re-published events."""
    policy_duplicate_window_s: float = 24 * 3600.0
    """Dedup window of the policy stream (versions are rare and must never double)."""
    storage: Literal["file", "memory"] = "file"
    """Stream storage; the log is durable, so `file` outside of throwaway tests."""
    ack_wait_s: float = 30.0
    """How long a consumer waits for an ack before redelivering (handlers send in-progress meanwhile)."""
    max_deliver: int = 8
    """Deliveries before a message is given up on (and dead-lettered by the worker)."""
    backoff_s: list[float] = [30.0, 60.0, 120.0, 300.0]
    """Redelivery delays after ack timeouts, per delivery (JetStream uses the first as the ack wait)."""
    max_ack_pending: int = 512
    """Unacked messages a consumer may have out at once (flow control)."""


class ChainSettings(Section):
    views: list[str] = ["bf16"]
    """Served views the trainer publishes for every version (e.g. `bf16`, `fp8_e4m3`)."""
    keyframe_every: int = 20
    """A full keyframe every K versions (and at version 0); patches in between."""
    skip_distances: list[int] = []
    """Also publish skip-patches v-k -> v for these k, so laggards catch up in one hop (costs k views of memory)."""
    max_shard_bytes: int = 2 * 1024**3
    """Largest safetensors shard of a keyframe; patches are cut along the same shards."""
    chunk_elements: int = 1 << 22
    """Elements per codec chunk (the unit of parallel work and of buffer memory)."""
    zstd_level: int = 3
    """zstd level for patch streams (chosen by `sprawl bench delta`)."""


class MaterializeSettings(Section):
    cache_dir: Path = Path(".sprawl/versions")
    """Where materialized versions live, one HF-layout directory per version."""
    keep_versions: int = 3
    """Materialized versions kept on disk; older ones are garbage-collected."""
    wait_for_version_s: float = 60.0
    """How long to wait for a version that is not in the log yet."""


class SprawlSettings(BaseSettings):
    """Settings every worker shares. Workers subclass this and add their own section."""

    model_config = SettingsConfigDict(
        env_prefix="SPRAWL_",
        env_nested_delimiter="__",
        use_attribute_docstrings=True,
        extra="forbid",
    )

    run_id: str = "local"
    """The run: second token of every subject, partition of every table."""
    state_dir: Path = Path(".sprawl")
    """Local state folder (stack data, pid files, caches). Git-ignored."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """Log rendering: JSON lines, or pretty on a TTY with `auto`."""
    log_level: str = "INFO"
    """Minimum log level."""
    nats: NatsSettings = NatsSettings()
    """How to reach the log."""
    blobs: BlobSettings = S3BlobSettings()
    """Where blobs live."""
    log: LogSettings = LogSettings()
    """How events are appended."""
    streams: StreamSettings = StreamSettings()
    """How streams and consumers are declared (`sprawl infra apply`)."""

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


def load_settings(cls: type[SettingsT], config_file: Path | None = None, **overrides: object) -> SettingsT:
    """Build a worker's settings from overrides, the environment and an optional TOML file."""
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")
    token = _toml_file.set(config_file)
    try:
        return cls(**overrides)  # type: ignore[arg-type]
    finally:
        _toml_file.reset(token)
