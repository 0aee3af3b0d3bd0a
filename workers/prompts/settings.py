"""What `sprawl prompts` runs with: the run, the log, and the same sections `sprawl up` drives prompts
from (the task, `prompts.groups_ahead`, and the trainer's batch shape it must agree with).

No torch here: the CLI imports this before anything heavy loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from pipeline.config import Section, SprawlSettings
from workers.tasks.registry import TaskSpec, declared_tasks, resolve_task
from workers.trainer.settings import TrainerSection
from workers.up.options import PromptSection, TaskSettings


class FeedSection(Section):
    """How the driver follows the run."""

    poll_s: float = Field(1.0, gt=0)
    """How often it reads the chain's head and tops the window up."""
    outage_patience_s: float = Field(120.0, ge=0)
    """How long the log may stay unreachable before the driver exits non-zero (its supervisor, on
    Kubernetes the Deployment, restarts it visibly); the same default as `blobs.outage_patience_s`."""


class PromptsSettings(SprawlSettings):
    """The configuration of `sprawl prompts`."""

    trainer: TrainerSection = TrainerSection()
    """The trainer's batch shape: groups are published with `group_size` samples, and the trainer has
    taken `groups_per_batch` groups per version (set both as the trainer's; `max_versions` bounds how
    many groups are ever published)."""
    task: TaskSettings = TaskSettings()
    """The task (`task.name`; the addition demo's `task.digits`), as `sprawl up` runs it."""
    tasks: dict[str, TaskSpec] = {}
    """Tasks declared by the run (`[tasks.NAME]` tables), as `sprawl up` reads them."""
    model_dir: Path | None = None
    """The run's initial model directory, whose tokenizer and chat template render the prompts (the
    trainer's `trainer.model_dir`). Every task but `addition` needs it; `addition` without it uses the
    demo's own tokenizer, as `sprawl up` does without `--model`."""
    prompts: PromptSection = PromptSection()
    """`groups_ahead` and the sampling's `top_p`, as in `sprawl up`."""
    feed: FeedSection = FeedSection()
    """Polling and patience."""

    @field_validator("tasks", mode="before")
    @classmethod
    def _declared_tasks(cls, value: Any) -> Any:
        return declared_tasks(value)

    @model_validator(mode="after")
    def _task_known(self) -> PromptsSettings:
        resolve_task(self.task.name, self.tasks)
        return self
