"""Tasks (`workers/tasks/`): the registry and its refusals, each prompt source read back, chat templates
rendered from a tokenizer directory built here, the `number` verifier on right, wrong, malformed and
hostile completions, the math task's prompt groups, `--model` checks, and a run that will not change
task midway. One slow test runs `sprawl up --quick` on `math_word` end to end, then on `--model`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import IslandIdentity, PromptGroup, Trajectory, VersionSpan
from workers.rewards.verifiers import integer_value, last_number, verifier
from workers.tasks import char_model
from workers.tasks.model_dir import check_model_dir, top_logprobs_for
from workers.tasks.prompts import TaskPrompts
from workers.tasks.registry import BUILTIN_TASKS, TaskError, TaskSpec, declared_tasks, resolve_task
from workers.tasks.render import PromptRenderer, load_tokenizer
from workers.tasks.sources import Row, load_rows
from workers.up.options import TaskSettings, UpOptions, UpSettings

ROWS = [
    {"prompt": "Ann has 3 pens and gets 4 more. How many pens now?", "answer": "7", "source": "a"},
    {"prompt": "Ben had 9 cups and gave away 2. How many are left?", "answer": 7, "source": "b"},
    {"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "answer": "42", "source": "c"},
]
EXPECTED = [
    Row(ROWS[0]["prompt"], "7"),
    Row(ROWS[1]["prompt"], "7"),
    Row([{"role": "user", "content": "What is 6 times 7?"}], "42"),
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def spec_for(source: Path, **fields) -> TaskSpec:
    return TaskSpec(source=source, **fields)


# ---------------------------------------------------------------- the registry


def test_the_builtin_tasks_and_their_routes():
    addition = resolve_task("addition")
    assert (addition.route, addition.verifier, addition.is_addition) == ("arith", "exact", True)
    math = resolve_task("math_word")
    assert (math.route, math.verifier, math.spec) == ("math_word", "number", BUILTIN_TASKS["math_word"])
    assert UpSettings().task.name == "addition"  # the default stays the demo


def test_an_unknown_task_is_refused_naming_the_known_ones():
    with pytest.raises(TaskError, match=r"no task named 'nope'.*addition, math_word") as raised:
        resolve_task("nope")
    assert "[tasks.NAME]" in raised.value.hint
    with pytest.raises(TaskError, match="no task named 'nope'"):
        UpSettings(task={"name": "nope"})


def test_the_command_line_refuses_an_unknown_task_and_a_declared_one_runs(tmp_path):
    from workers.cli import parse

    with pytest.raises(TaskError, match="no task named 'mine'"):
        parse(["up", "--task", "mine"])  # the short form of --task.name
    source = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    declared = json.dumps({"mine": {"source": str(source), "verifier": "exact"}})
    settings = parse(["up", "--task.name", "mine", "--tasks", declared]).settings
    assert settings.tasks["mine"].source == source and resolve_task("mine", settings.tasks).verifier == "exact"


def test_a_config_file_declares_a_task_and_changes_a_builtin(tmp_path, monkeypatch):
    from pipeline.config import load_settings

    for name in [n for n in os.environ if n.startswith("SPRAWL_")]:
        monkeypatch.delenv(name)
    write_jsonl(tmp_path / "questions.jsonl", ROWS)
    config = tmp_path / "sprawl.toml"
    config.write_text(
        f"""
[task]
name = "questions"

[tasks.questions]
source = "{tmp_path / "questions.jsonl"}"
prompt_field = "prompt"
answer_field = "answer"
template = "model"
system = "Answer with a number."
verifier = "number"
max_new_tokens = 12

