"""`sprawl up` end to end, as a user runs it: its own stack on free ports, the whole fleet as
processes, a real run, then the log, the islands' caches, the archive and the report checked.

A real `sprawl up` warms up its base policy (550 supervised steps) and starts five processes, which
takes minutes on a small machine: those runs are `slow`. The default suite runs the same pieces in
one process against the session's stack for three versions: the workers' settings written and read
back as their files, the trainer, a bf16 and an fp8 island, the reward worker, the prompt driver,
then the archive and the report.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import stack
from pipeline.eventlog import EventLog
from pipeline.materialize import verify_directory
from pipeline.version_log import fetch_version
from pipeline.version_signing import island_trust
from tests.servers import connection_env, new_run_id, stack_settings


def _env(settings) -> dict[str, str]:
    section = settings.stack
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")},
        "SPRAWL_STACK__NATS_PORT": str(section.nats_port),
        "SPRAWL_STACK__NATS_MONITOR_PORT": str(section.nats_monitor_port),
        "SPRAWL_STACK__S3_PORT": str(section.s3_port),
        "SPRAWL_STACK__SEAWEED_PORT_BASE": str(section.seaweed_port_base),
        **connection_env(settings, "admin"),
    }


@pytest.fixture
def up_stack(tmp_path):
    """Ports for the stack `sprawl up` starts itself; stopped afterwards (the run leaves it up for SQL)."""
    settings = stack_settings(tmp_path / "state")
    try:
        yield settings
    finally:
        stack.down(settings)


def _sprawl(settings, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args, "--state-dir", str(settings.state_dir)],
        env=_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _commands_with(text: str) -> dict[int, str]:
    """pid -> command line of every process whose command line contains `text`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found[int(entry.name)] = cmdline
    return found


def _leftovers(state_dir: Path) -> list[str]:
    """Workers started for this state folder: each runs on a settings file inside it."""
    return sorted(_commands_with(f"--config {state_dir.resolve()}/").values())


def _run_up(settings, *args: str, timeout: float) -> dict:
    result = _sprawl(settings, "up", "--json", "--no-live", *args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert _leftovers(settings.state_dir) == []
    return summary


async def _check_islands_materialized(settings, run_id: str, state_dir: Path | None = None) -> None:
    """Every island's newest cached version hashes, file by file, to what the log says."""
    islands = (state_dir or settings.state_dir).resolve() / "islands"
    # `up` made the stack secure: connect as its admin (TLS pinned to its CA), not with the bare settings.
    admin = stack.with_role(settings.model_copy(update={"run_id": run_id}), "admin")
    event_log = await EventLog.connect(admin, worker="test")
    try:
        assert len(list(islands.iterdir())) == 2
        for island in sorted(islands.iterdir()):
            view = "fp8_e4m3" if island.name.endswith("fp8") else "bf16"
            cached = sorted((island / run_id / view).glob("v*/sprawl-version.json"))
            assert cached, f"{island.name} materialized nothing"
            newest = cached[-1].parent
            event = await fetch_version(event_log, run_id, int(newest.name[1:]))
            expected = {v.view: v.root_hash for v in event.views}[view]
            assert verify_directory(newest) == expected, f"{island.name} {newest.name}"
    finally:
        await event_log.close()


def _check_common(summary: dict, versions: int) -> None:
    assert summary["versions"] == versions and summary["versions_this_run"] == versions
    assert {i["view"] for i in summary["islands"]} == {"bf16", "fp8_e4m3"}
    assert all(i["trajectories"] > 0 for i in summary["islands"])
    assert summary["trained_views"] == ["bf16", "fp8_e4m3"]  # both precisions' samples were trained on
    assert summary["rewards"] > 0
    assert 0 < summary["patch_bytes"] < summary["keyframe_bytes"]
    assert summary["dead_letters"] == 0 and summary["interrupted"] is False
    for key in ("run_id", "reward_first", "reward_last", "reward_ci", "wall_s"):
        assert key in summary


@pytest.mark.slow
def test_up_smoke_runs_the_whole_loop_and_leaves_no_worker(up_stack):
    summary = _run_up(up_stack, "--versions", "3", "--fresh", timeout=400)
    _check_common(summary, 3)
    asyncio.run(_check_islands_materialized(up_stack, summary["run_id"]))
    assert Path(summary["report"]).read_text().startswith("<!doctype html>")


@pytest.mark.slow
def test_up_quick_end_to_end_then_continue_and_query(up_stack):
    summary = _run_up(up_stack, "--quick", "--fresh", timeout=900)
    _check_common(summary, 30)
    run_id = summary["run_id"]
    asyncio.run(_check_islands_materialized(up_stack, run_id))
    report = Path(summary["report"]).read_text()
    assert report.startswith("<!doctype html>") and "<img" in report

    # The archive answers a canned audit, and `sprawl sql` defaults to the run `up` ran.
    audit = _sprawl(up_stack, "audit", "staleness", "--json", timeout=120)
    assert audit.returncode == 0, audit.stderr
    assert len(json.loads(audit.stdout)) == 30  # one metrics row per update
    counts = _sprawl(
        up_stack, "sql", "--json", "SELECT island.view AS view, count(*) AS n FROM trajectories GROUP BY 1", timeout=120
    )
    assert counts.returncode == 0, counts.stderr
    assert {row["view"] for row in json.loads(counts.stdout)} == {"bf16", "fp8_e4m3"}

    # A second `up` continues the same run from the log: the trainer restores and goes on.
    again = _run_up(up_stack, "--versions", "4", timeout=600)
    assert again["run_id"] == run_id and again["versions"] == 34 and again["versions_this_run"] == 4


def _run_up_meanwhile(settings, versions: int, meanwhile) -> tuple[int, dict, str]:
    """`sprawl up` in the background; `meanwhile(process)` acts on it; then (exit code, summary, stderr)."""
    options = ["--json", "--no-live", "--versions", str(versions), "--fresh", "--state-dir", str(settings.state_dir)]
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "up", *options],
        env=_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        meanwhile(process)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    assert stdout.strip(), stderr[-4000:]
    return process.returncode, json.loads(stdout.strip().splitlines()[-1]), stderr


