"""A file task's rows, read from its prompt source: a JSONL file, a Parquet file, or a `datasets` directory.

Every row must hold the task's prompt and answer fields: a row without them, an empty prompt or an
answer that is neither text nor an integer is refused with its position, and a source with no rows
at all is refused, so a run never starts on a silently empty or half-read task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.tasks.registry import TaskError, TaskSpec

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Row:
    prompt: str | Messages
    """The prompt text, or chat messages (`role`, `content`) rendered by the chat template."""
    answer: str
    """The reference answer, as text (an integer answer as its decimal digits)."""


def source_format(spec: TaskSpec) -> str:
    if spec.format != "auto":
        return spec.format
    if spec.source.is_dir():
        return "datasets"
    suffix = spec.source.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise TaskError(
        f"cannot tell how to read {spec.source} (suffix {suffix or 'none'})",
        hint="name it .jsonl or .parquet, point at a `save_to_disk` directory, or set `format` in [tasks.NAME]",
    )


def load_rows(spec: TaskSpec) -> list[Row]:
    """Every row of the task's source, checked."""
    if not spec.source.exists():
        raise TaskError(f"the task's prompt source {spec.source} does not exist", hint="check `source` in [tasks.NAME]")
    kind = source_format(spec)
    records = {"jsonl": _jsonl, "parquet": _parquet, "datasets": _datasets}[kind](spec)
    rows = [_row(record, where, spec) for where, record in records]
    if not rows:
        raise TaskError(f"the task's prompt source {spec.source} holds no rows", hint="a task needs a prompt at least")
    return rows


def _jsonl(spec: TaskSpec) -> list[tuple[str, Any]]:
    out = []
    try:
        with spec.source.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    out.append((f"line {number}", json.loads(line)))
                except (ValueError, RecursionError) as exc:
                    raise TaskError(
                        f"{spec.source} line {number} is not JSON: {str(exc)[:200]}",
                        hint="a JSONL source holds one JSON object a line",
                    ) from None
    except UnicodeDecodeError as exc:
        raise TaskError(f"{spec.source} is not UTF-8 text: {exc}", hint="a JSONL source is UTF-8") from None
    return out


def _parquet(spec: TaskSpec) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(spec.source)
    except Exception as exc:  # pyarrow raises several types for a file it cannot read
        raise TaskError(f"{spec.source} is not a readable Parquet file: {exc}", hint="check the file") from None
    _require_columns(spec, schema.names)
    table = pq.read_table(spec.source, columns=[spec.prompt_field, spec.answer_field])
    return [(f"row {i}", record) for i, record in enumerate(table.to_pylist())]


def _datasets(spec: TaskSpec) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise TaskError(
            f"{spec.source} is a `datasets` directory, and the `datasets` package is not installed",
            hint="`pip install datasets`, or export the rows to JSONL or Parquet (`Dataset.to_json`, `to_parquet`)",
        ) from None
    try:
        loaded = datasets.load_from_disk(str(spec.source))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise TaskError(
            f"{spec.source} is not a directory written by `save_to_disk`: {exc}", hint="check `source`"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        raise TaskError(
            f"{spec.source} holds several splits ({', '.join(loaded)}), not one",
            hint=f"point `source` at one split's directory, e.g. {spec.source / next(iter(loaded), 'train')}",
        )
    _require_columns(spec, loaded.column_names)
    table = loaded.select_columns([spec.prompt_field, spec.answer_field])
    return [(f"row {i}", record) for i, record in enumerate(table.to_list())]


def _require_columns(spec: TaskSpec, names: list[str]) -> None:
    missing = [f for f in (spec.prompt_field, spec.answer_field) if f not in names]
    if missing:
        raise TaskError(
            f"{spec.source} has no column {', '.join(map(repr, missing))} (its columns: {', '.join(names)})",
            hint="set `prompt_field` / `answer_field` in the task's [tasks.NAME] table",
        )


def _row(record: Any, where: str, spec: TaskSpec) -> Row:
    if not isinstance(record, dict):
        raise TaskError(f"{spec.source} {where} is not an object", hint="each row maps field names to values")
    missing = [f for f in (spec.prompt_field, spec.answer_field) if record.get(f) is None]
    if missing:
        raise TaskError(
            f"{spec.source} {where} has no {' or '.join(map(repr, missing))} (it has: {', '.join(map(str, record))})",
            hint="set `prompt_field` / `answer_field` in the task's [tasks.NAME] table, or fix the row",
        )
    return Row(_prompt(record[spec.prompt_field], where, spec), _answer(record[spec.answer_field], where, spec))


def _prompt(value: Any, where: str, spec: TaskSpec) -> str | Messages:
    if isinstance(value, str):
        if not value.strip():
            raise TaskError(f"{spec.source} {where}: the prompt is empty", hint="every row needs a prompt")
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise TaskError(
        f"{spec.source} {where}: the prompt is a {type(value).__name__}, not text or a list of chat messages",
        hint='a prompt is a string or [{"role": "user", "content": "..."}, ...]',
    )


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)


def _answer(value: Any, where: str, spec: TaskSpec) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TaskError(
            f"{spec.source} {where}: the answer is a {type(value).__name__}, not text or an integer",
            hint="write the reference answer as a string or an integer",
        )
    text = str(value).strip()
    if not text:
        raise TaskError(f"{spec.source} {where}: the answer is empty", hint="every row needs a reference answer")
    return text


def source_digest(spec: TaskSpec) -> str:
    """A digest of the source's bytes (every file of a directory): what a model warmed up on it is keyed by."""
    import hashlib

    digest = hashlib.sha256()
    paths = sorted(p for p in spec.source.rglob("*") if p.is_file()) if spec.source.is_dir() else [spec.source]
    for path in paths:
        digest.update(str(path.relative_to(spec.source) if spec.source.is_dir() else path.name).encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
