"""The parts of `sprawl up` that need no servers: options, the workers' settings files, run identity,
the reward comparison, the byte totals and the live view's rendering."""

import os
import stat
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from pipeline.config import load_settings
from schemas import TrainerMetrics
from workers.up.live_view import render, sparkline
from workers.up.monitor import RunState, VersionRecord
from workers.up.options import UpOptions, UpSettings, correction_of, island_views, run_settings
from workers.up.orchestrate import choose_run_id, remember_run, worker_plans, worker_specs


def test_the_correction_option_sets_the_trainers_loss_through_the_registry():
    settings = UpSettings()
    assert correction_of(settings) == "sc+mis+mask"  # the trainer's default loss
    chosen = run_settings(UpOptions(correction="tis,seq,ppo"), settings)
    assert chosen.trainer.loss.importance == "tis" and chosen.trainer.loss.importance_level == "sequence"
    assert chosen.trainer.loss.surrogate == "ppo" and not chosen.trainer.loss.score_centering
    assert correction_of(chosen) == "tis+seq+ppo"
    assert chosen.trainer.groups_per_batch == settings.trainer.groups_per_batch  # the rest is kept
    with pytest.raises(ValidationError, match="unknown correction 'magic'"):
        UpOptions(correction="sc+magic")


def test_options_accept_view_aliases_and_refuse_nonsense():
    options = UpOptions(views="bf16,fp8", islands=3)
    assert options.views == ["bf16", "fp8_e4m3"]
    assert island_views(options, UpSettings()) == ["bf16", "fp8_e4m3", "bf16"]
    assert run_settings(UpOptions(views="fp8"), UpSettings()).chain.views == ["fp8_e4m3"]
    assert island_views(UpOptions(islands=3), UpSettings(chain={"views": ["fp8_e4m3"]})) == ["fp8_e4m3"] * 3
    assert UpOptions(quick=True).target_versions < UpOptions().target_versions
    with pytest.raises(ValidationError, match="unknown view 'int4'"):
        UpOptions(views="bf16,int4")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        UpOptions(islands=0)


def test_versions_below_one_are_refused():
    # `--versions -5` used to be accepted and "trained to" a version below the head
    for bad in (-5, 0):
        with pytest.raises(ValidationError, match="versions"):
            UpOptions(versions=bad)
    assert UpOptions(versions=1).target_versions == 1


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SPRAWL_"):
            monkeypatch.delenv(name)


def test_each_worker_gets_a_private_settings_file_it_validates(clean_env, monkeypatch, tmp_path):
    settings = run_settings(
        UpOptions(views="bf16,fp8", correction="sc+tis"),
        UpSettings(run_id="r1", state_dir=tmp_path / "state", trainer={"group_size": 4}),
    )
    plans = worker_plans(settings, UpOptions(views="bf16,fp8"), model_dir=tmp_path / "model", max_version=7)
    assert [p.name for p in plans] == ["trainer", "sampler-island0-bf16", "sampler-island1-fp8", "rewards", "archiver"]
    monkeypatch.setenv("SPRAWL_ISLAND__DEVICE", "from-env")  # what `up` was started with stays out of the workers
    specs = worker_specs(plans, tmp_path / "config")
    monkeypatch.delenv("SPRAWL_ISLAND__DEVICE")
    assert stat.S_IMODE((tmp_path / "config").stat().st_mode) == 0o700
    for plan, spec in zip(plans, specs, strict=True):
        path = spec.argv[spec.argv.index("--config") + 1]
        assert spec.argv[-3:-2] == [plan.command]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds the S3 secret
        assert not any(k.startswith("SPRAWL_") for k in spec.env)
        assert load_settings(type(plan.settings), path) == plan.settings  # what the worker will validate
    trainer = plans[0].settings
    assert trainer.trainer.max_versions == 7 and trainer.trainer.model_dir == tmp_path / "model"
    assert trainer.trainer.group_size == 4 and trainer.trainer.loss.importance == "tis"
    assert trainer.chain.views == ["bf16", "fp8_e4m3"] and trainer.chain.keyframe_every == 50
    assert [p.settings.island.view for p in plans[1:3]] == ["bf16", "fp8_e4m3"]
    assert specs[2].labels == {"island": "island1-fp8", "view": "fp8_e4m3"}
    raw = tomllib.loads(Path(specs[0].argv[-1]).read_text())
    assert raw["trainer"]["loss"]["importance"] == "tis" and raw["run_id"] == "r1"