[tasks.math_word]
warmup_steps = 5
"""
    )
    settings = load_settings(UpSettings, config)
    task = resolve_task(settings.task.name, settings.tasks)
    assert task.route == "questions" and task.spec.max_new_tokens == 12 and task.spec.system == "Answer with a number."
    # A table named after a built-in changes only what it names.
    assert settings.tasks["math_word"] == BUILTIN_TASKS["math_word"].model_copy(update={"warmup_steps": 5})
    monkeypatch.setenv("SPRAWL_TASKS", json.dumps({"math_word": {"max_new_tokens": 4}}))
    monkeypatch.setenv("SPRAWL_TASK__NAME", "math_word")
    from_env = load_settings(UpSettings)
    assert from_env.task.name == "math_word" and from_env.tasks["math_word"].max_new_tokens == 4


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ({"addition": {"source": "x.jsonl"}}, "configured in the \\[task\\] section"),
        ({"bad name!": {"source": "x.jsonl"}}, "task name 'bad name!'"),
        ({"mine": {"source": "x.jsonl", "colour": "red"}}, "colour"),
        ({"mine": {}}, "source"),
        ({"mine": {"source": "x.jsonl", "template": "chatml"}}, "neither `model`, `raw` nor a Jinja"),
        ({"mine": {"source": "x.jsonl", "verifier": "code_tests"}}, "cannot score a file task"),
        ({"mine": {"source": "x.jsonl", "verifier": "nope"}}, "cannot score a file task"),
        ({"mine": {"source": "x.jsonl", "template": "raw", "system": "hi"}}, "no place for `system`"),
        ({"mine": {"source": "x.jsonl", "answer_format": "(unclosed"}}, "not a regex"),
        ({"mine": {"source": "x.jsonl", "max_new_tokens": 0}}, "max_new_tokens"),
    ],
)
def test_a_bad_task_declaration_is_refused(tasks, message):
    with pytest.raises(ValueError, match=message):
        UpSettings(tasks=tasks)


def test_declared_tasks_leaves_non_tables_to_validation():
    assert declared_tasks(None) is None
    assert (
        declared_tasks({"math_word": {"warmup_steps": 1}})["math_word"]["source"] == BUILTIN_TASKS["math_word"].source
    )


# ---------------------------------------------------------------- prompt sources


def test_jsonl_rows_round_trip(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps(ROWS[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in ROWS[1:]))
    assert load_rows(spec_for(source)) == EXPECTED


def test_parquet_rows_round_trip_reading_only_the_task_fields(tmp_path):
    table = pa.table(
        {
            "question": [r["prompt"] for r in ROWS[:2]],
            "solution": [7, 7],
            "unused": [b"\x00" * 10, b"\xff"],
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    rows = load_rows(spec_for(tmp_path / "rows.parquet", prompt_field="question", answer_field="solution"))
    assert rows == EXPECTED[:2]


def test_a_datasets_directory_round_trips(tmp_path):
    import datasets

    records = [
        {"prompt": r["prompt"] if isinstance(r["prompt"], str) else "x", "answer": str(r["answer"])} for r in ROWS
    ]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(spec_for(tmp_path / "ds")) == [Row(r["prompt"], r["answer"]) for r in records]
    # Several splits are not one prompt source: the error names them and where one split lies.
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(TaskError, match="several splits \\(train\\)") as raised:
        load_rows(spec_for(tmp_path / "dd"))
    assert str(tmp_path / "dd" / "train") in raised.value.hint


def test_a_datasets_directory_without_the_package_says_how_to_get_it(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(TaskError, match="`datasets` package is not installed") as raised:
        load_rows(spec_for(tmp_path / "ds"))
    assert "pip install datasets" in raised.value.hint


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no rows"),
        (b"\n  \n", "holds no rows"),
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer"\n', "line 2 is not JSON"),
        (b"[1, 2]\n", "line 1 is not an object"),
        (b'{"prompt": "a"}\n', "line 1 has no 'answer'"),
        (b'{"question": "a", "answer": "1"}\n', "line 1 has no 'prompt'"),
        (b'{"prompt": "a", "answer": null}\n', "line 1 has no 'answer'"),
        (b'{"prompt": "  ", "answer": "1"}\n', "the prompt is empty"),
        (b'{"prompt": 5, "answer": "1"}\n', "the prompt is a int"),
        (b'{"prompt": [{"role": "user"}], "answer": "1"}\n', "the prompt is a list"),
        (b'{"prompt": "a", "answer": 1.5}\n', "the answer is a float"),
        (b'{"prompt": "a", "answer": true}\n', "the answer is a bool"),
        (b'{"prompt": "a", "answer": ["1"]}\n', "the answer is a list"),
        (b'{"prompt": "a", "answer": " "}\n', "the answer is empty"),
        (b'{"prompt": "\xff\xfe", "answer": "1"}\n', "not UTF-8"),
        (b"[" * 100_000 + b"\n", "line 1 is not JSON"),
    ],
)
def test_a_jsonl_source_that_cannot_serve_is_refused_with_its_position(tmp_path, content, message):
    source = tmp_path / "rows.jsonl"
    source.write_bytes(content)
    with pytest.raises(TaskError, match=message):
        load_rows(spec_for(source))


def test_sources_that_are_missing_unreadable_or_unlabelled_are_refused(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_rows(spec_for(tmp_path / "missing.jsonl"))
    (tmp_path / "rows.csv").write_text("prompt,answer\na,1\n")
    with pytest.raises(TaskError, match="cannot tell how to read"):
        load_rows(spec_for(tmp_path / "rows.csv"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4)
    with pytest.raises(TaskError, match="not a readable Parquet file"):
        load_rows(spec_for(tmp_path / "broken.parquet"))
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "no_answer.parquet")
    with pytest.raises(TaskError, match="no column 'answer' \\(its columns: prompt\\)"):
        load_rows(spec_for(tmp_path / "no_answer.parquet"))
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), tmp_path / "null.parquet")
    with pytest.raises(TaskError, match="row 1 has no 'prompt'"):
        load_rows(spec_for(tmp_path / "null.parquet"))
    # `format` overrides the suffix.
    write_jsonl(tmp_path / "rows.txt", ROWS)
    assert load_rows(spec_for(tmp_path / "rows.txt", format="jsonl")) == EXPECTED


# ---------------------------------------------------------------- chat templates

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_dir(path: Path, *, chat_template: str | None, specials=("<|im_start|>", "<|im_end|>")) -> Path:
    """A checkpoint-like tokenizer directory built here: one token per character of printable ASCII,
    the ChatML markers as special tokens, and (optionally) a chat template in tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(["<unk>", *specials, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|im_end|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "vocab_size": len(vocab), "max_position_embeddings": 96})
    )
    return path


