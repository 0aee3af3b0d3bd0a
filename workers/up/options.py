"""What `sprawl up` runs, as two models (no torch here: `sprawl up` checks them before anything loads).

- `UpOptions`: how this invocation runs (`--quick`, `--islands`, `--no-local-islands`, `--views`,
  `--correction`, `--fresh`, `--versions`, `--json`, `--no-live`, `--model`): flags only.
- `UpSettings`: the run's configuration, from flags, `SPRAWL_...` variables and `--config FILE` like
  every worker's: the stack's settings plus the trainer's and chain's sections (with the demo's
  tuned defaults), the task (`task.name`; tasks of your own in `[tasks.NAME]` tables,
  `workers/tasks/registry.py`) and the prompt driver. `up` derives each worker's settings from it
  and hands them over as a TOML file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from infra.stack import StackSettings
from pipeline.config import ChainSettings, CommandOptions, Section
from pipeline.off_policy.registry import apply_spec, correction_spec
from workers.tasks.registry import TaskSpec, declared_tasks, resolve_task
from workers.trainer.settings import TrainerSection

VIEW_ALIASES = {"bf16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "mxfp4": "mxfp4"}
"""The views `up` can put on an island, by the names its `--views` accepts."""

QUICK_VERSIONS, DEFAULT_VERSIONS = 30, 500


class TaskSettings(Section):
    """Which task the run trains on; and the addition demo's own settings: its problems and the
    supervised warm-up of its base policy (a file task's warm-up is in its `[tasks.NAME]` table)."""

    name: str = "addition"
    """The task: `addition` (the demo), `math_word` (short word problems, a sample that ships with
    sprawl), or one of your own declared in a `[tasks.NAME]` table (`workers/tasks/registry.py`)."""
    digits: int = Field(2, ge=1, le=19)
    """Operands have up to this many digits (at most 19: a problem and its answer fit the model's
    64 positions)."""
    warmup_steps: int = Field(550, ge=0)
    """Supervised steps on correct examples before RL."""
    warmup_batch: int = Field(64, ge=1)
    """Examples per warm-up step."""
    warmup_lr: float = Field(3e-3, gt=0)
    """AdamW learning rate of the warm-up."""
    seed: int = Field(0, ge=0)
    """Seed of the warm-up's initialization and examples."""


class PromptSection(Section):
    """How `up`'s prompt driver publishes prompt groups."""

    top_p: float = Field(0.95, gt=0, le=1)
    """Nucleus sampling threshold the islands sample with (the kept set is what mask replay replays)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature the islands sample with (the trainer computes at the same one unless
    `trainer.train_temperature` says otherwise)."""
    groups_ahead: int = Field(16, ge=1)
    """Prompt groups published beyond what the trainer has taken: bounds staleness at about
    groups_ahead / trainer.groups_per_batch versions."""
    top_logprobs: int | None = Field(None, ge=1)
    """Log-probabilities the islands return per sampled token (score centering): by default the whole
    vocabulary when it has at most 1024 tokens (the demo models: exact), else the top 32."""


class WatchdogSection(Section):
    """`up`'s stall watchdog."""

    stall_after_s: float = Field(300.0, gt=0)
    """Say loudly that the run is stalled (and what looks stuck) when no new policy version has
    appeared for this long."""


DEMO_DEFAULTS: dict[str, dict[str, Any]] = {
    "trainer": {"groups_per_batch": 8, "group_size": 16, "learning_rate": 3e-4},
    # skip_distances [2]: an island at v-1 still holds v-2 in its standby slot (keep_versions 2), so one
    # corrupt patch is routed around with one skip patch instead of pinning every island until the next keyframe.
    "chain": {"views": ["bf16", "fp8_e4m3"], "keyframe_every": 50, "skip_distances": [2]},
}
"""Where the demo's tuned values differ from the library's defaults (see the README)."""


class UpSettings(StackSettings):
    """The configuration of a `sprawl up` run."""

    trainer: TrainerSection = TrainerSection(**DEMO_DEFAULTS["trainer"])
    """The trainer's update (`model_dir`, `trainer_id` and `max_versions` are set by `up`)."""
    chain: ChainSettings = ChainSettings(**DEMO_DEFAULTS["chain"])
    """The views published for every version (`--views` sets them) and the chain's shape."""
    task: TaskSettings = TaskSettings()
    """The task (`task.name`), and the addition demo's settings and warm-up."""
    tasks: dict[str, TaskSpec] = {}
    """Tasks of your own, by name (`[tasks.NAME]` tables: source, fields, template, verifier); a table
    named after a built-in file task (`math_word`) changes the fields it names."""
    prompts: PromptSection = PromptSection()
    """The prompt driver."""
    watchdog: WatchdogSection = WatchdogSection()
    """When a run without new versions counts as stalled."""

    @model_validator(mode="before")
    @classmethod
    def _demo_defaults_under_partial_sections(cls, data: Any) -> Any:
        """`--trainer.learning-rate 1e-3` (or a `[trainer]` table that names a few fields) keeps the
        demo's values for the fields it does not name, not the library's."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section, defaults in DEMO_DEFAULTS.items():
            if isinstance(data.get(section), dict):
                data[section] = defaults | data[section]
        return data

    @field_validator("tasks", mode="before")
    @classmethod
    def _declared_tasks(cls, value: Any) -> Any:
        return declared_tasks(value)

    @model_validator(mode="after")
    def _task_known(self) -> UpSettings:
        resolve_task(self.task.name, self.tasks)  # an unknown name: a TaskError naming the known ones
        return self


class UpOptions(CommandOptions):
    """How this `sprawl up` runs."""

    quick: bool = False
    """A shorter run: 30 updates instead of 500 (when --versions is not given)."""
    islands: int = Field(2, ge=1)
    """Sampler islands, given the views in turn."""
    local_islands: bool = True
    """Start the islands here, beside the trainer. --no-local-islands runs the cluster side only (stack,
    trainer, rewards, archiver, prompt driver): islands join from other machines or networks with
    `sprawl token create --role sampler` and `sprawl sampler --join TOKEN`, and the run waits for them."""
    views: list[str] | None = None
    """Served views, one per island in turn: bf16, fp8 (fp8_e4m3), mxfp4; default: chain.views."""
    correction: str | None = None
    """Off-policy correction, e.g. sc+mis+mask (the default: trainer.loss as configured)."""
    fresh: bool = False
    """Start a new run instead of continuing the last one."""
    json_output: bool = Field(False, validation_alias="json")
    """Print the summary as one JSON object, last on stdout (human output goes to stderr)."""
    versions: int | None = Field(None, ge=1)
    """Updates this invocation adds to the run (default 500, with --quick 30)."""
    live: bool = True
    """The live view when the output is a terminal (--no-live: a progress line every 10 s)."""
    model: Path | None = None
    """A local Hugging Face checkpoint directory (config.json, weights, tokenizer.json, and the chat
    template in tokenizer_config.json) to train from, instead of the demo's warmed-up tiny model: no
    warm-up, nothing downloaded; the task's prompts are rendered with its tokenizer."""

    @field_validator("views", mode="before")
    @classmethod
    def _views(cls, value: object) -> object:
        if value is None:
            return None
        names = value.split(",") if isinstance(value, str) else value
        out = []
        for name in (str(n).strip() for n in names if str(n).strip()):  # type: ignore[union-attr]
            if name not in VIEW_ALIASES:
                raise ValueError(f"unknown view {name!r}: choose from bf16, fp8 (fp8_e4m3), mxfp4")
            out.append(VIEW_ALIASES[name])
        if not out:
            raise ValueError("--views needs at least one view")
        return out

    @field_validator("correction")
    @classmethod
    def _correction(cls, value: str | None) -> str | None:
        if value is not None:
            apply_spec(TrainerSection().loss, value)  # unknown or conflicting names, and invalid combinations
        return value

    @property
    def target_versions(self) -> int:
        return self.versions if self.versions is not None else (QUICK_VERSIONS if self.quick else DEFAULT_VERSIONS)


def run_settings(options: UpOptions, settings: UpSettings) -> UpSettings:
    """`settings` with what the options decide: the published views and the loss's switches."""
    update: dict = {}
    if options.views is not None:
        views = sorted(set(options.views))
        update["chain"] = ChainSettings.model_validate(settings.chain.model_dump() | {"views": views})
    if options.correction is not None:
        loss = apply_spec(settings.trainer.loss, options.correction)
        update["trainer"] = settings.trainer.model_copy(update={"loss": loss})  # a validated section
    return settings.model_copy(update=update) if update else settings


def island_views(options: UpOptions, settings: UpSettings) -> list[str]:
    """The view of each island `up` starts here: the given views (else the published ones) in turn;
    none with --no-local-islands (islands that join with tokens choose their own view)."""
    if not options.local_islands:
        return []
    views = options.views or settings.chain.views
    return [views[i % len(views)] for i in range(options.islands)]


def correction_of(settings: UpSettings) -> str:
    return correction_spec(settings.trainer.loss)
