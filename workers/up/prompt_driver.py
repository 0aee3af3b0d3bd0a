"""The prompt driver of `sprawl up`: the task's prompt groups into the log, a bounded window ahead.

Publishing stays `prompts.groups_ahead` groups beyond what the trainer has taken, so the samplers are never
idle and never far ahead: staleness stays near groups_ahead / groups_per_batch versions without
any lockstep between trainer and fleet. Group i of a run is always the same prompt, so a
re-published group deduplicates in the log. What a group holds is the task's (`workers/tasks/prompts.py`).
"""

from __future__ import annotations

from pipeline.subjects import prompts_subject
from pipeline.topology import PROMPTS
from workers.tasks.prompts import TaskPrompts
from workers.up.options import UpSettings


def task_prompts(settings: UpSettings, model_dir=None) -> TaskPrompts:
    """The run's task (`task.name`, declared in `tasks` or built in), rendered for `model_dir` (None: the
    addition demo's own tokenizer)."""
    from workers.tasks.registry import resolve_task

    task = resolve_task(settings.task.name, settings.tasks)
    return TaskPrompts(task, digits=settings.task.digits, model_dir=model_dir)


class PromptDriver:
    """Keeps `prompts.groups_ahead` prompt groups published beyond what the trainer has taken."""

    def __init__(
        self, event_log, run_id: str, settings: UpSettings, first_index: int, prompts: TaskPrompts | None = None
    ):
        self.log, self.run_id, self.settings = event_log, run_id, settings
        self.next_index = first_index
        self.prompts = prompts if prompts is not None else task_prompts(settings)
        self.top_logprobs = self.prompts.top_logprobs(settings.prompts.top_logprobs)

    async def top_up(self, trained_groups: int, stop_after: int) -> None:
        """Publish until the window is full (never beyond the groups the remaining updates need)."""
        limit = min(trained_groups + self.settings.prompts.groups_ahead, stop_after)
        while self.next_index < limit:
            group = self.prompts.group(
                self.run_id,
                self.next_index,
                n_samples=self.settings.trainer.group_size,
                top_p=self.settings.prompts.top_p,
                temperature=self.settings.prompts.temperature,
                top_logprobs=self.top_logprobs,
            )
            await self.log.append(group)
            self.next_index += 1


async def prompts_in_log(event_log, run_id: str) -> int:
    """How many prompt groups the run has, so a continued run numbers new groups after them. A log
    that does not answer raises: reading silence as 0 would reuse group ids."""
    subject = prompts_subject(run_id)
    info = await event_log.js.stream_info(PROMPTS.name, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))
