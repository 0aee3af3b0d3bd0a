"""A model directory given with `--model`: checked before anything starts, and what `up` reads from it.

The directory is a Hugging Face checkpoint on local disk: `config.json`, the weights
(`*.safetensors`, or `pytorch_model*.bin`), and a fast tokenizer (`tokenizer.json`: the islands decode
completions with it for the verifier). Nothing is ever downloaded. No torch or transformers here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.tasks.registry import TaskError

WHOLE_VOCABULARY_UP_TO = 1024
"""A vocabulary this small is returned whole by the islands for every token: score centering is then
exact (the demo models' vocabularies have tens of tokens)."""

TOP_LOGPROBS_OF_LARGE_VOCABULARIES = 32
"""Otherwise each token's top-k log-probabilities (the islands' default)."""


def check_model_dir(path: Path) -> Path:
    """`path`, resolved, when it holds a checkpoint `up` can train and serve; else a TaskError saying what
    is missing."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise TaskError(f"--model {path}: no such directory", hint="give a local Hugging Face checkpoint directory")
    config = model_config(path)
    if not isinstance(config.get("model_type"), str):
        raise TaskError(
            f"--model {path}: config.json names no `model_type`", hint="save the model with `save_pretrained`"
        )
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if not weights:
        raise TaskError(
            f"--model {path}: no weights (*.safetensors or pytorch_model*.bin)",
            hint="save the model with `save_pretrained`; nothing is downloaded at run time",
        )
    if not (path / "tokenizer.json").is_file():
        raise TaskError(
            f"--model {path}: no tokenizer.json (the islands decode completions with it)",
            hint="write the fast tokenizer beside the weights: "
            "AutoTokenizer.from_pretrained(PATH).save_pretrained(PATH)",
        )
    return path.resolve()


def model_config(path: Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskError(f"{path}: no config.json", hint="give a Hugging Face checkpoint directory") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise TaskError(f"{file} is not JSON: {exc}", hint="save the model with `save_pretrained`") from None
    if not isinstance(config, dict):
        raise TaskError(f"{file} is not a JSON object", hint="save the model with `save_pretrained`")
    return config


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints keep the language model's sizes under `text_config`."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def vocab_size(path: Path) -> int:
    size = _text_config(model_config(path)).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise TaskError(f"{path}/config.json has no vocab_size", hint="save the model with `save_pretrained`")
    return size


def max_positions(path: Path) -> int | None:
    """The longest sequence the model takes, when its config says."""
    value = _text_config(model_config(path)).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def top_logprobs_for(path: Path, configured: int | None = None) -> int:
    """How many log-probabilities per token the islands return for this model: `configured`, else the
    whole vocabulary when it is small, else the top 32."""
    size = vocab_size(path)
    if configured is not None:
        return min(configured, size)
    return size if size <= WHOLE_VOCABULARY_UP_TO else TOP_LOGPROBS_OF_LARGE_VOCABULARIES
