"""Tasks: a prompt source, a chat template and a verifier, registered in one place (`registry.py`).

- `registry.py`: `TaskSpec` (a file task's declaration), the built-ins (`addition`, `math_word`),
  `resolve_task(name, declared)`.
- `sources.py`: a file task's rows from JSONL, Parquet or a `datasets` directory, checked.
- `render.py`: a prompt made into the model's input with the model directory's tokenizer and chat template.
- `prompts.py`: a task's prompt groups, the same for the same (run, index).
- `model_dir.py`: a `--model` checkpoint directory checked, and what is read from its config.
- `char_model.py`: the character-level tiny base policy of a file task run without `--model`.
- `make_math_word.py`: writes the `math_word` sample (`data/math_word.jsonl`).
"""
