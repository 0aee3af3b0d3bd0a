"""The reward worker on a real stack: exact answers, hidden-test code in bubblewrap, format errors,
idempotency; and bubblewrap required only where a routed verifier runs code."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pipeline.replay import replay, tail
from pipeline.sandbox import SandboxSettings
from schemas import IslandIdentity, PromptGroup, Reward, Trajectory, VersionSpan, encode_event
from tests.consuming import dead_letters
from tests.servers import connection_env
from workers.rewards.verifiers.hidden_tests import HiddenCase, hidden_tests_json
from workers.rewards.worker import RewardSettings, RewardWorker, open_verifier_sandbox

pytestmark = pytest.mark.integration

HANG_GUARD_S = 300.0
"""Upper bound on waiting for an event that must come; only reached if something is broken."""

ISLAND = IslandIdentity(island_id="i", accelerator="cpu", view="bf16", engine="torch")
TESTS = hidden_tests_json("add", [HiddenCase(args=[2, 3], expected=5)])
ARITH = {"task": "arith", "prompt": "2+3=", "n_samples": 3, "answer": "5", "metadata": {"answer_format": r"-?\d+"}}


def _traj(run_id, tid, group, task, text) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        trajectory_id=tid,
        group_id=group,
        sample_index=int(tid[-1]),
        task=task,
        prompt_token_ids=[1],
        output_token_ids=[2],
        logprobs=[-1.0],
        finish_reason="stop",
        version_spans=[VersionSpan(version=0, start=0, end=1)],
        island=ISLAND,
        text=text,
    )


async def _rewards(event_log, run: str, count: int) -> dict[str, Reward]:
    """Follow the run's rewards until `count` trajectory ids have one."""
    rewards: dict[str, Reward] = {}
    stop = asyncio.Event()
    async with asyncio.timeout(HANG_GUARD_S):
        async for item in tail(event_log, "REWARDS", f"rl.{run}.reward.>", 1, stop):
            rewards[item.event.trajectory_id] = item.event
            if len(rewards) >= count:
                stop.set()
                break
    return rewards


async def _all_handled(event_log, run: str) -> None:
    """Until the worker's consumer has nothing pending or unacknowledged: every delivery handled."""
    async with asyncio.timeout(HANG_GUARD_S):
        while True:
            info = await event_log.js.consumer_info("TRAJECTORIES", f"{run}-rewards")
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
            await asyncio.sleep(0.1)


async def test_rewards_for_exact_and_code_tasks(event_log, settings):
    run = settings.run_id
    await event_log.append(PromptGroup(run_id=run, group_id="arith", prompt_token_ids=[1], **ARITH))
    await event_log.append(
        PromptGroup(
            run_id=run,
            group_id="code",
            task="code",
            prompt="add",
            prompt_token_ids=[1],
            n_samples=2,
            metadata={"tests": TESTS},
        )
    )
    trajectories = [
        _traj(run, "arith-0", "arith", "arith", "thinking\n5"),
        _traj(run, "arith-1", "arith", "arith", "6"),
        _traj(run, "arith-2", "arith", "arith", "five"),
        _traj(run, "code-0", "code", "code", "```python\ndef add(a, b):\n    return a + b\n```"),
        _traj(
            run,
            "code-1",
            "code",
            "code",
            "```python\nimport os\nwhile True:\n    os.fork()\ndef add(a, b): return a + b\n```",
        ),
    ]
    for t in trajectories:
        await event_log.append(t)
    await event_log.append(trajectories[0], subject=f"rl.{run}.traj.arith-again")  # a redelivered duplicate
    worker_settings = RewardSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log"}),
        routes={"arith": "exact", "code": "code_tests"},
        # The wall timeout is a hang guard: the fork bomb must end on its process limit, however loaded.
        sandbox=SandboxSettings(pool_size=2, wall_timeout_s=120, cpu_seconds=2),
    )
    worker = RewardWorker(worker_settings, event_log, open_verifier_sandbox(worker_settings))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        rewards = await _rewards(event_log, run, 5)
        await _all_handled(event_log, run)
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD_S)
    assert [rewards[f"arith-{i}"].value for i in range(3)] == [1.0, 0.0, 0.0]
    assert rewards["arith-2"].format_error and not rewards["arith-1"].format_error
    assert rewards["code-0"].value == 1.0 and rewards["code-0"].sandbox_id.startswith("bwrap-")
    assert rewards["code-1"].value == 0.0 and rewards["code-1"].error_class == "process_limit"
    all_rewards = [r.event async for r in replay(event_log, "REWARDS", f"rl.{run}.reward.>")]
    assert len(all_rewards) == 5, "one reward per trajectory id, however often it was delivered"


