"""A prompt made into the model's input: text and token ids, with the model directory's own tokenizer.

`model`: the chat template the model directory carries (`tokenizer_config.json`'s `chat_template`, or
`chat_template.jinja`), applied with `add_generation_prompt=True`; a task may bring a Jinja template
of its own instead; `raw`: the prompt text as it is, with whatever special tokens the tokenizer adds
itself. The tokenizer is loaded from the local directory only (`local_files_only`): nothing is
downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path

from workers.tasks.model_dir import max_positions
from workers.tasks.registry import TaskError
from workers.tasks.sources import Messages


def load_tokenizer(model_dir: Path):
    """The model directory's tokenizer (transformers), from local files only."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    try:
        if (model_dir / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        # A bare tokenizer.json (the addition demo's): no class or special tokens to read.
        return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    except (OSError, ValueError) as exc:
        raise TaskError(
            f"cannot load the tokenizer of {model_dir}: {str(exc)[:300]}",
            hint="the directory needs tokenizer.json, and tokenizer_config.json for special tokens and a chat template",
        ) from None


class PromptRenderer:
    """Renders prompts for one model and one template."""

    def __init__(self, tokenizer, template: str, *, system: str | None = None, max_positions: int | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        self.max_positions = max_positions
        if template == "model" and not getattr(tokenizer, "chat_template", None):
            raise TaskError(
                "the task renders prompts with the model's chat template, and the model has none",
                hint="set `template` in the task's [tasks.NAME] table to `raw` or to a Jinja chat template",
            )
        if template == "raw" and system is not None:
            raise TaskError(
                "a `raw` template has no place for a system message", hint="drop `system`, or use a chat template"
            )

    @classmethod
    def for_model(cls, model_dir: Path, template: str, *, system: str | None = None) -> PromptRenderer:
        return cls(load_tokenizer(model_dir), template, system=system, max_positions=max_positions(model_dir))

    def messages(self, prompt: str | Messages) -> Messages:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))

    def render(self, prompt: str | Messages, *, max_new_tokens: int = 0) -> tuple[str, list[int]]:
        """(the input text, its token ids). Refused: an input the model cannot take with `max_new_tokens` more."""
        if self.template == "raw":
            if not isinstance(prompt, str):
                raise TaskError("a `raw` template takes text prompts, not chat messages", hint="use a chat template")
            text = prompt
            ids = self.tokenizer(text, add_special_tokens=True).input_ids
        else:
            from jinja2 import TemplateError

            own = None if self.template == "model" else self.template
            try:
                text = self.tokenizer.apply_chat_template(
                    self.messages(prompt), chat_template=own, add_generation_prompt=True, tokenize=False
                )
            except TemplateError as exc:
                raise TaskError(f"the chat template failed: {exc}", hint="check the task's `template`") from None
            # The template wrote the special tokens it wants: the tokenizer adds none of its own.
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise TaskError(f"the prompt {text[:80]!r} renders to no tokens", hint="check the row and the template")
        if self.max_positions is not None and len(ids) + max_new_tokens > self.max_positions:
            raise TaskError(
                f"a prompt of {len(ids)} tokens and {max_new_tokens} new ones exceed the model's "
                f"{self.max_positions} positions: {text[:80]!r}...",
                hint="shorten the task's prompts or lower its max_new_tokens",
            )
        return text, list(ids)