def test_the_model_directorys_chat_template_renders_prompts(tmp_path):
    renderer = PromptRenderer.for_model(
        tokenizer_dir(tmp_path / "m", chat_template=CHATML), "model", system="Be brief."
    )
    text, ids = renderer.render("What is 6 times 7?", max_new_tokens=8)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tokenizer = renderer.tokenizer
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # the markers are one special token each
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # Chat messages from the row are rendered as they are, after the system message.
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
    ]
    text, _ = renderer.render(messages)
    assert text.count("<|im_start|>") == 5 and text.endswith("2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_a_task_may_bring_its_own_template_or_none(tmp_path):
    directory = tokenizer_dir(tmp_path / "m", chat_template=CHATML)
    own = PromptRenderer.for_model(directory, "Q: {{ messages[-1]['content'] }}\nA:")
    assert own.render("2+2?")[0] == "Q: 2+2?\nA:"
    raw = PromptRenderer.for_model(directory, "raw")
    text, ids = raw.render("2+2=")
    assert text == "2+2=" and raw.tokenizer.decode(ids) == "2+2="
    with pytest.raises(TaskError, match="takes text prompts"):
        raw.render([{"role": "user", "content": "x"}])


def test_rendering_refuses_what_the_model_cannot_take(tmp_path):
    without = tokenizer_dir(tmp_path / "plain", chat_template=None)
    with pytest.raises(TaskError, match="the model has none") as raised:
        PromptRenderer.for_model(without, "model")
    assert "raw" in raised.value.hint
    renderer = PromptRenderer.for_model(tokenizer_dir(tmp_path / "m", chat_template=CHATML), "model")
    with pytest.raises(TaskError, match="exceed the model's 96 positions"):
        renderer.render("x" * 80, max_new_tokens=16)
    broken = PromptRenderer.for_model(tmp_path / "m", "{% for m in messages %}{{ m.content }")
    with pytest.raises(TaskError, match="the chat template failed"):
        broken.render("x")
    failing = PromptRenderer.for_model(tmp_path / "m", "{{ raise_exception('no system messages') }}")
    with pytest.raises(TaskError, match="no system messages"):
        failing.render("x")


def chatml_checkpoint(path: Path, *, weights: bool = True) -> Path:
    """A checkpoint shaped like a real one, as transformers 5 saves it: a byte-level BPE tokenizer
    trained here on the math sample, ChatML markers, the chat template in `chat_template.jinja`, and
    (with `weights`) a tiny dense Qwen3 (the demo's models are MoE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = load_rows(BUILTIN_TASKS["math_word"])
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([f"{r.prompt} {r.answer}" for r in rows] + ["system user assistant"], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    if weights:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(
            vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            eos_token_id=bpe.token_to_id("<|im_end|>"), pad_token_id=bpe.token_to_id("<|endoftext|>"),
            bos_token_id=bpe.token_to_id("<|endoftext|>"), tie_word_embeddings=False,
        )  # fmt: skip
        Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def test_a_chat_template_saved_beside_the_tokenizer_renders_too(tmp_path):
    directory = chatml_checkpoint(tmp_path / "m", weights=False)
    assert (directory / "chat_template.jinja").exists()  # transformers 5 keeps it out of tokenizer_config.json
    renderer = PromptRenderer(load_tokenizer(directory), "model", system="Answer with a number.")
    text, ids = renderer.render("Ann has 3 pens and gets 4 more. How many pens now?")
    assert text.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nAnn has")
    assert renderer.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_a_tokenizer_directory_that_cannot_load_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "m" / "tokenizer.json").write_text("not json")
    with pytest.raises(TaskError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path / "m")


# ---------------------------------------------------------------- --model


def test_a_model_directory_is_checked_before_anything_starts(tmp_path):
    model = tmp_path / "model"
    with pytest.raises(TaskError, match="no such directory"):
        check_model_dir(model)
    model.mkdir()
    with pytest.raises(TaskError, match=r"no config\.json"):
        check_model_dir(model)
    (model / "config.json").write_text("{not json")
    with pytest.raises(TaskError, match="is not JSON"):
        check_model_dir(model)
    (model / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(TaskError, match="names no `model_type`"):
        check_model_dir(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151_936}))
    with pytest.raises(TaskError, match="no weights"):
        check_model_dir(model)
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(TaskError, match=r"no tokenizer\.json") as raised:
        check_model_dir(model)
    assert "save_pretrained" in raised.value.hint
    (model / "tokenizer.json").write_text("{}")
    assert check_model_dir(model) == model.resolve()
    # A real vocabulary is too large to return whole: the islands' top 32, or what is configured.
    assert top_logprobs_for(model) == 32 and top_logprobs_for(model, 5) == 5
    (model / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"vocab_size": 70}}))
    assert top_logprobs_for(model) == 70 and top_logprobs_for(model, 500) == 70


def test_up_checks_model_and_task_up_front_and_a_run_keeps_its_task(tmp_path):
    from workers.up.orchestrate import check_same_task, prepare_task

    with pytest.raises(TaskError, match=r"--model .*: no such directory"):
        prepare_task(UpOptions(model=tmp_path / "nowhere"), UpSettings())
    missing = UpSettings(task={"name": "mine"}, tasks={"mine": {"source": str(tmp_path / "gone.jsonl")}})
    with pytest.raises(TaskError, match="does not exist"):
        prepare_task(UpOptions(), missing)
    run = prepare_task(UpOptions(), UpSettings(task={"name": "math_word"}))
    assert run.task.name == "math_word" and run.model is None and run.task.spec.source.is_absolute()

    run_dir = tmp_path / "runs" / "run-1"
    check_same_task(run_dir, run)  # a new run records its task
    check_same_task(run_dir, run)  # and continues with the same one
    addition = prepare_task(UpOptions(), UpSettings())
    with pytest.raises(
        TaskError, match="run run-1 trains task 'math_word'; this invocation asks for task 'addition'"
    ) as raised:
        check_same_task(run_dir, addition)
    assert "--fresh" in raised.value.hint
    older = tmp_path / "runs" / "run-0"
    (older / "config").mkdir(parents=True)  # a run `up` started before runs recorded their task: addition
    check_same_task(older, addition)
    with pytest.raises(TaskError, match="trains task 'addition'"):
        check_same_task(older, run)


# ---------------------------------------------------------------- the number verifier


def group(answer: str | None = "19") -> PromptGroup:
    return PromptGroup(
        run_id="r", group_id="g0000000", task="math_word", prompt="q", prompt_token_ids=[1], n_samples=1, answer=answer
    )


def completion(of: PromptGroup, text: str) -> Trajectory:
    """One sample of `of` whose decoded text is `text`."""
    return Trajectory(
        run_id=of.run_id,
        trajectory_id=f"{of.group_id}-0",
        group_id=of.group_id,
        sample_index=0,
        task=of.task,
        prompt_token_ids=of.prompt_token_ids,
        output_token_ids=[2],
        logprobs=[-0.1],
        finish_reason="stop",
        version_spans=[VersionSpan(version=0, start=0, end=1)],
        island=IslandIdentity(island_id="i", accelerator="cpu", view="bf16", engine="torch"),
        text=text,
    )


def judge(text: str, answer: str | None = "19"):
    asked = group(answer)
    return asyncio.run(verifier("number").verify(completion(asked, text), asked, None))


@pytest.mark.parametrize(
    "text",
    ["19", " 19\n", "12 + 7 = 19, so 19 apples.", "The answer is 19.", "019", "19.0", "19.000", "x=3; total: 19"],
)
def test_the_last_number_equal_to_the_answer_is_right(text):
    verdict = judge(text)
    assert (verdict.value, verdict.format_error, verdict.components) == (1.0, False, {"correct": 1.0})


@pytest.mark.parametrize("text", ["20", "19 apples, no wait: 20", "19.5", "-19", "190", "1,9"])
def test_another_number_is_wrong_but_well_formed(text):
    verdict = judge(text)
    assert (verdict.value, verdict.format_error, verdict.error_class) == (0.0, False, None)


@pytest.mark.parametrize(
    "text",
    ["", "   \n", "nineteen", "١٩", "１９", "𝟏𝟗", "\x00\x00", "-", ".", "answer: ?"],
)
def test_no_ascii_number_is_a_format_error(text):
    verdict = judge(text)
    assert (verdict.value, verdict.format_error, verdict.error_class) == (0.0, True, "format")


def test_hostile_completions_are_judged_without_failing():
    huge = "9" * 200_000  # int() refuses numbers this long; the verifier compares digits as text
    assert judge(huge).value == 0.0 and judge(huge, answer=huge).value == 1.0
    assert judge("1" * 5_000 + " 19").value == 1.0
    assert judge(" ".join(str(i) for i in range(100_000)) + " 19").value == 1.0  # many numbers: the last one
    assert judge("19" + "\u200b" * 10_000).value == 1.0  # a number followed by invisible padding
    assert judge("-0", answer="0").value == 1.0 and judge("1,024", answer="1024").value == 1.0
    assert judge("1,024", answer="1,024").value == 1.0


def test_a_reference_that_is_not_an_integer_is_the_tasks_fault():
    for answer in (None, "nineteen", "19.5", ""):
        verdict = judge("19", answer=answer)
        assert (verdict.value, verdict.format_error, verdict.error_class) == (0.0, False, "reference")


def test_number_reading_by_hand():
    assert last_number("a 1 b -22 c 3.50 d") == "3.50"
    assert last_number("1,234,567 and 12,34") == "34"
    assert last_number("no digits") is None
    assert [integer_value(n) for n in ("007", "-0", "1,000", "5.00", "5.01", "-12", "1,00")] == [
        "7", "0", "1000", "5", None, "-12", None,
    ]  # fmt: skip


def test_the_reward_worker_routes_math_word_to_the_number_verifier():
    from workers.rewards.worker import RewardSettings, routed_verifiers

    assert routed_verifiers(RewardSettings())["math_word"].name == "number"


# ---------------------------------------------------------------- the math task


def test_the_sample_file_is_its_generators_output():
    from workers.tasks.make_math_word import text

    source = BUILTIN_TASKS["math_word"].source
    assert source.read_text() == text()
    rows = load_rows(BUILTIN_TASKS["math_word"])
    assert len(rows) == 200 and all(integer_value(row.answer) == row.answer for row in rows)


def content(event: PromptGroup) -> dict:
    """What a group says, without its envelope's own id and time (the log deduplicates by business key)."""
    plain = msgspec.to_builtins(event)
    del plain["event_id"], plain["produced_at"]
    return plain


@pytest.fixture
def math_model_dir(tmp_path) -> Path:
    """The math task's character-level tokenizer directory (no weights: prompts need only the tokenizer)."""
    spec = BUILTIN_TASKS["math_word"]
    chars = char_model.alphabet(load_rows(spec), spec)
    directory = tmp_path / "math-model"
    char_model.write_tokenizer(directory, chars)
    vocab = len(char_model.SPECIALS) + len(chars)
    (directory / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "vocab_size": vocab, "max_position_embeddings": 128})
    )
    return directory