def _worker_env(settings, tmp_path, **extra: str) -> dict[str, str]:
    """The environment of a `sprawl rewards` process on a machine without bubblewrap: PATH has no bwrap."""
    no_bwrap = tmp_path / "bin"
    no_bwrap.mkdir(exist_ok=True)
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")},
        "PATH": str(no_bwrap),
        "SPRAWL_RUN_ID": settings.run_id,
        "SPRAWL_STATE_DIR": str(tmp_path / "state"),
        **connection_env(settings, "rewards"),
        "SPRAWL_LOG_FORMAT": "json",
        **extra,
    }


async def test_exact_answers_need_no_bubblewrap(event_log, settings, tmp_path):
    """The demo's verifier never runs code: the worker starts and rewards on a machine without bwrap."""
    run = settings.run_id
    await event_log.append(PromptGroup(run_id=run, group_id="arith", prompt_token_ids=[1], **ARITH))
    await event_log.append(_traj(run, "arith-0", "arith", "arith", "5"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "rewards"],
        env=_worker_env(settings, tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rewards = await _rewards(event_log, run, 1)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(worker.communicate, timeout=HANG_GUARD_S)
    assert rewards["arith-0"].value == 1.0 and rewards["arith-0"].verifier == "exact"
    assert worker.returncode == 0, stderr[-2000:]


def test_code_tests_without_bubblewrap_fail_at_start_in_one_line(tmp_path):
    """A routed verifier that runs code needs bubblewrap: without it the worker exits at once (before
    connecting anywhere, so no server is needed), naming the Debian package."""
    env = _worker_env(
        RewardSettings(run_id="nobwrap", nats={"url": "nats://127.0.0.1:1"}),
        tmp_path,
        SPRAWL_ROUTES='{"arith": "exact", "code": "code_tests"}',
    )
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "rewards"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "'code' -> code_tests" in lines[0] and "apt-get install bubblewrap" in lines[0]


def test_the_sandbox_is_opened_only_for_verifiers_that_run_code():
    assert open_verifier_sandbox(RewardSettings(routes={"arith": "exact", "format": "format"})) is None
    opened = open_verifier_sandbox(RewardSettings(routes={"code": "code_tests"}))
    assert opened is not None and type(opened).__name__ == "BwrapSandboxPool"
    with pytest.raises(ValidationError, match="unknown verifier 'regex'"):
        open_verifier_sandbox(RewardSettings(routes={"arith": "regex"}))


async def test_a_trajectory_of_a_group_the_log_does_not_hold_is_dead_lettered_on_its_first_delivery(
    event_log, settings
):
    """Before: 'prompt group not seen yet' was retried 8 times over 22 minutes, then dead-lettered.
    Once the projection has read every prompt the log holds, a missing group is poison."""
    run = settings.run_id
    await event_log.append(PromptGroup(run_id=run, group_id="arith", prompt_token_ids=[1], **ARITH))
    await event_log.append(_traj(run, "ghost-0", "ghost", "arith", "5"))
    await event_log.append(_traj(run, "arith-0", "arith", "arith", "5"))
    worker_settings = RewardSettings(**settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}))
    worker = RewardWorker(worker_settings, event_log, None)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        rewards = await _rewards(event_log, run, 1)
        await _all_handled(event_log, run)
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD_S)
    assert set(rewards) == {"arith-0"}
    (letter,) = await dead_letters(event_log, run)
    assert letter.error_class == "unknown_group" and "ghost" in letter.reason
    assert letter.num_delivered == 1
    assert letter.original_subject == f"rl.{run}.traj.ghost.ghost-0"


async def test_a_trajectory_that_already_has_a_reward_is_not_verified_again(event_log, settings):
    run = settings.run_id
    await event_log.append(PromptGroup(run_id=run, group_id="arith", prompt_token_ids=[1], **ARITH))
    first = _traj(run, "arith-0", "arith", "arith", "5")
    await event_log.append(first)
    worker_settings = RewardSettings(**settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}))
    worker = RewardWorker(worker_settings, event_log, None)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await _rewards(event_log, run, 1)
        await _all_handled(event_log, run)
        # The same trajectory id produced again under another message id (so neither the dedup window nor
        # the one-message subject stops it once the first is gone): a new delivery, which must become
        # neither a second verification nor a second reward.
        subject = f"rl.{run}.traj.arith.arith-0"
        await event_log.js.delete_msg("TRAJECTORIES", (await event_log.js.get_last_msg("TRAJECTORIES", subject)).seq)
        again = encode_event(_traj(run, "arith-0", "arith", "arith", "6"))
        await event_log.js.publish(subject, again, headers={"Nats-Msg-Id": f"{run}:republished"})
        await _all_handled(event_log, run)
    finally:
        stop.set()
        await asyncio.wait_for(task, HANG_GUARD_S)
    all_rewards = [r.event async for r in replay(event_log, "REWARDS", f"rl.{run}.reward.>")]
    assert [(r.trajectory_id, r.value) for r in all_rewards] == [("arith-0", 1.0)]
    assert worker.verified == 1 and worker.already_rewarded == 1