def _wait_for(condition, process, what: str) -> None:
    """Until `condition()` holds; the run ending first fails the test (it always ends: it has a target)."""
    while not condition():
        assert process.poll() is None, what
        time.sleep(0.2)


@pytest.mark.slow
def test_up_restarts_a_killed_sampler_and_the_run_still_finishes(up_stack):
    def kill_the_fp8_sampler(process):
        config = f"{up_stack.state_dir.resolve()}/runs/"
        find = lambda: [p for p, c in _commands_with(config).items() if "sampler-island1-fp8.toml" in c]  # noqa: E731
        _wait_for(find, process, "the fp8 sampler never started")
        served = lambda: list(up_stack.state_dir.glob("islands/island1-fp8/*/*/v*/sprawl-version.json"))  # noqa: E731
        _wait_for(served, process, "the fp8 sampler never served a version")  # it takes part first
        os.kill(find()[0], signal.SIGKILL)

    code, summary, stderr = _run_up_meanwhile(up_stack, 12, kill_the_fp8_sampler)
    assert code == 0, stderr[-4000:]
    assert summary["versions"] == 12
    assert summary["restarts"]["sampler-island1-fp8"] >= 1
    assert "sampler-island1-fp8 exited -9" in stderr  # the restart is visible, not silent
    assert _leftovers(up_stack.state_dir) == []


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_and_the_stack_it_started(up_stack):
    def press_ctrl_c_once_training(process):
        training = lambda: list(up_stack.state_dir.glob("islands/*/*/*/v00000002"))  # noqa: E731
        _wait_for(training, process, "the run never got to v2")
        process.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground process

    code, summary, stderr = _run_up_meanwhile(up_stack, 1000, press_ctrl_c_once_training)
    assert code == 130, stderr[-4000:]
    assert summary["interrupted"] is True and 0 < summary["versions"] < 1000
    assert _leftovers(up_stack.state_dir) == []
    assert stack.status(up_stack) is None  # `up` started the stack, so Ctrl-C stopped it too


# ---------------------------------------------------------------- the same pieces, in one process


@pytest.fixture
def no_sprawl_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SPRAWL_"):
            monkeypatch.delenv(name)


