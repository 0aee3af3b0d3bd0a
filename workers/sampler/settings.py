"""The settings of a sampler island and of the sidecar in front of one.

No torch here (nor anything that imports it: the materializer, the views, the reference engine):
`sprawl sampler` and `sprawl sidecar` validate these before anything heavy loads. The island,
worker and sidecar modules re-export them for the code that imports them from there.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline.config import MaterializeSettings, Section, SprawlSettings, _check_url, registered
from pipeline.topology import token
from workers.sampler.engines.factory import ENGINES

__all__ = [
    "HTTP_ENGINES",
    "HTTPSection",
    "IslandSection",
    "RouteRetrySection",
    "SamplerSettings",
    "SidecarSettings",
    "ViewName",
]

ViewName = Literal["bf16", "fp8_e4m3", "mxfp4"]
"""The registered views (`pipeline.views.VIEWS`), spelled out because that registry imports torch;
tests/test_settings_bounds.py checks that the two agree."""

HTTP_ENGINES = ("vllm", "sglang")
"""Engines that drive a server of their own over HTTP, so they need `engine_url`."""


class RouteRetrySection(Section):
    """How an island retries what failed on the way to a version (a corrupt or missing patch, skip
    patch or keyframe, a log or store that did not answer): never in a loop, always after a wait
    that doubles with each failure in a row."""

    first_s: float = Field(2.0, gt=0)
    """Wait after a first failure before the failed part is tried again."""
    max_s: float = Field(300.0, gt=0)
    """The longest wait, however many failures in a row."""
    jitter: float = Field(0.5, ge=0, lt=1)
    """Up to this fraction of each wait is taken off at random, so a fleet of islands does not retry
    in step."""

    @model_validator(mode="after")
    def _cap_above_first(self) -> RouteRetrySection:
        if self.max_s < self.first_s:
            raise ValueError(f"max_s ({self.max_s}) is below first_s ({self.first_s})")
        return self


class IslandSection(Section):
    island_id: str = ""
    """Stable id of this island (default: `<host>-<view>`); trajectories and heartbeats carry it, and
    heartbeat subjects end with it (letters, digits, '_', '-')."""
    group: str = ""
    """Sampler group for per-group metrics (default: the view; letters, digits, '_', '-')."""
    view: ViewName = "bf16"
    """Which served view this island materializes and serves."""
    engine: str = "torch"
    """A key of the engine registry (`workers/sampler/engines/factory.py`): `torch` (reference
    engine), `vllm` or `sglang`."""
    engine_url: str = Field("", validate_default=True)
    """Base URL of the engine's HTTP server (http:// or https://); required by vllm and sglang."""
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    """Device of the reference engine (`cpu`, `cuda`, `cuda:1`)."""
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Compute dtype of the reference engine; the view decides the weights' bits."""
    top_logprobs: int = Field(32, ge=1)
    """Top-k (id, logprob) pairs returned per generated token (score centering needs 32-128)."""
    region: str = ""
    """Where the island runs, for audits (e.g. `eu-west`)."""
    poll_interval_s: float = Field(2.0, gt=0)
    """Fallback poll of the chain head, in case a wake-up message was missed."""
    materialize: MaterializeSettings = MaterializeSettings()
    """Where versions are cached on this island's disk."""
    route_retry: RouteRetrySection = RouteRetrySection()
    """Backoff for what failed on the way to a version; meanwhile the island serves the newest version
    it could build."""
    fault: Literal["none", "wrong_dequant"] = "none"
    """Test-only fault injection, never for a real run: `wrong_dequant` makes the reference engine
    dequantize its quantized weights wrongly on purpose (mxfp4: the two nibbles of each byte swapped;
    fp8_e4m3: the bits read as e4m3fnuz, every value halved), so a drift guard can be shown to flag a
    broken island. A bf16 island has nothing to dequantize and refuses it; only the torch engine
    implements it. Logged loudly at start."""

    @model_validator(mode="after")
    def _fault_needs_a_quantized_view(self) -> IslandSection:
        if self.fault == "wrong_dequant" and self.view == "bf16":
            raise ValueError(
                "fault=wrong_dequant needs a quantized view (fp8_e4m3, mxfp4): a bf16 island has nothing to dequantize"
            )
        return self

    @field_validator("island_id", "group")
    @classmethod
    def _subject_token(cls, value: str, info: ValidationInfo) -> str:
        if value:  # "" means the default, derived from the host and the view
            token(value, str(info.field_name))  # raises ValueError naming the allowed characters
        return value

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, value: str) -> str:
        return registered(value, ENGINES, "engine")

    @field_validator("engine_url")
    @classmethod
    def _url_for_http_engines(cls, value: str, info: ValidationInfo) -> str:
        if value:
            return _check_url(value, ("http", "https"), "server")
        engine = info.data.get("engine")
        if engine in HTTP_ENGINES:
            raise ValueError(f"the {engine} engine needs the URL of its HTTP server (http://host:port)")
        return value


class SamplerSettings(SprawlSettings):
    island: IslandSection = IslandSection()
    """The engine and view this sampler serves."""
    max_staleness: int | None = Field(None, ge=0)
    """Largest accepted (head - serving) version gap; None: unbounded (the seed run's setting)."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    """Extra stop tokens, besides the model config's eos_token_id."""
    heartbeat_interval_s: float = Field(10.0, gt=0)
    """How often the island reports its version, cache and throughput."""


class HTTPSection(Section):
    host: str = Field("127.0.0.1", min_length=1)
    """Interface to listen on."""
    port: int = Field(8100, ge=0, le=65535)
    """Port to listen on (0: any free port)."""


class SidecarSettings(SprawlSettings):
    island: IslandSection = IslandSection()
    """The engine and view behind this sidecar."""
    http: HTTPSection = HTTPSection()
    """Where the sidecar listens."""
