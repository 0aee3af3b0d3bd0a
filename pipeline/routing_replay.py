"""MoE routing replay: force transformers' Qwen3-MoE routers to pick the experts a sampler recorded.

The experts are replayed; the gate weights are recomputed from the trainer's own router logits at
those experts (renormalized when the model normalizes its top-k), so gradients still reach the
router. Positions without a recorded route (padding, the last token) keep the trainer's own choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for name, module in model.named_modules() if name.endswith("mlp.gate")]


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor, valid: torch.Tensor) -> Iterator[None]:
    """routed [B, S, L, k] expert ids per input position and MoE layer; valid [B, S] where recorded."""
    gates = moe_gates(model)
    if routed.shape[2] != len(gates):
        raise ValueError(f"recorded routing has {routed.shape[2]} MoE layers, the model has {len(gates)}")
    flat = routed.reshape(-1, routed.shape[2], routed.shape[3]).long()
    flat_valid = valid.reshape(-1)

    def make_hook(layer: int):
        def hook(module, _inputs, output):
            logits, _scores, indices = output
            forced = torch.where(flat_valid[:, None], flat[:, layer, :].to(indices.device), indices)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, forced)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), forced

        return hook

    handles = [gate.register_forward_hook(make_hook(i)) for i, gate in enumerate(gates)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
