"""The reference engine: PyTorch + transformers, CPU or GPU, and every output computed exactly.

It samples in its own loop (not `generate`) so it can return what the trainer needs: the sampled
token's logprob under the processed distribution (temperature, top-k, top-p) and under the raw one,
the top-k of the processed distribution, the kept set, and the experts each MoE router picked
(captured from the routers themselves, found and read through the model's MoE family in
`pipeline.moe_families`; an MoE model of no registered family is refused when it is loaded, since its
routes could not be recorded). It runs in the view's numerics (bf16 compute; fp8 weights
dequantized from their block scales, mxfp4 weights from their E2M1 codes and E8M0 scales), so its
logprobs equal a teacher-forced recomputation on the same weights.

`fault="wrong_dequant"` (test-only, `island.fault`) makes it dequantize wrongly on purpose (see
`weights.to_compute_dtype`): an island that is broken, not merely different, for the drift guard.

Weights committed while a generation runs take effect at the next decode step, and the new
version opens a new span over the output tokens: the in-flight update real engines do, visible.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from pathlib import Path

import torch

from pipeline.errors import SprawlError
from pipeline.logs import get_logger
from pipeline.model_construction import MODEL_CONSTRUCTION
from pipeline.moe_families import MoeFamily, model_routers
from pipeline.sampling import draw, process_logits, truncates
from schemas import VersionSpan
from workers.sampler.engines.base import Capabilities, EngineUnavailable, GenerateRequest, Sample
from workers.sampler.engines.weights import CheckpointLayoutError, Fault, load_config, model_state_dict

log = get_logger(__name__)


class UnsupportedModelForward(SprawlError):
    """The installed transformers' forward pass does not take or fill the KV cache we hand it."""

    def __init__(self, model: str, detail: str):
        import transformers

        super().__init__(
            f"{model} under transformers {transformers.__version__}: {detail}",
            hint="install a transformers release this engine is tested with (see pyproject.toml)",
        )


def cache_keyword(model) -> str:
    """The forward keyword that takes the KV cache: `past_key_values` until transformers renamed it
    `cache` (5.2x, old name deprecated). The signature is public API; passing the wrong name would
    vanish into `**kwargs` and silently decode without context."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise UnsupportedModelForward(type(model).__name__, "forward() takes neither `cache` nor `past_key_values`")


def loadable_tensors(model: torch.nn.Module, *, remove_duplicate: bool = False) -> dict[str, torch.Tensor]:
    """What a version sets in `model`: its parameters (tied ones under each name unless
    `remove_duplicate`) and its persistent buffers (DeepSeek-V3's `e_score_correction_bias`, which its
    checkpoints carry), exactly the names of its state dict."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=remove_duplicate))
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in parameters:
            tensors[name] = tensor
    return tensors


