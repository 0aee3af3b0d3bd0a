"""A task's prompt groups: the run's `index`-th group, the same for the same (run, index) wherever it is made.

A re-published group must deduplicate in the log instead of becoming a second, different group, so
nothing here depends on time or on who publishes. A file task walks its rows in a shuffled order,
each row once per pass (the order of pass `e` is seeded by the run id and `e`); the addition demo
draws its problem from a generator seeded by (run, index), as it always has.
"""

from __future__ import annotations

import random
from pathlib import Path

from workers.tasks.registry import Task, TaskError
from workers.tasks.render import PromptRenderer
from workers.tasks.sources import Row, load_rows


class TaskPrompts:
    """Makes a task's prompt groups for one model (whose tokenizer and chat template render them).

    The addition demo without a model directory keeps its own tokenizer and raw `[BOS] 37+45=` ids
    (`workers/up/demo_task.py`); with one (`--model`), its problems are rendered raw by that model's
    tokenizer. A file task needs the model directory."""

    def __init__(self, task: Task, *, digits: int = 2, model_dir: Path | None = None):
        self.task = task
        self.digits = digits
        self.model_dir = model_dir
        self.renderer: PromptRenderer | None = None
        self.rows: list[Row] = []
        self._order: tuple[str, int, list[int]] | None = None
        spec = task.spec
        if spec is None:
            if model_dir is not None:
                self.renderer = PromptRenderer.for_model(model_dir, "raw")
            return
        if model_dir is None:
            raise TaskError(
                f"task {task.name!r} renders its prompts with the model's tokenizer, and no model directory was given",
                hint="`sprawl up` passes its base policy's; `sprawl prompts` needs --model-dir",
            )
        self.rows = load_rows(spec)
        self.renderer = PromptRenderer.for_model(model_dir, spec.template, system=spec.system)
        # Every row must fit before the run starts: a long row found at group 5000 would stop the run then.
        for row in self.rows:
            self.renderer.render(row.prompt, max_new_tokens=spec.max_new_tokens)

    def top_logprobs(self, configured: int | None = None) -> int:
        """Log-probabilities per sampled token the groups ask for: as `model_dir.top_logprobs_for`, and
        the demo tokenizer's whole vocabulary without a model directory."""
        if self.model_dir is None:
            from workers.up.demo_task import VOCAB_SIZE

            return min(configured or VOCAB_SIZE, VOCAB_SIZE)
        from workers.tasks.model_dir import top_logprobs_for

        return top_logprobs_for(self.model_dir, configured)

    def row_index(self, run_id: str, index: int) -> int:
        """Which row group `index` asks: each row once per pass, in the pass's own shuffled order."""
        passes, offset = divmod(index, len(self.rows))
        if self._order is None or self._order[:2] != (run_id, passes):
            order = list(range(len(self.rows)))
            random.Random(f"{run_id}/pass{passes}").shuffle(order)
            self._order = (run_id, passes, order)
        return self._order[2][offset]

    def group(
        self,
        run_id: str,
        index: int,
        *,
        n_samples: int,
        top_p: float,
        top_logprobs: int,
        temperature: float = 1.0,
    ):
        from schemas import PromptGroup, SamplingParams

        spec = self.task.spec
        if spec is None and self.renderer is None:
            from workers.up.demo_task import prompt_group
            from workers.up.options import TaskSettings

            cfg = TaskSettings(digits=self.digits)
            return prompt_group(
                run_id, index, cfg, n_samples=n_samples, top_p=top_p, top_logprobs=top_logprobs, temperature=temperature
            )
        assert self.renderer is not None
        if spec is None:  # the addition demo on another model: its problems, that model's tokens
            from workers.up.demo_task import ANSWER_FORMAT, problem

            prompt, answer = problem(random.Random(f"{run_id}/{index}"), self.digits)
            text, ids = self.renderer.render(prompt, max_new_tokens=self.digits + 2)
            max_new_tokens, metadata = self.digits + 2, {"answer_format": ANSWER_FORMAT, "digits": str(self.digits)}
        else:
            row_number = self.row_index(run_id, index)
            row = self.rows[row_number]
            text, ids = self.renderer.render(row.prompt, max_new_tokens=spec.max_new_tokens)
            answer, max_new_tokens = row.answer, spec.max_new_tokens
            metadata = {"row": str(row_number)}
            if spec.answer_format is not None:
                metadata["answer_format"] = spec.answer_format
        return PromptGroup(
            run_id=run_id,
            group_id=f"g{index:07d}",
            task=self.task.route,
            prompt=text,
            prompt_token_ids=ids,
            n_samples=n_samples,
            sampling=SamplingParams(
                temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, logprobs_top_k=top_logprobs
            ),
            answer=answer,
            metadata=metadata,
        )
