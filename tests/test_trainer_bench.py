"""`sprawl bench trainer`: its two-rank figures exist, and its forked workers fail loudly.

No timing thresholds: the figures are measured on whatever machine runs the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from workers.bench.forked_ranks import BenchWorkerFailed, answer, receive_all, start_workers, stop_workers
from workers.bench.rank_publish_bench import next_weights

TWO_RANK_KEYS = (
    "publish_speedup_2_ranks",
    "publish_s_1_rank",
    "publish_s_2_ranks",
    "publish_cpu_s_1_rank",
    "publish_cpu_s_2_ranks",
    "publish_fraction_2_ranks",
    "step_s_2_ranks",
    "update_s_2_ranks",
    "capture_s_2_ranks",
)


@pytest.mark.slow
@pytest.mark.integration
def test_bench_trainer_quick_reports_the_two_rank_figures():
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "bench", "trainer", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("publish_fraction", *TWO_RANK_KEYS):
        value = summary[key]
        assert isinstance(value, float) and value > 0, (key, value)
    assert summary["publish_fraction_2_ranks"] < 1
    profile = summary["publish_profile_2_ranks"]
    assert profile["units"] >= 2 and sum(profile["unit_share"]) == pytest.approx(1, abs=1e-3)
    # Both ranks published their part of every patch; rank 0 gathered the parts and appended.
    patch = profile["2_ranks"]["patch"]
    assert patch["rank0_uploads"] > 0 and patch["rank1_uploads"] > 0 and patch["rank0_append_s"] > 0
    assert 0 < patch["changed_bf16"] < 1
    assert "publish a version, 1 process (non-quick demo model)" in result.stdout


def test_a_rank_holding_some_tensors_steps_them_to_the_single_process_bits():
    gen = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(64, 32, generator=gen) for i in range(4)}
    whole = next_weights(next_weights(weights, 1, 1e-5), 2, 1e-5)
    part = next_weights(next_weights({"w1": weights["w1"], "w3": weights["w3"]}, 1, 1e-5), 2, 1e-5)
    assert torch.equal(part["w1"], whole["w1"]) and torch.equal(part["w3"], whole["w3"])
    assert not torch.equal(whole["w1"], weights["w1"])
    assert not torch.equal(next_weights(weights, 1, 1e-5)["w0"], next_weights(weights, 2, 1e-5)["w0"])


def _raises(conn) -> None:
    raise ValueError("a bug in the worker")


def _exits(conn) -> None:
    os._exit(3)


def _silent(conn) -> None:
    conn.recv()  # waits for a message that never comes


def _echoes(conn) -> None:
    answer(conn, conn.recv() * 2)


def test_a_failed_worker_raises_with_its_traceback():
    workers = start_workers({"broken": _raises})
    try:
        with pytest.raises(BenchWorkerFailed, match="ValueError: a bug in the worker"):
            workers[0].receive()
    finally:
        stop_workers(workers)
    assert workers[0].process.exitcode == 1


def test_a_worker_that_dies_without_answering_is_named_with_its_exit_code():
    workers = start_workers({"dying": _exits})
    try:
        with pytest.raises(BenchWorkerFailed, match="dying exited with code 3"):
            workers[0].receive()
    finally:
        stop_workers(workers)


def test_a_worker_that_never_answers_times_out_and_is_ended():
    workers = start_workers({"silent": _silent, "echo": _echoes})
    try:
        workers[1].send(21)
        assert workers[1].receive() == 42
        with pytest.raises(BenchWorkerFailed, match="silent did not answer"):
            workers[0].receive(timeout_s=0.5)
    finally:
        stop_workers(workers, timeout_s=1)
    assert not workers[0].process.is_alive()


def test_a_group_fails_on_its_dead_worker_while_the_other_still_waits():
    """A rank stuck in a collective for a dead peer never answers: the group fails on the dead one at once,
    not after the silent one's timeout."""
    workers = start_workers({"stuck": _silent, "dying": _exits})
    try:
        with pytest.raises(BenchWorkerFailed, match="dying exited with code 3"):
            receive_all(workers, timeout_s=600)
    finally:
        stop_workers(workers, timeout_s=1)
    assert not any(w.process.is_alive() for w in workers)
