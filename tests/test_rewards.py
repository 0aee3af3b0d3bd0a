"""The reward worker on a real stack: exact answers, hidden-test code in bubblewrap, format errors, idempotency."""

import asyncio
import time

import pytest

from pipeline.replay import replay
from pipeline.sandbox import SandboxSettings, open_sandbox
from schemas import IslandIdentity, PromptGroup, Reward, Trajectory, VersionSpan
from workers.rewards.worker import RewardSettings, RewardWorker

pytestmark = pytest.mark.integration

ISLAND = IslandIdentity(island_id="i", accelerator="cpu", view="bf16", engine="torch")
TESTS = "def test_adds():\n    assert add(2, 3) == 5\n"
FORK_BOMB = "```python\nimport os\nwhile True:\n    os.fork()\ndef add(a, b): return a + b\n```"


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


async def test_rewards_for_exact_and_code_tasks(event_log, settings):
    run = settings.run_id
    await event_log.append(
        PromptGroup(
            run_id=run,
            group_id="arith",
            task="arith",
            prompt="2+3=",
            prompt_token_ids=[1],
            n_samples=3,
            answer="5",
            metadata={"answer_format": r"-?\d+"},
        )
    )
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
        sandbox=SandboxSettings(pool_size=2, wall_timeout_s=5, cpu_seconds=2),
    )
    worker = RewardWorker(worker_settings, event_log, open_sandbox(worker_settings.sandbox))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + 60
    rewards: dict[str, Reward] = {}
    while len(rewards) < 5:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.2)
        rewards = {r.event.trajectory_id: r.event async for r in replay(event_log, "REWARDS", f"rl.{run}.reward.>")}
    stop.set()
    await asyncio.wait_for(task, 30)
    assert [rewards[f"arith-{i}"].value for i in range(3)] == [1.0, 0.0, 0.0]
    assert rewards["arith-2"].format_error and not rewards["arith-1"].format_error
    assert rewards["code-0"].value == 1.0 and rewards["code-0"].sandbox_id.startswith("bwrap-")
    assert rewards["code-1"].value == 0.0 and rewards["code-1"].error_class == "process_limit"
    all_rewards = [r.event async for r in replay(event_log, "REWARDS", f"rl.{run}.reward.>")]
    assert len(all_rewards) == 5, "one reward per trajectory id, however often it was delivered"