def test_math_prompt_groups_are_the_same_for_the_same_index_and_walk_every_row(math_model_dir):
    prompts = TaskPrompts(resolve_task("math_word"), model_dir=math_model_dir)
    top = prompts.top_logprobs()
    assert top == json.loads((math_model_dir / "config.json").read_text())["vocab_size"]  # small: whole

    def make(run: str, index: int) -> PromptGroup:
        return prompts.group(run, index, n_samples=4, top_p=0.95, top_logprobs=top)

    first = make("run-a", 3)
    assert content(first) == content(make("run-a", 3))
    assert first.task == "math_word" and first.group_id == "g0000003" and first.sampling.max_new_tokens == 8
    row = prompts.rows[int(first.metadata["row"])]
    assert first.answer == row.answer
    assert first.prompt == f"<bos>Answer with a number.\nQ: {row.prompt}\nA: "
    assert prompts.renderer.tokenizer.decode(first.prompt_token_ids, skip_special_tokens=False) == first.prompt
    assert first.prompt_token_ids[0] == char_model.BOS
    # Each pass over the rows takes every row once, in an order of the run's own.
    order = [int(make("run-a", i).metadata["row"]) for i in range(200)]
    assert sorted(order) == list(range(200))
    assert [int(make("run-a", 200 + i).metadata["row"]) for i in range(20)] != order[:20]
    assert [int(make("run-b", i).metadata["row"]) for i in range(20)] != order[:20]
    # The reference answer, written by the model, is what the verifier scores right.
    assert asyncio.run(verifier("number").verify(completion(first, first.answer), first, None)).value == 1.0


