"""MoE families: what sprawl must know about one family of transformers MoE models, in one place.

Routing replay (`pipeline.routing_replay`), the reference engine's routing record, the on-disk layout
(`pipeline.views.layout` one way, `workers.sampler.engines.weights` the other) and the trainer's
admission see a model's routers, routing weights and experts only through its family's entry here.
The families differ exactly where a guess would go wrong:

- qwen3_moe: routers `mlp.gate`; weights: softmax over all experts, renormalized over the k when the
  config says `norm_topk_prob`; on disk one tensor per expert, `mlp.experts.<e>.{gate,up,down}_proj.weight`.
- mixtral: routers `mlp.gate` in memory but `block_sparse_moe.gate` on disk, `num_local_experts`;
  weights: softmax over all experts, always renormalized; on disk
  `block_sparse_moe.experts.<e>.{w1,w3,w2}.weight` (gate, up, down).
- gpt_oss: routers `mlp.router`, with a bias; weights: softmax over the k chosen logits only; on disk
  the experts stay fused as in memory (`mlp.experts.gate_up_proj [E, H, 2I]`, gate/up interleaved,
  with biases).
- deepseek_v3: routers `mlp.gate` plus an `e_score_correction_bias` buffer that steers the (grouped:
  `n_group`, `topk_group`) choice only; `n_routed_experts`; the first `first_k_dense_replace` layers are
  dense; weights: sigmoid at the chosen experts, renormalized, times `routed_scaling_factor`; on disk
  as qwen3_moe, plus `mlp.shared_experts`.

The on-disk names are transformers' own conversion mapping (`transformers/conversion_mapping.py`:
"mixtral", and "qwen2_moe" which qwen3_moe and deepseek_v3 map to; gpt_oss has none, its checkpoints
keep experts fused), so they are the names the family's HF checkpoints, vLLM and SGLang use;
tests/test_moe_families.py checks them against `save_pretrained` and `from_pretrained`.

Every router above returns `(router_logits, routing_weights, expert_ids)` in the transformers 5
releases this project supports; a router that returns anything else (DeepSeek-V3's returned bare
logits in 5.0) is refused (`RouterMismatch`), not read. Replay recomputes the logits from the router's
input and weights rather than trusting that first element, whose meaning has changed across releases.

Dense models need no entry. An MoE model of no registered family is refused (`UnsupportedMoeFamily`)
where its routes would be recorded or replayed or its experts laid out on disk, never guessed at: a
guess wrong by a module name records no route at all, one wrong by a weight formula trains a mixture
the sampler never ran.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.errors import SprawlError

RoutingWeights = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(router module, its logits [T, E], expert ids [T, k]) -> the family's routing weights [T, k]."""

EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config attributes that make a model MoE, whatever its family: how an unregistered one is recognized."""


class UnsupportedMoeFamily(SprawlError, ValueError):
    """An MoE model whose family has no entry in `MOE_FAMILIES`."""

    def __init__(self, model_type: str, needed_for: str):
        self.model_type = model_type
        super().__init__(
            f"{model_type!r} is a mixture-of-experts model of no registered MoE family, so {needed_for}; "
            f"supported MoE families: {', '.join(sorted(MOE_FAMILIES))}",
            hint="use a model of a supported family, or register its family in pipeline/moe_families.py "
            "(router modules, routing weights, expert-count and top-k attributes, on-disk expert names)",
        )


class RouterMismatch(SprawlError):
    """The installed transformers builds this family's model differently from its entry here."""

    def __init__(self, detail: str):
        import transformers

        super().__init__(
            f"{detail} (transformers {transformers.__version__})",
            hint="install a transformers release this project is tested with (see pyproject.toml), "
            "or update the family's entry in pipeline/moe_families.py",
        )


# ---------------------------------------------------------------- on-disk expert names


@dataclass(frozen=True)
class ExpertOnDisk:
    """Where one per-expert checkpoint tensor goes in memory."""

    fused_prefix: str  # in-memory `...mlp.experts.`, to which `gate_up_proj` / `down_proj` is appended
    expert: int
    role: str  # "gate", "up" or "down"


