"""Write keyframes of a tiny Qwen3-MoE (random init, no downloads) for engine checks on GPU machines.

`python -m infra.tiny_checkpoint OUT_DIR` writes OUT_DIR/v0 and OUT_DIR/v1 (one Adam-sized step
apart), each an HF-layout bf16 checkpoint exactly as the version chain materializes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from pipeline.keyframe import write_checkpoint
from pipeline.tiny_models import tiny_moe_config
from pipeline.views import get_view


def tiny_config() -> Qwen3MoeConfig:
    """Big enough for the engines' fp8 block kernels (128-wide blocks), small enough to start in seconds."""
    return tiny_moe_config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        head_dim=64,
        num_experts=8,
        max_position_embeddings=1024,
        eos_token_id=0,
        bos_token_id=1,
    )


def write_versions(out: Path, view: str = "bf16") -> list[Path]:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_config())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    paths = []
    for version in (0, 1):
        if version:
            gen = torch.Generator().manual_seed(version)
            for tensor in state.values():
                tensor.add_(torch.randn(tensor.shape, generator=gen).sign() * 1e-3)
        served = get_view(view)
        path = out / f"v{version}"
        write_checkpoint(
            path,
            served.compute(state, model_type=model.config.model_type),
            {
                **model.config.to_dict(),
                **served.config_overrides(model.config.to_dict()),
                "architectures": ["Qwen3MoeForCausalLM"],
            },
        )
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_versions(Path(sys.argv[1])):
        print(written)