def test_a_file_task_needs_a_model_directory_and_every_row_must_fit_it(math_model_dir, tmp_path):
    with pytest.raises(TaskError, match="no model directory was given"):
        TaskPrompts(resolve_task("math_word"))
    config = json.loads((math_model_dir / "config.json").read_text())
    (math_model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 64}))
    with pytest.raises(TaskError, match="exceed the model's 64 positions"):
        TaskPrompts(resolve_task("math_word"), model_dir=math_model_dir)


def test_the_addition_demo_without_a_model_is_unchanged():
    from workers.up.demo_task import VOCAB_SIZE, prompt_group

    prompts = TaskPrompts(resolve_task("addition"), digits=3)
    assert prompts.top_logprobs() == VOCAB_SIZE
    made = prompts.group("run-a", 5, n_samples=2, top_p=0.9, top_logprobs=VOCAB_SIZE)
    demo = prompt_group("run-a", 5, TaskSettings(digits=3), n_samples=2, top_p=0.9, top_logprobs=VOCAB_SIZE)
    assert content(made) == content(demo)


def test_the_addition_demo_on_another_model_keeps_its_raw_format_in_that_models_tokens(tmp_path):
    directory = tokenizer_dir(tmp_path / "m", chat_template=CHATML)
    prompts = TaskPrompts(resolve_task("addition"), digits=2, model_dir=directory)
    made = prompts.group("run-a", 5, n_samples=2, top_p=0.9, top_logprobs=prompts.top_logprobs())
    a, b = made.prompt.removesuffix("=").split("+")
    assert made.task == "arith" and made.answer == str(int(a) + int(b)) and made.prompt.endswith("=")
    assert prompts.renderer.tokenizer.decode(made.prompt_token_ids) == made.prompt  # no chat template: raw
    assert made.metadata["answer_format"] == r"\d+" and made.sampling.max_new_tokens == 4