class ReferenceEngine:
    def __init__(
        self,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        top_logprobs: int = 32,
        threads: int | None = None,
        fault: Fault = "none",
    ):
        self.device = torch.device(device)
        self.fault = fault
        self.dtype = dtype
        self.top_logprobs = top_logprobs
        self.threads = threads
        self.model = None
        self._cache_keyword = ""  # read from the model's forward signature when it is built
        self._family: MoeFamily | None = None  # the model's MoE family (None: dense), found when it is built
        self._routers: list[torch.nn.Module] = []
        self._version: int | None = None
        self._lock = threading.Lock()  # one forward pass or weight commit at a time
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._resumed = threading.Event()
        self._resumed.set()
        self._aborted: set[str] = set()
        self._started = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.fault != "none":
            log.warning(
                "FAULT INJECTION ON: this engine dequantizes its weights wrongly on purpose (test only); "
                "its samples come from a broken policy",
                fault=self.fault,
            )
        self._started = True

    async def health(self) -> bool:
        return self._started

    async def shutdown(self) -> None:
        self._started = False
        self.model = None

    async def capabilities(self) -> Capabilities:
        import transformers

        return Capabilities(
            engine="torch",
            engine_version=f"torch-{torch.__version__}+transformers-{transformers.__version__}",
            load_from_disk=True,
            load_changed_tensors=True,
            pause=True,
            flush_cache=True,
            top_logprobs=True,
            sampling_mask=True,
            routed_experts=True,
            version_spans=True,
            abort=True,
            accelerator=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            kernels={"attention": "sdpa", "dtype": str(self.dtype).removeprefix("torch.")},
        )

    async def pause(self) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    def weight_version(self) -> int | None:
        return self._version

    async def set_weight_version(self, version: int) -> None:
        with self._lock:
            self._version = version

    async def flush_cache(self) -> None:
        return None  # the KV cache lives only as long as one generate call

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    # ---------------------------------------------------------------- weights

    async def load_weights(self, path: Path, version: int, changed: list[str] | None = None) -> float:
        """Stage the weights (read + dequantize, no lock held), then commit; returns the pause in seconds."""
        if self.model is None:
            changed = None  # the first load builds the whole model
        state = await asyncio.to_thread(model_state_dict, path, self.dtype, changed, self.fault)
        if self.model is not None:
            self._check_fits(state, whole=changed is None)
        if self.model is None:
            await asyncio.to_thread(self._build, path, state, version)
            return 0.0
        return await asyncio.to_thread(self._commit, state, version)

    def _build(self, path: Path, state: dict[str, torch.Tensor], version: int) -> None:
        from transformers import AutoModelForCausalLM

        config = load_config(path)
        with MODEL_CONSTRUCTION:  # transformers switches torch's process-wide default dtype meanwhile
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        family, routers = model_routers(model)  # an MoE model whose routes it cannot record is refused first
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as mismatch:  # mis-shaped tensors
            raise CheckpointLayoutError(f"{path} does not fit its config's model: {mismatch}") from None
        # A tied lm_head is the embedding under a second name: the checkpoint stores it once.
        tied = loadable_tensors(model).keys() - loadable_tensors(model, remove_duplicate=True).keys()
        missing = sorted(set(missing) - tied)
        if missing or unexpected:
            raise CheckpointLayoutError(
                f"{path} does not fit its config's model: missing {missing[:3]} ({len(missing)}), "
                f"unexpected {sorted(unexpected)[:3]} ({len(unexpected)})"
            )
        model.to(self.device).eval()
        keyword = cache_keyword(model)
        with self._lock:
            self.model, self._cache_keyword, self._version = model, keyword, version
            self._family, self._routers = family, routers

    def _commit(self, state: dict[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        with self._lock:
            self._apply_state(state, version)
        return time.perf_counter() - t0

    def _check_fits(self, state: dict[str, torch.Tensor], *, whole: bool) -> None:
        """Before a single parameter changes: every tensor names a parameter of the built model and has
        its shape (`copy_` would broadcast a [1, in] tensor over [out, in] without a word), and a whole
        version covers every parameter (one left out would keep serving the previous version's bits)."""
        assert self.model is not None
        params = loadable_tensors(self.model)
        for name, tensor in state.items():
            if name not in params:
                raise CheckpointLayoutError(f"{name} is not a parameter of the model being served")
            if tensor.shape != params[name].shape:
                raise CheckpointLayoutError(
                    f"{name} is {tuple(tensor.shape)}, the served model's is {tuple(params[name].shape)}"
                )
        required = loadable_tensors(self.model, remove_duplicate=True).keys()
        missing = sorted(required - state.keys()) if whole else []
        if missing:
            raise CheckpointLayoutError(f"a whole version without {', '.join(missing[:3])} ({len(missing)} missing)")

    def _apply_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        assert self.model is not None
        params = loadable_tensors(self.model)
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        self._version = version

    def stage_for_next_step(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Commit at the next decode step of a running generation (or at once when idle)."""
        self._check_fits(state, whole=False)
        with self._lock:
            self._pending = (state, version)

    # ---------------------------------------------------------------- generation

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        if self.model is None:
            raise EngineUnavailable("no weights loaded yet")
        return await asyncio.to_thread(self._generate, request)

    def _step(self, input_ids: torch.Tensor, cache, routing: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """One forward pass; `cache` (a DynamicCache) is extended in place, so the output's copy of it
        (an attribute transformers renamed) is never read."""
        self._resumed.wait()
        with self._lock:
            if self._pending is not None:
                state, version = self._pending
                self._pending = None
                self._apply_state(state, version)
            version = self._version
            assert self.model is not None and version is not None
            hooks = [router.register_forward_hook(self._record_route(routing)) for router in self._routers]
            cached = cache.get_seq_length()
            try:
                with torch.no_grad():
                    kwargs = {self._cache_keyword: cache}
                    out = self.model(input_ids=input_ids.to(self.device), use_cache=True, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            if cache.get_seq_length() != cached + input_ids.shape[1]:
                raise UnsupportedModelForward(type(self.model).__name__, "the KV cache passed in was not filled")
        return out.logits[:, -1].float().cpu(), version

    def _record_route(self, routing: list[torch.Tensor]):
        family = self._family
        assert family is not None  # only MoE models have routers to hook

        def hook(_module, _inputs, output) -> None:
            routing.append(family.chosen(output).detach().cpu())

        return hook

    def _generate(self, request: GenerateRequest) -> list[Sample]:
        from transformers import DynamicCache

        sp = request.sampling
        n, prompt = request.n, list(request.prompt_token_ids)
        generators = [torch.Generator().manual_seed(hash((request.seed, i)) & 0x7FFF_FFFF_FFFF) for i in range(n)]
        record_kept = truncates(sp.temperature, sp.top_k, sp.top_p)
        k = sp.logprobs_top_k if sp.logprobs_top_k > 0 else self.top_logprobs
        stops = set(request.stop_token_ids)
        cache = DynamicCache()
        routing: list[torch.Tensor] = []  # per forward pass and layer: [tokens, top_k]
        logits, version = self._step(torch.tensor([prompt] * n), cache, routing)
        layers = len(routing)  # 0 for a dense model: nothing is recorded
        per_token_routing: list[torch.Tensor] = []
        if layers:
            per_token_routing.append(torch.stack(routing, dim=1).view(n, len(prompt), layers, -1))
        routing.clear()
        outputs: list[list[int]] = [[] for _ in range(n)]
        lp, raw_lp = [[] for _ in range(n)], [[] for _ in range(n)]
        top_ids, top_lps = [[] for _ in range(n)], [[] for _ in range(n)]
        kept: list[list[list[int]]] = [[] for _ in range(n)]
        spans: list[list[VersionSpan]] = [[] for _ in range(n)]
        finish = ["length"] * n
        done = [False] * n
        span_start = [0] * n
        span_version = [version] * n
        for step in range(sp.max_new_tokens):
            processed = process_logits(logits, sp.temperature, sp.top_k, sp.top_p)
            next_tokens = []
            for i in range(n):
                if done[i]:
                    next_tokens.append(outputs[i][-1] if outputs[i] else 0)
                    continue
                if version != span_version[i]:
                    spans[i].append(VersionSpan(version=span_version[i], start=span_start[i], end=step))
                    span_start[i], span_version[i] = step, version
                token, kept_ids = draw(processed, i, generators[i])  # the token comes from the recorded set
                outputs[i].append(token)
                lp[i].append(float(processed.logprobs[i, token]))
                raw_lp[i].append(float(processed.raw_logprobs[i, token]))
                values, ids = torch.topk(processed.logprobs[i], min(k, len(kept_ids)))
                top_ids[i].append(ids.tolist())
                top_lps[i].append(values.tolist())
                if record_kept:
                    kept[i].append(kept_ids.tolist())
                if token in stops:
                    done[i], finish[i] = True, "stop"
                elif request.request_id and request.request_id in self._aborted:
                    done[i], finish[i] = True, "abort"
                next_tokens.append(token)
            if all(done) or step == sp.max_new_tokens - 1:
                break
            logits, version = self._step(torch.tensor(next_tokens).view(n, 1), cache, routing)
            if layers:
                per_token_routing.append(torch.stack(routing, dim=1).view(n, 1, layers, -1))
            routing.clear()
        self._aborted.discard(request.request_id)
        route = torch.cat(per_token_routing, dim=1) if layers else None
        samples = []
        for i in range(n):
            spans[i].append(VersionSpan(version=span_version[i], start=span_start[i], end=len(outputs[i])))
            processed_tokens = len(prompt) + len(outputs[i]) - 1
            samples.append(
                Sample(
                    prompt_token_ids=prompt,
                    output_token_ids=outputs[i],
                    logprobs=lp[i],
                    raw_logprobs=raw_lp[i],
                    top_ids=top_ids[i],
                    top_logprobs=top_lps[i],
                    kept_ids=kept[i] if record_kept else None,
                    routed_experts=route[i, :processed_tokens].tolist() if route is not None else None,
                    version_spans=spans[i],
                    finish_reason=finish[i],
                )
            )
        return samples
