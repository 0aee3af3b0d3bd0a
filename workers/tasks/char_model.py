"""The base policy of a file task run without `--model`: a character-level tokenizer and a tiny model.

The tokenizer is built by `tokenizers` over the characters the task's rows, answers and template
use (plus the digits and '-', so any integer can be written), with a chat template of its own in
`tokenizer_config.json` so that prompts go through the same chat-template path a real checkpoint's
do. The model is the demo's tiny Qwen3-MoE at this vocabulary, with positions for the longest
prompt and its completion. A short supervised warm-up on the rows (prompt -> answer, end of
sequence) teaches it the answer's form; it need not solve the task. The directory is cached in the
state folder under a hash of everything that shapes it (the source's bytes included), so later
runs skip the warm-up, exactly like the addition demo's (`workers/up/demo_task.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from workers.tasks.registry import TaskSpec
from workers.tasks.sources import Row, load_rows, source_digest
from workers.tasks.supervised_warmup import move_into_cache, train_on_answers

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}\n"
    "{% else %}Q: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
)
"""`<bos>System text\nQ: the question\nA: ` — short, and written only in characters the tokenizer has."""

MAX_ALPHABET = 2048
"""A task whose text uses more distinct characters than this wants a real tokenizer (`--model`)."""


def _texts(rows: list[Row], spec: TaskSpec) -> list[str]:
    out = [spec.system or "", CHAT_TEMPLATE if spec.template == "model" else spec.template, "0123456789-"]
    for row in rows:
        out.append(row.answer)
        out.extend([row.prompt] if isinstance(row.prompt, str) else [m["content"] for m in row.prompt])
    return out


def alphabet(rows: list[Row], spec: TaskSpec) -> list[str]:
    from pipeline.errors import SprawlError

    chars = sorted(set("".join(_texts(rows, spec))))
    if len(chars) > MAX_ALPHABET:
        raise SprawlError(
            f"the task's text uses {len(chars)} distinct characters, too many for a character-level tokenizer",
            hint="run it on a model of your own: `sprawl up --model PATH`",
        )
    return chars


def build_tokenizer(chars: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token a character; `(?m)`: Oniguruma's dot-matches-newline, so "\n\n" is two tokens, not <unk>.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)  # decoding (in the islands, for the verifier) leaves them out
    return tokenizer


def write_tokenizer(directory: Path, chars: list[str]) -> None:
    """tokenizer.json and a tokenizer_config.json naming the special tokens and carrying the chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(chars).save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_cache_dir(state_dir: Path, spec: TaskSpec, seed: int) -> Path:
    """Keyed by everything that shapes the model: the rows' bytes, how they are rendered, the warm-up."""
    shape = {
        "source": source_digest(spec),
        "spec": spec.model_dump(mode="json", exclude={"source", "format"}),
        "seed": seed,
        "template": CHAT_TEMPLATE,
        "v": 1,
    }
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    return state_dir.resolve() / "models" / f"task-{key}"


def cached_model(state_dir: Path, spec: TaskSpec, seed: int) -> Path | None:
    directory = model_cache_dir(state_dir, spec, seed)
    if (directory / "config.json").exists() and (directory / "tokenizer_config.json").exists():
        return directory
    return None


def _examples(directory: Path, rows: list[Row], spec: TaskSpec) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + <eos>) of every row, rendered as the run will render them."""
    from workers.tasks.render import PromptRenderer, load_tokenizer

    tokenizer = load_tokenizer(directory)
    renderer = PromptRenderer(tokenizer, spec.template, system=spec.system)
    out = []
    for row in rows:
        _, prompt = renderer.render(row.prompt)
        out.append((prompt, [*tokenizer(row.answer, add_special_tokens=False).input_ids, EOS]))
    return out


def warmed_up_model(state_dir: Path, spec: TaskSpec, seed: int = 0, progress=None) -> Path:
    """The task's warmed-up base policy as an HF directory, built once and cached. In this process:
    `sprawl up` runs it in a child it can stop (`workers/up/warmup.py`)."""
    cached = cached_model(state_dir, spec, seed)
    if cached is not None:
        return cached
    import torch
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    from pipeline.tiny_models import tiny_moe_config

    hf_logging.disable_progress_bar()
    directory = model_cache_dir(state_dir, spec, seed)
    staging = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    rows = load_rows(spec)
    chars = alphabet(rows, spec)
    write_tokenizer(staging, chars)
    examples = _examples(staging, rows, spec)
    longest = max(len(p) for p, _ in examples) + spec.max_new_tokens + 1
    config = tiny_moe_config(
        vocab_size=len(SPECIALS) + len(chars),
        max_position_embeddings=-(-longest // 64) * 64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = Qwen3MoeForCausalLM(config).train()
    train_on_answers(
        model,
        lambda: _batch([rng.choice(examples) for _ in range(spec.warmup_batch)]),
        steps=spec.warmup_steps,
        lr=spec.warmup_lr,
        progress=progress,
    )
    model.save_pretrained(staging)
    return move_into_cache(staging, directory, "tokenizer_config.json")


def _batch(examples: list[tuple[list[int], list[int]]]):
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), PAD)
    mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for i, (prompt, answer) in enumerate(examples):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        mask[i, len(prompt) : len(prompt) + len(answer)] = True
    return ids, mask
