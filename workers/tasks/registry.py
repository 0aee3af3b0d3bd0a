"""The registry of tasks `sprawl up` can run: the built-ins, and the ones a run's settings declare.

A task is a prompt source, how a prompt becomes the model's input (a chat template), and the
verifier that scores a completion. The addition demo is generated in code (`workers/up/demo_task.py`)
and keeps its raw `37+45=` format; every other task is a `TaskSpec`: rows of a local JSONL or
Parquet file, or a `datasets` directory saved with `save_to_disk`, each row holding a prompt and a
reference answer. `math_word` ships with the project (`workers/tasks/data/math_word.jsonl`).

A run names its task in `task.name` (`--task.name NAME`, `SPRAWL_TASK__NAME`, `[task] name = ...`) and
declares its own in `[tasks.NAME]` tables; a table named after a built-in file task changes only the
fields it names (`[tasks.math_word] warmup_steps = 20`).

No torch, transformers or pyarrow here: `sprawl up` validates its settings before anything heavy loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config import Section
from pipeline.errors import SprawlError

ADDITION = "addition"
"""The demo task's name: multi-digit addition, generated in code, configured by the `[task]` section."""

ADDITION_ROUTE = "arith"
"""The `task` its prompt groups carry (the reward worker's route), as before tasks had names."""

DATA_DIR = Path(__file__).resolve().parent / "data"

TEMPLATE_CHOICES = ("model", "raw")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class TaskError(SprawlError):
    """A task that cannot run: unknown, or its prompt source, template or model does not fit it."""


class TaskSpec(Section):
    """A task read from a file: its rows, how a row becomes a prompt, and how a completion is scored."""

    source: Path
    """The prompt source: a `.jsonl` file (one JSON object a line), a `.parquet` file, or a directory
    written by `datasets`' `save_to_disk` (read with `datasets.load_from_disk`; `pip install datasets`).
    A relative path is taken from the directory `sprawl up` runs in."""
    format: Literal["auto", "jsonl", "parquet", "datasets"] = "auto"
    """How to read `source`; `auto`: by its suffix (`.jsonl`, `.parquet`), a directory as `datasets`."""
    prompt_field: str = Field("prompt", min_length=1)
    """The row's prompt: a string, or a list of chat messages (`{"role": ..., "content": ...}`)."""
    answer_field: str = Field("answer", min_length=1)
    """The row's reference answer (a string or an integer), handed to the verifier, never to the model."""
    template: str = "model"
    """How a prompt becomes the model's input: `model` (the model directory's chat template, from its
    `tokenizer_config.json` or `chat_template.jinja`), `raw` (the prompt text as it is, with the special
    tokens the tokenizer adds by itself), or a Jinja chat template of the task's own."""
    system: str | None = None
    """A system message put before the prompt (chat templates only)."""
    verifier: str = "number"
    """Which verifier scores a completion (a name in `workers/rewards/verifiers`): `number` (the last
    number in the completion equals the integer answer), `exact` (the last line equals the answer)."""
    answer_format: str | None = None
    """A regex a well-formed final answer matches (the `exact` and `format` verifiers count the rest as
    format errors); the `number` verifier counts a completion without a number as one."""
    max_new_tokens: int = Field(16, ge=1, le=65536)
    """Completion length limit."""
    warmup_steps: int = Field(200, ge=0)
    """Without `--model`: supervised steps that warm a character-level tiny model up on the rows."""
    warmup_batch: int = Field(16, ge=1)
    """Without `--model`: rows per warm-up step."""
    warmup_lr: float = Field(3e-3, gt=0)
    """Without `--model`: AdamW learning rate of the warm-up."""

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        if value in TEMPLATE_CHOICES or "{{" in value or "{%" in value:
            return value
        raise ValueError(f"template {value!r} is neither `model`, `raw` nor a Jinja chat template")

    @model_validator(mode="after")
    def _system_needs_a_chat_template(self) -> TaskSpec:
        if self.template == "raw" and self.system is not None:
            raise ValueError("a `raw` template has no place for `system`: drop it, or use a chat template")
        return self

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, value: str) -> str:
        from workers.rewards.verifiers import VERIFIERS

        judging = {name for name, v in VERIFIERS.items() if not v.needs_sandbox}
        if value not in judging:
            raise ValueError(
                f"verifier {value!r} cannot score a file task: choose {', '.join(sorted(judging))} "
                "(sandboxed verifiers need per-row tests, which file tasks do not carry)"
            )
        return value

    @field_validator("answer_format")
    @classmethod
    def _answer_format(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"answer_format {value!r} is not a regex: {exc}") from None
        return value


BUILTIN_TASKS: dict[str, TaskSpec] = {
    "math_word": TaskSpec(
        source=DATA_DIR / "math_word.jsonl",
        template="model",
        system="Answer with a number.",
        verifier="number",
        max_new_tokens=8,
        warmup_steps=150,
        warmup_batch=16,
    ),
}
"""The file tasks that ship with sprawl (the addition demo is not a file task: see `ADDITION`)."""


def declared_tasks(value: Any) -> Any:
    """A settings' `tasks` tables before validation: a table named after a built-in file task is
    merged over it (only the fields it names change); `addition` is refused (it is `[task]`'s)."""
    if not isinstance(value, dict):
        return value
    out = {}
    for name, table in value.items():
        if name == ADDITION:
            raise ValueError("`addition` is configured in the [task] section (digits, warm-up), not in [tasks]")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"task name {name!r}: letters, digits, '_' or '-', at most 64, starting alphanumeric")
        builtin = BUILTIN_TASKS.get(name)
        if builtin is not None and isinstance(table, dict):
            table = builtin.model_dump() | table
        out[name] = table
    return out


@dataclass(frozen=True)
class Task:
    """A task resolved by name: what its prompt groups carry and which verifier scores them."""

    name: str
    spec: TaskSpec | None
    """None: the addition demo (generated in code)."""

    @property
    def route(self) -> str:
        """The prompt groups' `task`: the reward worker routes their trajectories by it."""
        return ADDITION_ROUTE if self.spec is None else self.name

    @property
    def verifier(self) -> str:
        return "exact" if self.spec is None else self.spec.verifier

    @property
    def is_addition(self) -> bool:
        return self.spec is None


def task_names(declared: dict[str, TaskSpec]) -> list[str]:
    return sorted({ADDITION, *BUILTIN_TASKS, *declared})


def resolve_task(name: str, declared: dict[str, TaskSpec] | None = None) -> Task:
    """The task called `name`: a run's own declaration, else a built-in. Unknown names are refused."""
    declared = declared or {}
    if name == ADDITION:
        return Task(ADDITION, None)
    spec = declared.get(name) or BUILTIN_TASKS.get(name)
    if spec is None:
        raise TaskError(
            f"no task named {name!r}: the tasks are {', '.join(task_names(declared))}",
            hint="declare your own in a [tasks.NAME] table of the --config file (see the README's "
            "'Bring your own model and task')",
        )
    return Task(name, spec)