@pytest.mark.integration
async def test_up_in_process_trains_a_mixed_fleet_for_a_few_versions(event_log, settings, tmp_path, no_sprawl_env):
    from infra.streams import apply
    from pipeline.blobstore import S3BlobStore
    from pipeline.config import load_settings
    from pipeline.log_lookup import count_subjects
    from pipeline.replay import replay
    from pipeline.topology import DEADLETTER
    from schemas import TrainerMetrics
    from tests.servers import HANG_GUARD_S
    from workers.rewards.worker import RewardWorker
    from workers.sampler.island import build_island
    from workers.sampler.worker import SamplerWorker
    from workers.trainer.loop import Trainer
    from workers.up.demo_task import warmed_up_model
    from workers.up.options import UpOptions, UpSettings, run_settings
    from workers.up.orchestrate import _archive_and_report, _Output, worker_plans, worker_specs
    from workers.up.prompt_driver import PromptDriver

    versions = 3
    options = UpOptions(views="bf16,fp8", versions=versions)
    # The session's servers, a run of its own, and the streams `up` declares (not the tests' short timers:
    # an island on a busy CPU may hold a prompt group longer than they allow).
    up = run_settings(
        options,
        UpSettings(
            **settings.model_dump(include={"nats", "blobs", "log"}),
            run_id=new_run_id(),
            state_dir=tmp_path / "state",
            trainer={"groups_per_batch": 2, "group_size": 4},
            task={"digits": 1, "warmup_steps": 30, "warmup_batch": 16},
            prompts={"groups_ahead": 2},
        ),
    )
    await apply(event_log.js, up.streams, up.run_id)
    model_dir = await asyncio.to_thread(warmed_up_model, up.state_dir, up.task)
    run_dir = up.state_dir.resolve() / "runs" / up.run_id
    plans = worker_plans(up, options, model_dir=model_dir, max_version=versions)
    specs = worker_specs(plans, run_dir / "config")
    # Each worker's settings as the worker reads them at start: from its file.
    loaded = {
        plan.name: load_settings(type(plan.settings), spec.argv[-1]) for plan, spec in zip(plans, specs, strict=True)
    }
    assert loaded == {plan.name: plan.settings for plan in plans}

    blobs = S3BlobStore(settings.blobs)
    needed = versions * up.trainer.groups_per_batch  # as `up` sizes it: what the updates need, and a window more
    await PromptDriver(event_log, up.run_id, up, 0).top_up(needed, stop_after=needed + up.prompts.groups_ahead)
    stop = asyncio.Event()
    trainer = asyncio.create_task(Trainer(loaded["trainer"], event_log, blobs).run(stop))
    fleet = [
        asyncio.create_task(
            SamplerWorker(
                s, event_log, build_island(event_log, s.blobs, s.run_id, s.island, island_trust(s.trust))
            ).run(stop)
        )
        for name, s in loaded.items()
        if name.startswith("sampler-")
    ]
    fleet.append(asyncio.create_task(RewardWorker(loaded["rewards"], event_log, None).run(stop)))
    try:
        # The trainer returns once it has published the last version; a worker that fails ends the wait first.
        # A prompt group dead-lettered by the islands starves the trainer (nothing tops the prompts up
        # here): the guard turns that into a failure that says so, instead of a silent wait.
        done, _ = await asyncio.wait([trainer, *fleet], timeout=HANG_GUARD_S, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
        dead = await count_subjects(event_log, DEADLETTER.name, f"rl.{up.run_id}.deadletter.>")
        assert trainer in done, f"the trainer never finished; {dead} events of the run were dead-lettered"
    finally:
        stop.set()
        await asyncio.gather(trainer, *fleet, return_exceptions=True)

    for version in range(1, versions + 1):
        event = await fetch_version(event_log, up.run_id, version)
        assert event is not None and event.consumed_trajectories == up.trainer.groups_per_batch * 4
        assert {v.view for v in event.views} == {"bf16", "fp8_e4m3"}
    metrics = [r.event async for r in replay(event_log, "METRICS", f"rl.{up.run_id}.metrics.>")]
    assert [m.version for m in metrics if isinstance(m, TrainerMetrics)] == list(range(1, versions + 1))
    # Which island takes which prompt group is up to scheduling (the slow tests check both precisions
    # are trained on over a longer run); what was trained on came from the islands.
    trained_views = {g for m in metrics if isinstance(m, TrainerMetrics) for g in m.per_group}
    assert trained_views and trained_views <= {"bf16", "fp8_e4m3"}
    await _check_islands_materialized(settings, up.run_id, up.state_dir)
    report = await _archive_and_report(up, loaded["archiver"], run_dir, _Output(json_output=True))
    assert report is not None and Path(report).read_text().startswith("<!doctype html>")


# ---------------------------------------------------------------- stopping during the warm-up


def _up_in_warm_up(settings) -> subprocess.Popen:
    """`sprawl up` with a warm-up far too long to finish; returns once its warm-up child runs."""
    env = _env(settings) | {"SPRAWL_TASK__WARMUP_STEPS": "1000000", "SPRAWL_TASK__DIGITS": "1"}
    options = ["--json", "--no-live", "--fresh", "--state-dir", str(settings.state_dir)]
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "up", *options],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(lambda: _commands_with(f"workers.up.warmup {settings.state_dir}"), process, "no warm-up started")
    except BaseException:
        process.kill()
        process.communicate()
        raise
    return process


