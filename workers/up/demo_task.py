"""The demo task of `just up`: multi-digit addition, its tokenizer, and the cached supervised warm-up.

The tokenizer is built from the task's alphabet with the `tokenizers` library (nothing
downloaded); the model is a tiny Qwen3-MoE from a transformers config. A short supervised warm-up
brings the base policy to a modest pass rate so that RL has something to improve; it is cached in
the state folder under a hash of everything that shapes it, so later runs skip it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch

from pipeline.tiny_models import tiny_moe_config
from workers.tasks.supervised_warmup import move_into_cache, train_on_answers
from workers.up.options import TaskSettings

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = list("0123456789+=")
PAD, BOS, EOS = 0, 1, 2
VOCAB_SIZE = len(SPECIALS) + len(ALPHABET)
"""Small enough that samplers return the whole distribution: score centering is then exact."""


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + ALPHABET)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    # Registered as special, so decoding (in the samplers, for the verifier) leaves `<eos>` out.
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def problem(rng: random.Random, digits: int) -> tuple[str, str]:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}=", str(a + b)


def model_config(vocab_size: int):
    return tiny_moe_config(
        vocab_size=vocab_size, max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD
    )


def _batch(tokenizer, rng: random.Random, cfg: TaskSettings) -> tuple[torch.Tensor, torch.Tensor]:
    rows, masks = [], []
    for _ in range(cfg.warmup_batch):
        prompt, answer = problem(rng, cfg.digits)
        p = [BOS, *tokenizer.encode(prompt).ids]
        a = [*tokenizer.encode(answer).ids, EOS]
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids, loss_mask


def pass_rate(model, tokenizer, cfg: TaskSettings, n: int = 64, seed: int = 1) -> float:
    rng = random.Random(seed)
    correct = 0
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            prompt, answer = problem(rng, cfg.digits)
            ids = torch.tensor([[BOS, *tokenizer.encode(prompt).ids]])
            out = model.generate(
                ids,
                max_new_tokens=cfg.digits + 2,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                eos_token_id=EOS,
                pad_token_id=PAD,
            )
            text = tokenizer.decode([t for t in out[0, ids.shape[1] :].tolist() if t != EOS])
            correct += text == answer
    return correct / n


DEFAULT_TASK = TaskSettings()


def model_cache_dir(state_dir: Path, cfg: TaskSettings) -> Path:
    """Where the warmed-up model for `cfg` is cached: keyed by everything that shapes it (the same key
    as when this was a dataclass's asdict(): `name`, which task runs, does not shape this model)."""
    shape = json.dumps({**cfg.model_dump(exclude={"name"}), "vocab": SPECIALS + ALPHABET, "v": 2})
    key = hashlib.sha256(shape.encode()).hexdigest()[:16]
    return state_dir.resolve() / "models" / f"arith-{key}"


def cached_model(state_dir: Path, cfg: TaskSettings) -> Path | None:
    directory = model_cache_dir(state_dir, cfg)
    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    return None


def warmed_up_model(state_dir: Path, cfg: TaskSettings = DEFAULT_TASK, progress=None) -> Path:
    """The warmed-up initial policy as an HF directory (with tokenizer.json), built once and cached.
    In this process: `sprawl up` runs it in a child it can stop (`workers/up/warmup.py`)."""
    cached = cached_model(state_dir, cfg)
    if cached is not None:
        return cached
    tokenizer = build_tokenizer()
    directory = model_cache_dir(state_dir, cfg)
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our caller draws its own progress

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = Qwen3MoeForCausalLM(model_config(tokenizer.get_vocab_size())).train()
    train_on_answers(
        model, lambda: _batch(tokenizer, rng, cfg), steps=cfg.warmup_steps, lr=cfg.warmup_lr, progress=progress
    )
    staging = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    return move_into_cache(staging, directory, "tokenizer.json")


ANSWER_FORMAT = r"\d+"
"""What a well-formed answer looks like (the verifier counts the rest as format errors)."""


def prompt_group(
    run_id: str,
    index: int,
    cfg: TaskSettings,
    *,
    n_samples: int,
    top_p: float,
    top_logprobs: int,
    temperature: float = 1.0,
):
    """The run's `index`-th prompt group: the same problem for the same (run, index), so a re-published
    group deduplicates in the log instead of becoming a second, different group."""
    from schemas import PromptGroup, SamplingParams

    tokenizer = build_tokenizer()
    rng = random.Random(f"{run_id}/{index}")
    prompt, answer = problem(rng, cfg.digits)
    return PromptGroup(
        run_id=run_id,
        group_id=f"g{index:07d}",
        task="arith",
        prompt=prompt,
        prompt_token_ids=[BOS, *tokenizer.encode(prompt).ids],
        n_samples=n_samples,
        sampling=SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=cfg.digits + 2, logprobs_top_k=top_logprobs
        ),
        answer=answer,
        metadata={"answer_format": ANSWER_FORMAT, "digits": str(cfg.digits)},
    )