@dataclass(frozen=True)
class SplitExperts:
    """transformers 5 fuses the experts in memory (`<layer>.mlp.experts.gate_up_proj [E, 2I, H]`, gate
    rows first, and `down_proj [E, H, I]`); the checkpoint holds one tensor per expert and projection,
    under the MoE block's on-disk name (`disk_block`) and the family's projection names."""

    disk_block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def disk_name(self, name: str) -> str:
        """A non-expert tensor's on-disk name (Mixtral: `.mlp.` -> `.block_sparse_moe.`, as transformers saves it)."""
        return name.replace(".mlp.", f".{self.disk_block}.", 1) if self.disk_block != "mlp" else name

    def memory_name(self, disk_name: str) -> str:
        return disk_name.replace(f".{self.disk_block}.", ".mlp.", 1) if self.disk_block != "mlp" else disk_name

    def to_disk(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = self.disk_name(name).removesuffix("gate_up_proj")
            _check_fused(name, tensor)
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.{self.gate}.weight", tensor[e, :half]
                yield f"{prefix}{e}.{self.up}.weight", tensor[e, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = self.disk_name(name).removesuffix("down_proj")
            _check_fused(name, tensor)
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.{self.down}.weight", tensor[e]
        else:
            yield self.disk_name(name), tensor

    def expert_of(self, disk_name: str) -> ExpertOnDisk | None:
        """The in-memory place of a per-expert checkpoint tensor; None for any other tensor."""
        match = self._pattern.match(disk_name)
        if match is None:
            return None
        role = {self.gate: "gate", self.up: "up", self.down: "down"}[match["proj"]]
        return ExpertOnDisk(self.memory_name(match["prefix"]), int(match["e"]), role)

    @cached_property
    def _pattern(self) -> re.Pattern[str]:
        projections = "|".join(re.escape(p) for p in (self.gate, self.up, self.down))
        block = re.escape(self.disk_block)
        return re.compile(rf"^(?P<prefix>.*\.{block}\.experts\.)(?P<e>\d+)\.(?P<proj>{projections})\.weight$")


def _check_fused(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 3 or (name.endswith("gate_up_proj") and tensor.shape[1] % 2):
        raise RouterMismatch(f"{name} is {tuple(tensor.shape)}, not fused experts [E, 2I, H] / [E, H, I]")


@dataclass(frozen=True)
class SameNames:
    """Checkpoint names are the in-memory names: dense models, and families whose checkpoints keep the
    experts fused (gpt_oss). `model_type` set: a dense model of that type, whose fused experts, should
    any appear, belong to an unregistered family and are refused rather than written under a guess."""

    model_type: str | None = None

    def disk_name(self, name: str) -> str:
        return name

    def memory_name(self, disk_name: str) -> str:
        return disk_name

    def to_disk(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if self.model_type is not None and ".experts." in name and tensor.dim() == 3:
            raise UnsupportedMoeFamily(self.model_type, "its experts' on-disk names are unknown")
        yield name, tensor

    def expert_of(self, disk_name: str) -> ExpertOnDisk | None:
        return None


ExpertLayout = SplitExperts | SameNames


# ---------------------------------------------------------------- routing weights


def _router_attribute(router: torch.nn.Module, name: str) -> Any:
    try:
        return getattr(router, name)
    except AttributeError:
        raise RouterMismatch(f"{type(router).__name__} has no `{name}`") from None


def softmax_then_pick(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE: softmax over all experts in fp32, renormalized over the k when `norm_topk_prob`."""
    picked = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if _router_attribute(router, "norm_topk_prob"):
        picked = picked / picked.sum(dim=-1, keepdim=True)
    return picked


def softmax_then_pick_renormalized(
    _router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Mixtral: softmax over all experts in fp32, always renormalized over the k."""
    picked = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return picked / picked.sum(dim=-1, keepdim=True)


def pick_then_softmax(_router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the k chosen logits only (the router's bias is inside the logits)."""
    return torch.softmax(logits.gather(-1, experts), dim=-1, dtype=logits.dtype)


def sigmoid_then_pick_scaled(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores at the chosen experts (the correction bias steers only the choice),
    renormalized when `norm_topk_prob`, times `routed_scaling_factor`."""
    picked = logits.sigmoid().gather(-1, experts)
    if _router_attribute(router, "norm_topk_prob"):
        picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
    return picked * _router_attribute(router, "routed_scaling_factor")


def linear_logits(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE, Mixtral, GPT-OSS: the router is a linear layer (GPT-OSS's with a bias) over [tokens, H]."""
    weight = router.weight
    return F.linear(hidden.reshape(-1, weight.shape[-1]), weight, getattr(router, "bias", None))


def fp32_linear_logits(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: the router's linear layer in fp32, whatever the model's dtype."""
    weight = router.weight
    return F.linear(hidden.reshape(-1, weight.shape[-1]).float(), weight.float())


# ---------------------------------------------------------------- the families


def _every_layer(config: Any) -> list[int]:
    return list(range(config.num_hidden_layers))


def _qwen3_moe_layers(config: Any) -> list[int]:
    """Qwen3MoeDecoderLayer: sparse every `decoder_sparse_step`-th layer, except `mlp_only_layers`."""
    if config.num_experts <= 0:
        return []
    only_mlp = set(config.mlp_only_layers or [])
    step = config.decoder_sparse_step
    return [i for i in range(config.num_hidden_layers) if i not in only_mlp and (i + 1) % step == 0]


def _deepseek_v3_layers(config: Any) -> list[int]:
    """DeepseekV3DecoderLayer: dense below `first_k_dense_replace`."""
    return list(range(config.first_k_dense_replace, config.num_hidden_layers))


@dataclass(frozen=True)
class MoeFamily:
    name: str
    model_types: tuple[str, ...]
    router: str  # the in-memory name of a router module, after its layer's prefix
    experts_attribute: str  # config attribute: routed experts per MoE layer
    top_k_attribute: str  # config attribute: experts each token is routed to
    moe_layers: Callable[[Any], list[int]]  # config -> the decoder layers that have a router
    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # (router, its input) -> logits [T, E]
    weights: RoutingWeights
    layout: ExpertLayout

    def expert_count(self, config: Any) -> int:
        return int(getattr(config, self.experts_attribute))

    def top_k(self, config: Any) -> int:
        return int(getattr(config, self.top_k_attribute))

    @property
    def disk_router(self) -> str:
        """The router's name on disk (`block_sparse_moe.gate` for Mixtral): what a quantization config
        must exclude, since routers stay bf16."""
        return self.layout.disk_name(f"x.{self.router}").removeprefix("x.")

    def chosen(self, output: Any) -> torch.Tensor:
        """The expert ids [tokens, k] a router picked, from its forward output."""
        return router_output(output)[2]

    def forced(self, router: torch.nn.Module, hidden: torch.Tensor, output: Any, experts: torch.Tensor) -> tuple:
        """The router's output had it picked `experts` [tokens, k] for its input `hidden`: the weights are
        recomputed from its logits at those experts, so gradients still reach the router.

        The logits are recomputed from the router's input too, not taken from its output: what a router
        returns first has changed meaning across transformers 5 releases (Qwen3-MoE's returned
        probabilities in 5.0, logits by 5.17), its weights and its linear layer have not."""
        first, weights, _ = router_output(output)
        logits = self.logits(router, hidden)
        return first, self.weights(router, logits, experts).to(weights.dtype), experts


def router_output(output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E], weights [T, k], expert ids [T, k]), the output every registered router has."""
    if not (
        isinstance(output, tuple)
        and len(output) == 3
        and all(isinstance(t, torch.Tensor) for t in output)
        and not output[2].is_floating_point()
        and output[1].shape == output[2].shape
    ):
        kinds = type(output).__name__ if not isinstance(output, tuple) else f"a tuple of {len(output)}"
        raise RouterMismatch(f"a router returned {kinds}, not (router_logits, routing_weights, expert_ids)")
    return output


MOE_FAMILIES: dict[str, MoeFamily] = {
    family.name: family
    for family in (
        MoeFamily(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            router="mlp.gate",
            experts_attribute="num_experts",
            top_k_attribute="num_experts_per_tok",
            moe_layers=_qwen3_moe_layers,
            logits=linear_logits,
            weights=softmax_then_pick,
            layout=SplitExperts(),
        ),
        MoeFamily(
            name="mixtral",
            model_types=("mixtral",),
            router="mlp.gate",
            experts_attribute="num_local_experts",
            top_k_attribute="num_experts_per_tok",
            moe_layers=_every_layer,
            logits=linear_logits,
            weights=softmax_then_pick_renormalized,
            layout=SplitExperts(disk_block="block_sparse_moe", gate="w1", up="w3", down="w2"),
        ),
        MoeFamily(
            name="gpt_oss",
            model_types=("gpt_oss",),
            router="mlp.router",
            experts_attribute="num_local_experts",
            top_k_attribute="num_experts_per_tok",
            moe_layers=_every_layer,
            logits=linear_logits,
            weights=pick_then_softmax,
            layout=SameNames(),
        ),
        MoeFamily(
            name="deepseek_v3",
            model_types=("deepseek_v3",),
            router="mlp.gate",
            experts_attribute="n_routed_experts",
            top_k_attribute="num_experts_per_tok",
            moe_layers=_deepseek_v3_layers,
            logits=fp32_linear_logits,
            weights=sigmoid_then_pick_scaled,
            layout=SplitExperts(),
        ),
    )
}

_BY_MODEL_TYPE = {model_type: family for family in MOE_FAMILIES.values() for model_type in family.model_types}

LEGACY_LAYOUT = MOE_FAMILIES["qwen3_moe"].layout
"""The layout of a caller that names no model type: Qwen3-MoE's, the only one before families."""


def is_moe_config(config: Any) -> bool:
    return any((getattr(config, name, None) or 0) > 0 for name in (*EXPERT_COUNT_ATTRIBUTES, "num_experts_per_tok"))


def family_of(config: Any, needed_for: str = "its routes cannot be recorded or replayed") -> MoeFamily | None:
    """The config's MoE family; None for a dense model; UnsupportedMoeFamily for an unregistered MoE one."""
    family = _BY_MODEL_TYPE.get(config.model_type)
    if family is None and is_moe_config(config):
        raise UnsupportedMoeFamily(config.model_type, needed_for)
    return family


def expert_layout(model_type: str | None) -> ExpertLayout:
    """How `model_type` names its tensors on disk; None: the legacy (Qwen3-MoE) names."""
    if model_type is None:
        return LEGACY_LAYOUT
    family = _BY_MODEL_TYPE.get(model_type)
    return family.layout if family is not None else SameNames(model_type)


@dataclass(frozen=True)
class RoutingShape:
    """What one position of a recorded route must be for a model: `layers` lists of `top_k` distinct
    expert ids below `experts`. A dense model's is all zeros: it has no route to record."""

    layers: int
    top_k: int
    experts: int


DENSE = RoutingShape(0, 0, 0)


def routing_shape(config: Any) -> RoutingShape:
    family = family_of(config)
    if family is None:
        return DENSE
    return RoutingShape(len(family.moe_layers(config)), family.top_k(config), family.expert_count(config))


def model_routers(model: torch.nn.Module) -> tuple[MoeFamily | None, list[torch.nn.Module]]:
    """The model's MoE family and its routers in layer order; (None, []) for a dense model.

    The routers found must be as many as the config's MoE layers: a transformers release that renamed
    them would otherwise record (or replay) no route at all, silently."""
    config = model.config
    family = _BY_MODEL_TYPE.get(config.model_type)
    if family is None:
        has_experts = any(name.endswith(".experts") for name, _ in model.named_modules())
        if is_moe_config(config) or has_experts:
            raise UnsupportedMoeFamily(config.model_type, "its routes cannot be recorded or replayed")
        return None, []
    suffix = "." + family.router
    found = [module for name, module in model.named_modules() if name.endswith(suffix)]
    expected = len(family.moe_layers(config))
    if len(found) != expected:
        raise RouterMismatch(
            f"{type(model).__name__} has {len(found)} modules named *{suffix}, its config {expected} MoE layers"
        )
    return family, found