@pytest.mark.integration
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)]
)
def test_a_signal_during_the_warm_up_stops_everything_cleanly(up_stack, sig, code):
    from tests.servers import HANG_GUARD_S

    process = _up_in_warm_up(up_stack)
    try:
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=HANG_GUARD_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, stderr[-4000:]
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-4000:]
    assert f"stopped by {sig.name} during warm-up: every worker stopped, the stack stopped" in stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["stopped_by"] == sig.name and summary["phase"] == "warm-up"
    assert _commands_with(f"workers.up.warmup {up_stack.state_dir}") == {}
    assert stack.status(up_stack) is None and stack.dead_servers(up_stack) == []  # `up` started it, so stopped it


# ---------------------------------------------------------------- the monitor across a nats-server restart


@pytest.mark.integration
async def test_the_monitor_counts_on_from_where_it_was_after_a_nats_restart(tmp_path):
    from pipeline.blobstore import S3BlobStore
    from pipeline.topology import PROMPTS
    from tests.servers import HANG_GUARD_S, auto_stack_settings
    from workers.up.demo_task import prompt_group
    from workers.up.monitor import RunMonitor
    from workers.up.options import TaskSettings

    settings = auto_stack_settings(tmp_path / "state", run_id=new_run_id())
    settings = stack.with_endpoints(settings, stack.up(settings))
    event_log = None
    monitor = None

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def publish(indices) -> None:
        for index in indices:
            group = prompt_group(settings.run_id, index, TaskSettings(), n_samples=2, top_p=1.0, top_logprobs=1)
            await event_log.append(group)

    try:
        from infra.streams import apply

        event_log = await EventLog.connect(settings, worker="test-monitor")
        await apply(event_log.js, settings.streams, settings.run_id)
        monitor = RunMonitor(event_log, S3BlobStore(settings.blobs), settings.run_id, probe_every_s=0.2)
        monitor.start([PROMPTS.name])
        await publish(range(5))
        await until(lambda: monitor.positions.get(PROMPTS.name) == 5, "the first five prompts were never read")
        assert monitor.state.prompts_published == 5

        nats = stack.status(settings).server("nats")
        os.kill(nats.pid, signal.SIGKILL)
        os.waitpid(nats.pid, 0)
        await until(lambda: not monitor.bus.up, "the bus outage was never seen")  # a state the live view shows
        repaired = await asyncio.to_thread(stack.up, settings)  # nats again, on its port, from its store
        assert any(a.startswith("restarted nats-server") for a in repaired.actions)
        await until(lambda: monitor.bus.up, "the bus was never seen again")
        await publish(range(5, 8))
        await until(lambda: monitor.positions.get(PROMPTS.name) == 8, "the prompts after the restart were never read")
        # Read from the start again, the first five would be counted twice on the way to the eighth.
        assert monitor.state.prompts_published == 8
    finally:
        if monitor is not None:
            await monitor.stop()
        if event_log is not None:
            await event_log.close()
        stack.down(settings)
