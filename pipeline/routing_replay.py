"""MoE routing replay: force a model's routers to pick the experts a sampler recorded.

The experts are replayed; the routing weights are recomputed at those experts from the trainer's own
router logits (recomputed from the router's input and weights), by the formula of the model's MoE
family (`pipeline.moe_families`: softmax, renormalized or not; softmax over the k logits; sigmoid times
a scale), so gradients still reach the router. Positions without a recorded route (padding, the last
token) keep the trainer's own choice.

A record this model cannot replay is refused before any forward pass (`RoutingRecordRefused`): a layer
count or k that is not the model's, an expert id out of range (transformers would drop or clamp it
without a word: an id equal to the expert count is its expert-parallel sentinel), an expert twice in
one position. A silent wrong route would train a mixture the sampler never ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pipeline.errors import SprawlError
from pipeline.moe_families import model_routers


class RoutingRecordRefused(SprawlError, ValueError):
    """A recorded route that does not fit the model it would be replayed on."""

    def __init__(self, detail: str):
        super().__init__(
            detail,
            hint="the trajectory was routed by another model (or forged); the trainer's admission refuses "
            "such trajectories before they reach a batch",
        )


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order ([] for a dense model; UnsupportedMoeFamily for an unregistered MoE)."""
    return model_routers(model)[1]


def check_record(routed: torch.Tensor, valid: torch.Tensor, *, layers: int, top_k: int, experts: int) -> None:
    """Refuse a record [B, S, layers, top_k] whose recorded positions name an expert out of range or twice."""
    if routed.dim() != 4 or tuple(routed.shape[:2]) != tuple(valid.shape):
        raise RoutingRecordRefused(
            f"recorded routing is {tuple(routed.shape)} for positions {tuple(valid.shape)}; expected "
            f"[batch, positions, MoE layers, k]"
        )
    if routed.shape[2] != layers:
        raise RoutingRecordRefused(f"recorded routing has {routed.shape[2]} MoE layers, the model has {layers}")
    if routed.shape[3] != top_k:
        raise RoutingRecordRefused(f"recorded routing picks {routed.shape[3]} experts a token, the model {top_k}")
    recorded = routed[valid.bool()]
    if recorded.numel() == 0:
        return
    low, high = int(recorded.min()), int(recorded.max())
    if low < 0 or high >= experts:
        raise RoutingRecordRefused(f"recorded expert id {high if high >= experts else low} is outside 0..{experts - 1}")
    ordered = recorded.sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise RoutingRecordRefused("a recorded position routes a token to the same expert twice")


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor, valid: torch.Tensor) -> Iterator[None]:
    """routed [B, S, L, k] expert ids per input position and MoE layer; valid [B, S] where recorded."""
    family, routers = model_routers(model)
    if family is None:
        raise RoutingRecordRefused("routing replay on a dense model: it has no router to force")
    config = model.config
    check_record(routed, valid, layers=len(routers), top_k=family.top_k(config), experts=family.expert_count(config))
    flat = routed.reshape(-1, routed.shape[2], routed.shape[3]).long()
    flat_valid = valid.reshape(-1).bool()

    def make_hook(layer: int):
        def hook(module, args, kwargs, output):
            own = family.chosen(output)
            if own.shape[0] != flat.shape[0]:
                raise RoutingRecordRefused(
                    f"the forward routes {own.shape[0]} tokens, the record covers {flat.shape[0]} positions"
                )
            forced = torch.where(flat_valid[:, None].to(own.device), flat[:, layer, :].to(own.device), own)
            hidden = args[0] if args else kwargs["hidden_states"]
            return family.forced(module, hidden, output, forced)

        return hook

    handles = [router.register_forward_hook(make_hook(i), with_kwargs=True) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