def test_no_local_islands_runs_the_cluster_side_only(clean_env, tmp_path):
    """`--no-local-islands`: islands join with tokens from elsewhere; `up` starts none of its own."""
    options = UpOptions(local_islands=False, views="bf16,fp8")
    assert island_views(options, UpSettings()) == []
    plans = worker_plans(UpSettings(state_dir=tmp_path), options, model_dir=tmp_path, max_version=1)
    assert [p.name for p in plans] == ["trainer", "rewards", "archiver"]


def test_a_typo_in_a_workers_settings_file_stops_it_at_start(clean_env, tmp_path):
    from workers.trainer.settings import TrainerSettings

    plans = worker_plans(UpSettings(state_dir=tmp_path), UpOptions(), model_dir=tmp_path, max_version=1)
    path = worker_specs(plans[:1], tmp_path / "config")[0].argv[-1]
    Path(path).write_text(Path(path).read_text().replace("checkpoint_every", "checkpoint_evry"))
    with pytest.raises(ValidationError, match="checkpoint_evry"):
        load_settings(TrainerSettings, path)


def test_a_second_up_continues_the_last_run_unless_fresh(tmp_path):
    first, continuing = choose_run_id(tmp_path, None, fresh=False)
    assert not continuing and first.startswith("run-")
    remember_run(tmp_path, first)
    assert choose_run_id(tmp_path, None, fresh=False) == (first, True)
    assert choose_run_id(tmp_path, None, fresh=True)[1] is False
    assert choose_run_id(tmp_path, "mine", fresh=False) == ("mine", False)


def _state_with(rewards_by_version: dict[int, list[list[float]]]) -> RunState:
    state = RunState("r")
    state.versions[0] = VersionRecord(0, 0, 0.0, 1000, 0, 1000, 0)
    for version, groups in rewards_by_version.items():
        ids = []
        for g, values in enumerate(groups):
            group_id = f"v{version}g{g}"
            state.rewards[group_id] = values
            ids.append(group_id)
        state.versions[version] = VersionRecord(version, version, float(version), 10, 10, 1000, 8, ids)
    return state


def test_comparison_uses_the_groups_of_the_first_and_last_fifth_of_updates():
    low, high = [[0.0, 1.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 0.0]]
    state = _state_with({v: (low if v <= 2 else high) for v in range(1, 11)})
    comparison = state.comparison()
    assert comparison is not None
    assert (comparison.groups_first, comparison.groups_last) == (4, 4)  # 2 updates x 2 groups each side
    assert comparison.first == pytest.approx(0.25) and comparison.last == pytest.approx(0.75)
    # 95% CI on the difference of two means of group means (variances 1/12 each, n = 4)
    assert comparison.ci == pytest.approx(1.96 * (2 * (1 / 12) / 4) ** 0.5)
    assert comparison.improved is True
    flat = _state_with({v: low for v in range(1, 11)})
    assert flat.comparison().improved is False


def test_bytes_totals_count_patches_against_full_checkpoints():
    state = _state_with({1: [[1.0]], 2: [[0.0]]})
    assert state.bytes_totals() == (20, 2000, 1020)


def test_sparkline_resamples_and_scales():
    assert sparkline([0.0, 1.0]) == "▁█"
    assert len(sparkline([0.5] * 500, width=40)) == 40
    assert sparkline([]) == ""


def test_the_live_view_renders_a_run():
    state = _state_with({1: [[1.0]], 2: [[0.0]]})
    state.metrics.append(
        TrainerMetrics(
            run_id="r",
            step=1,
            version=1,
            metrics={"reward_mean": 0.5, "update_s": 0.1, "staleness_mean": 0.5},
            per_group={"bf16": {"kl_k3": 1e-4}},
        )
    )
    console = Console(width=120, record=True)
    console.print(render(state, None, phase="training", target=10))
    text = console.export_text()
    for expected in ("version", "2 / 10", "staleness", "patches 20 B vs full checkpoints 2.0 KB", "reward"):
        assert expected in text


# ---------------------------------------------------------------- the stall watchdog


