"""The demo task: its tokenizer round-trips, and the warm-up is cached and teaches the model something."""

import random

import pytest
from pydantic import ValidationError

from workers.up.demo_task import BOS, build_tokenizer, pass_rate, problem, warmed_up_model
from workers.up.options import TaskSettings


def test_tokenizer_is_built_from_the_alphabet_and_round_trips():
    tokenizer = build_tokenizer()
    prompt, answer = problem(random.Random(0), 3)
    ids = tokenizer.encode(prompt + answer).ids
    assert all(i > BOS for i in ids) and tokenizer.decode(ids) == prompt + answer
    assert tokenizer.get_vocab_size() == 16


def test_warmup_is_cached_and_beats_an_untrained_model(tmp_path):
    cfg = TaskSettings(digits=1, warmup_steps=60, warmup_batch=32)
    first = warmed_up_model(tmp_path, cfg)
    assert (first / "tokenizer.json").exists()
    stamp = (first / "config.json").stat().st_mtime_ns
    assert warmed_up_model(tmp_path, cfg) == first and (first / "config.json").stat().st_mtime_ns == stamp

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(first)
    assert pass_rate(model, build_tokenizer(), cfg, n=48) > 0.2  # random guessing is about 1 in 20


def test_task_settings_have_bounds():
    for bad in ({"digits": 0}, {"digits": 20}, {"warmup_batch": 0}, {"warmup_lr": 0}, {"warmup_steps": -1}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            TaskSettings(**bad)