async def test_sprawl_prompts_publishes_the_math_task_from_its_model_directory(settings, event_log, math_model_dir):
    from pipeline.replay import replay
    from tests.test_prompts_driver import prompts_settings, until_prompts
    from workers.prompts.driver import publish_ahead
    from workers.prompts.settings import PromptsSettings

    base = prompts_settings(settings)
    prompts = PromptsSettings.model_validate(
        base.model_dump() | {"task": {"name": "math_word"}, "model_dir": math_model_dir}
    )
    stop = asyncio.Event()
    driver = asyncio.create_task(publish_ahead(event_log, prompts, stop))
    try:
        await until_prompts(event_log, settings.run_id, prompts.prompts.groups_ahead)
    finally:
        stop.set()
        await driver
    groups = [item.event async for item in replay(event_log, "PROMPTS", f"rl.{settings.run_id}.prompts")]
    assert [g.task for g in groups] == ["math_word"] * prompts.prompts.groups_ahead
    assert all(g.prompt.startswith("<bos>Answer with a number.\nQ: ") and g.answer for g in groups)


# ---------------------------------------------------------------- the warm-up without --model


async def test_a_file_task_warms_up_a_character_model_in_a_child_and_caches_it(tmp_path):
    from workers.up.warmup import warm_up

    spec = BUILTIN_TASKS["math_word"].model_copy(update={"warmup_steps": 2, "warmup_batch": 2})
    steps: list[tuple[int, int]] = []
    model_dir = await warm_up(
        tmp_path,
        TaskSettings(),
        threads=1,
        env=dict(os.environ),
        on_step=lambda s, n, _: steps.append((s, n)),
        spec=spec,
    )
    assert steps == [(1, 2), (2, 2)]
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == char_model.CHAT_TEMPLATE
    assert (model_dir / "model.safetensors").exists() and check_model_dir(model_dir) == model_dir
    # Cached: no child the second time; another source (or warm-up) is another model.
    assert await warm_up(tmp_path, TaskSettings(), threads=1, env=dict(os.environ), spec=spec) == model_dir
    other = spec.model_copy(update={"warmup_steps": 3})
    assert char_model.model_cache_dir(tmp_path, other, 0) != model_dir
    # The base policy renders the task's prompts through its own chat template.
    prompts = TaskPrompts(resolve_task("math_word"), model_dir=model_dir)
    assert prompts.group("r", 0, n_samples=1, top_p=1.0, top_logprobs=prompts.top_logprobs()).prompt.startswith("<bos>")


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_up_quick_runs_the_math_task_then_a_model_directory(tmp_path):
    from infra import stack
    from tests.servers import stack_settings

    settings = stack_settings(tmp_path / "state")
    short = {"SPRAWL_TASKS": json.dumps({"math_word": {"warmup_steps": 30}})}
    try:
        summary = _run_up_with(settings, short, "--quick", "--versions", "2", "--fresh", "--task.name", "math_word")
        assert summary["task"] == "math_word" and summary["versions"] == 2 and summary["rewards"] > 0
        assert summary["dead_letters"] == 0 and summary["interrupted"] is False
        assert json.loads((Path(summary["model"]) / "tokenizer_config.json").read_text())["chat_template"]
        # A checkpoint of another family, tokenizer and template: a dense Qwen3, byte-level BPE, ChatML.
        model = chatml_checkpoint(tmp_path / "chatml-model")
        again = _run_up_with(
            settings, {}, "--versions", "2", "--fresh", "--task.name", "math_word", "--model", str(model)
        )
        assert again["task"] == "math_word" and again["model"] == str(model) and again["versions"] == 2
        assert again["rewards"] > 0 and again["dead_letters"] == 0
    finally:
        stack.down(settings)


def _run_up_with(settings, env: dict[str, str], *args: str) -> dict:
    """`sprawl up` as `tests/test_up.py` runs it, with the task's variables."""
    import subprocess

    from tests.test_up import _env, _leftovers

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.cli",
            "up",
            "--json",
            "--no-live",
            *args,
            "--state-dir",
            str(settings.state_dir),
        ],
        env=_env(settings) | env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert _leftovers(settings.state_dir) == []
    return json.loads(result.stdout.strip().splitlines()[-1])