def test_the_watchdog_fires_after_the_stall_time_and_names_what_is_stuck(tmp_path):
    import sys

    from workers.up.monitor import ServiceHealth
    from workers.up.supervisor import Supervisor, WorkerSpec
    from workers.up.watchdog import StallWatchdog

    state = _state_with({1: [[1.0]]})
    bus, store = ServiceHealth("the bus (nats)"), ServiceHealth("the blob store (S3)")
    watchdog = StallWatchdog(stall_after_s=0.5)
    t = 1000.0
    assert watchdog.check(state, None, bus, store, now=t) is None
    assert watchdog.check(state, None, bus, store, now=t + 0.4) is None  # not yet the stall time
    stall = watchdog.check(state, None, bus, store, now=t + 0.6)
    assert stall is not None and watchdog.fired == 1
    assert stall.line().startswith("STALLED: no new policy version for 1s (head v1): no trajectories for 1s")

    # Trajectories arrive, rewards do not: the reward worker is named.
    state.add_trajectory("island0-bf16", "bf16")
    watchdog.check(state, None, bus, store, now=t + 0.7)
    stall = watchdog.check(state, None, bus, store, now=t + 1.0)
    assert stall.causes == ("no rewards for 1s while trajectories arrive: the reward worker",)

    # The bus is down and a worker is in its restart backoff: both named, first.
    bus.saw(False, "ConnectionRefusedError")
    supervisor = Supervisor(tmp_path, backoff_initial_s=3600)
    worker = supervisor.add(WorkerSpec("trainer", [sys.executable, "-c", "print('sprawl: error: lost'); exit(3)"], {}))
    worker.process.wait()
    supervisor.poll()
    assert worker.state == "backoff"
    stall = watchdog.check(state, supervisor, bus, store, now=t + 1.4)
    assert (
        stall.causes[0].startswith("the bus (nats) is unreachable (for ")
        and "ConnectionRefusedError" in stall.causes[0]
    )
    assert stall.causes[1] == "trainer is restarting (0 restarts, last exit 3: sprawl: error: lost)"
    assert watchdog.fired == 1  # the same stall, with new causes

    # A new version ends the stall; the next one counts again.
    state.versions[2] = VersionRecord(2, 2, 2.0, 10, 10, 1000, 8, [])
    assert watchdog.check(state, supervisor, bus, store, now=t + 1.2) is None
    assert watchdog.check(state, supervisor, bus, store, now=t + 1.8).head == 2 and watchdog.fired == 2
    supervisor.stop()


def test_the_live_view_shows_an_outage_and_a_stall():
    from workers.up.live_view import progress_line
    from workers.up.monitor import ServiceHealth
    from workers.up.watchdog import Stall

    state = _state_with({1: [[1.0]]})
    bus, store = ServiceHealth("the bus (nats)"), ServiceHealth("the blob store (S3)")
    bus.saw(False, "gone")
    stall = Stall(301.0, 1, ("the bus (nats) is unreachable (for 40s: gone)",))
    console = Console(width=200, record=True)
    console.print(render(state, None, phase="training", target=10, services=[bus, store], stall=stall))
    text = console.export_text()
    assert "the bus (nats): UNREACHABLE for" in text and "the blob store (S3): up" in text
    assert "STALLED: no new policy version for 301s (head v1): the bus (nats) is unreachable" in text
    line = progress_line(state, phase="training", target=10, services=[bus, store], stall=stall)
    assert "the bus (nats) UNREACHABLE for" in line and "STALLED" in line


# ---------------------------------------------------------------- the warm-up, in a child process


def _processes_with(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().split(") ", 1)[1][0]
            except (OSError, IndexError):
                continue
            if text in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


async def test_the_warm_up_runs_in_a_child_on_the_thread_budget_and_is_cached(tmp_path):
    from workers.up.options import TaskSettings
    from workers.up.warmup import warm_up

    task = TaskSettings(digits=1, warmup_steps=3, warmup_batch=4)
    steps: list[tuple[int, int]] = []
    env = dict(os.environ)
    model_dir = await warm_up(tmp_path, task, threads=1, env=env, on_step=lambda s, n, loss: steps.append((s, n)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
    again: list[int] = []
    assert await warm_up(tmp_path, task, threads=1, env=env, on_step=lambda *a: again.append(1)) == model_dir
    assert again == []  # from the cache, no child


async def test_a_cancelled_warm_up_stops_its_child(tmp_path):
    import asyncio

    from tests.servers import HANG_GUARD_S
    from workers.up.options import TaskSettings
    from workers.up.warmup import warm_up

    first_step = asyncio.Event()
    task = TaskSettings(digits=1, warmup_steps=10**6, warmup_batch=4)
    env = dict(os.environ) | {"OMP_NUM_THREADS": "8"}  # what `up` might be started with
    warming = asyncio.create_task(warm_up(tmp_path, task, threads=1, env=env, on_step=lambda *a: first_step.set()))
    await asyncio.wait_for(first_step.wait(), HANG_GUARD_S)
    children = _processes_with(f"workers.up.warmup {tmp_path}")
    assert len(children) == 1
    environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
    assert b"OMP_NUM_THREADS=1" in environ and b"MKL_NUM_THREADS=1" in environ  # the workers' budget
    warming.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(warming, HANG_GUARD_S)
    assert _processes_with(f"workers.up.warmup {tmp_path}") == []
