"""The per-island drift guard: its verdicts (unit), a fleet with real numerics where one island
dequantizes wrongly (in process), quarantine's effect on the gradient, and the quarantined set's
round trip through the lineage."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
from pydantic import ValidationError

from schemas.lineage import Lineage, LineageGroup, LineageMember, decode_lineage, encode_lineage
from workers.trainer.drift_guard import DriftGuard, weighted_median
from workers.trainer.settings import DriftSection

CFG = DriftSection(window=4, factor=20.0, recover_factor=5.0, floor_kl_k3=1e-4, min_islands=3, min_tokens=100)


def _update(**kls: float | tuple[float, float]) -> dict[str, dict[str, float]]:
    """island=kl or island=(kl, tokens); 100 tokens unless told."""
    out = {}
    for island, value in kls.items():
        kl, tokens = value if isinstance(value, tuple) else (value, 100.0)
        out[island] = {"tokens": tokens, "kl_k3": kl, "ess_ratio": 0.9}
    return out


HEALTHY = {"bf16": 1e-4, "fp8": 2e-4, "mxfp4": 2e-3}
"""A mixed fleet's KLs as measured: mxfp4 10-20x the others."""


def test_the_median_baseline_ignores_one_broken_island_and_flags_it():
    guard = DriftGuard(CFG)
    changes = guard.observe(1, _update(**HEALTHY, bad=0.5), {"bad": "mxfp4"})
    # the fleet's median of (1e-4, 2e-4, 2e-3, 0.5) = 1.1e-3: the broken island moved it only to
    # between the healthy ones; each island is judged against the median of the others
    assert guard.baseline_kl_k3 == pytest.approx((2e-4 + 2e-3) / 2)
    assert [(c.island_id, c.state, c.view, c.version) for c in changes] == [("bad", "flagged", "mxfp4", 1)]
    assert changes[0].kl_k3 == 0.5 and changes[0].factor == 20.0 and changes[0].ess_ratio == 0.9
    assert changes[0].baseline_kl_k3 == 2e-4  # median of bf16, fp8, mxfp4
    # mxfp4 (2e-3) against the median of bf16, fp8 and the broken one (2e-4): 10x, under the factor
    assert guard.report()["mxfp4"]["baseline_kl_k3"] == 2e-4
    assert guard.flagged == {"bad"}
    assert guard.quarantined == frozenset()  # quarantine is off by default: flagging is a diagnosis
    for version in range(2, 6):
        assert guard.observe(version, _update(**HEALTHY, bad=0.5)) == []  # a verdict is an event once
    assert guard.flagged == {"bad"}


def test_a_healthy_mixed_fleet_is_not_flagged():
    guard = DriftGuard(CFG)
    for version in range(1, 10):
        assert guard.observe(version, _update(**HEALTHY)) == []
    assert guard.flagged == frozenset()


def test_the_floor_keeps_a_near_zero_fleet_from_flagging_noise():
    guard = DriftGuard(CFG)
    # Every island computes like the trainer (~1e-7); one is 100x that, still nothing.
    assert guard.observe(1, _update(a=1e-7, b=2e-7, c=1e-7, d=1e-5)) == []
    assert guard.baseline_kl_k3 == CFG.floor_kl_k3
    # Above factor x floor it is a drift, whatever the median.
    fresh = DriftGuard(CFG)
    assert [c.island_id for c in fresh.observe(1, _update(a=1e-7, b=2e-7, c=1e-7, d=5e-3))] == ["d"]


def test_one_spiking_update_is_not_a_verdict_the_median_of_the_window_is():
    guard = DriftGuard(CFG)
    guard.observe(1, _update(**HEALTHY))
    guard.observe(2, _update(**HEALTHY))
    # One rare token makes one update of a healthy island 40x its usual KL: not flagged.
    assert guard.observe(3, _update(bf16=1e-4, fp8=2e-4, mxfp4=8e-2)) == []
    state = guard.states()["mxfp4"]
    assert state.kl_k3 == 2e-3 and state.kl_k3_mean == pytest.approx((2e-3 * 2 + 8e-2) / 3)
    # A broken island is off in every update: flagged as soon as it has min_tokens (here one update).
    assert [c.island_id for c in guard.observe(4, _update(**HEALTHY, bad=0.5))] == ["bad"]
    assert guard.flagged == {"bad"}


def test_the_window_forgets_old_updates_and_the_island_recovers():
    guard = DriftGuard(CFG)
    guard.observe(1, _update(**HEALTHY, bad=0.5))
    assert guard.flagged == {"bad"}
    versions = []
    for version in range(2, 10):
        changes = guard.observe(version, _update(**HEALTHY, bad=2e-4))  # repaired
        versions += [(c.version, c.state) for c in changes]
    # one good update of two is a median of 0.25: still flagged; two good of three make it good
    assert versions == [(3, "recovered")]
    assert guard.flagged == frozenset()


def test_hysteresis_an_island_between_the_two_lines_keeps_its_verdict():
    guard = DriftGuard(CFG)
    baseline = 2e-4  # the median of the others (bf16, fp8, mxfp4)
    between = 10 * baseline  # above recover_factor (5) x baseline, below factor (20) x baseline
    assert guard.observe(1, _update(**HEALTHY, x=between)) == []  # not flagged: below factor x
    guard.observe(2, _update(**HEALTHY, x=(0.5, 400.0)))  # 400 tokens of a broken island: the median
    assert guard.flagged == {"x"}
    for version in range(3, 12):
        assert guard.observe(version, _update(**HEALTHY, x=between)) == []  # not recovered either
    assert guard.flagged == {"x"}
    recovered = []
    for version in range(12, 16):
        recovered += [c.version for c in guard.observe(version, _update(**HEALTHY, x=1e-4))]
    assert recovered == [14]  # once most of its window (3 of 4 updates) is good again


@pytest.mark.parametrize("islands", [1, 2])
def test_with_fewer_than_three_islands_the_floor_alone_is_the_baseline(islands):
    guard = DriftGuard(CFG)
    fleet = dict(list({"good": 5e-4, "bad": 0.5}.items())[2 - islands :])
    changes = guard.observe(1, _update(**fleet))
    # Of two, the median would be (5e-4 + 0.5) / 2: the broken island could never exceed 2x it.
    assert guard.baseline_kl_k3 == CFG.floor_kl_k3
    assert [c.island_id for c in changes] == ["bad"]
    # and a lone healthy island under factor x floor is not flagged
    lone = DriftGuard(CFG)
    assert lone.observe(1, _update(good=9e-4)) == [] and lone.baseline_kl_k3 == CFG.floor_kl_k3


def test_an_island_with_too_few_tokens_is_neither_judged_nor_in_the_baseline():
    guard = DriftGuard(CFG)
    few = {"bf16": 1e-4, "mx": 5e-4, "tiny": (3.0, 30.0)}
    # 'tiny' has 30 tokens of a huge KL: not judged, and not one of the three islands a median needs
    # (counted, the median would be 5e-4)
    assert guard.observe(1, _update(**few)) == []
    assert guard.baseline_kl_k3 == CFG.floor_kl_k3
    # its tokens add up over the window: judged once it has min_tokens (4 x 30)
    assert guard.observe(2, _update(**few)) == []
    assert guard.observe(3, _update(**few)) == []
    assert [c.island_id for c in guard.observe(4, _update(**few))] == ["tiny"]
    assert guard.baseline_kl_k3 == 5e-4
    # an island that stops sending keeps its verdict (no evidence either way) and leaves the baseline
    for version in range(5, 10):
        assert guard.observe(version, _update(**HEALTHY)) == []
    assert guard.flagged == {"tiny"} and "tiny" not in guard.states()


def test_quarantine_lists_the_flagged_islands_only_when_switched_on():
    on = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    changes = on.observe(1, _update(**HEALTHY, bad=0.5))
    assert on.quarantined == {"bad"} and changes[0].quarantined
    off = DriftGuard(CFG.model_copy(update={"enabled": False, "quarantine": True}))
    assert off.observe(1, _update(**HEALTHY, bad=0.5)) == [] and off.quarantined == frozenset()


def test_a_restarted_guard_starts_from_the_recorded_quarantine():
    guard = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    guard.restore_flagged(frozenset({"bad"}))
    assert guard.quarantined == {"bad"}
    assert [c.state for c in guard.observe(1, _update(**HEALTHY, bad=1e-4))] == ["recovered"]


def test_settings_refuse_a_recovery_line_above_the_flag_line():
    with pytest.raises(ValidationError, match="recover_factor"):
        DriftSection(factor=5, recover_factor=6)
    with pytest.raises(ValidationError):
        DriftSection(factor=1.0)


def test_weighted_median():
    assert weighted_median([(1.0, 1), (2.0, 1), (100.0, 1)]) == 2.0
    assert weighted_median([(1.0, 10), (100.0, 1), (50.0, 1)]) == 1.0
    assert weighted_median([(1.0, 1), (5.0, 1)]) == 3.0  # half and half: the midpoint, as a plain median
    assert weighted_median([(1.0, 1), (5.0, 1), (9.0, 2)]) == 7.0
    assert weighted_median([(7.0, 3)]) == 7.0


# ---------------------------------------------------------------- the lineage


def test_lineage_round_trips_the_quarantined_islands_and_reads_old_blobs():
    group = LineageGroup("g0", [LineageMember("g0-0", 3, 4)])
    plain = Lineage(version=2, groups=[group])
    assert b"quarantined" not in encode_lineage(plain)  # byte-identical to a blob from before the field
    assert encode_lineage(plain) == b'{"version":2,"groups":[{"group_id":"g0","members":[["g0-0",3,4]]}]}'
    assert decode_lineage(encode_lineage(plain)).quarantined_islands == []
    marked = Lineage(version=2, groups=[group], quarantined_islands=["isl-bad"])
    assert decode_lineage(encode_lineage(marked)) == marked

    class OldLineage(msgspec.Struct, frozen=True, forbid_unknown_fields=False):  # a reader before the field
        version: int
        groups: list[LineageGroup]

    assert msgspec.json.decode(encode_lineage(marked), type=OldLineage).groups == [group]
    with pytest.raises(Exception, match="not a lineage blob"):
        decode_lineage(b'{"version":2,"groups":[],"quarantined_islands":"isl-bad"}')


# ---------------------------------------------------------------- run_update with quarantine


def _synthetic_batch():
    """Two groups, each with a trajectory of island 'ok' and one of island 'bad'."""
    from pipeline.batching import GroupBatchItem
    from schemas import IslandIdentity, Reward, SamplingParams, Trajectory, VersionSpan

    items = []
    for g in range(2):
        trajectories, rewards = [], []
        for i, island in enumerate(["ok", "bad", "ok", "bad"]):
            tid = f"g{g}-{i}"
            trajectories.append(
                Trajectory(
                    run_id="r",
                    trajectory_id=tid,
                    group_id=f"g{g}",
                    sample_index=i,
                    task="t",
                    prompt_token_ids=[1, 5, 6],
                    output_token_ids=[7 + i, 9, 2],
                    logprobs=[-2.0, -2.5, -1.0] if island == "ok" else [-9.0, -8.0, -9.0],
                    finish_reason="stop",
                    version_spans=[VersionSpan(version=0, start=0, end=3)],
                    island=IslandIdentity(island_id=island, accelerator="cpu", view="bf16", engine="torch"),
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=3),
                )
            )
            rewards.append(
                Reward(
                    run_id="r",
                    trajectory_id=tid,
                    group_id=f"g{g}",
                    value=float(i % 3 == 0),
                    verifier="v",
                    verifier_version="1",
                    duration_s=0.0,
                )
            )
        items.append(GroupBatchItem(f"g{g}", trajectories, rewards, [0, 1, 2, 3], [0, 1, 2, 3]))
    return items


def _grads(quarantined: frozenset[str], batch):
    from pipeline.off_policy.settings import LossSection
    from tests.tiny_models import tiny_moe
    from workers.trainer.settings import TrainerSection
    from workers.trainer.update import run_update

    # The plain surrogate: MIS would reject the 'bad' rows' tokens on its own (rho far outside its
    # band), and then quarantine could not be told from the correction.
    cfg = TrainerSection(loss=LossSection(importance="none", score_centering=False, mask_replay=False))
    torch.manual_seed(0)
    model = tiny_moe(seed=5).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves the weights: compare grads
    metrics = run_update(model, optimizer, batch, cfg, 0, quarantined)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, metrics


def test_quarantined_rows_add_nothing_to_the_gradient_and_are_still_measured():
    batch = _synthetic_batch()
    grads, metrics = _grads(frozenset({"bad"}), batch)
    # The same update on a batch where the 'bad' rows' tokens are masked out by hand.
    masked = []
    for item in batch:
        trajectories = [
            t if t.island.island_id == "ok" else msgspec.structs.replace(t, loss_mask=[0, 0, 0])
            for t in item.trajectories
        ]
        masked.append(type(item)(item.group_id, trajectories, item.rewards, item.trajectory_seqs, item.reward_seqs))
    expected, _ = _grads(frozenset(), masked)
    assert grads.keys() == expected.keys()
    for name in grads:
        assert torch.equal(grads[name], expected[name]), name  # bit for bit: nothing of 'bad' in it
    unquarantined, plain = _grads(frozenset(), batch)
    assert any(not torch.equal(grads[n], unquarantined[n]) for n in grads)  # and 'bad' did matter
    # 'bad' is still measured, with the same numbers as when it trained
    bad, bad_plain = metrics.per_island["bad"], plain.per_island["bad"]
    assert bad["tokens"] == bad_plain["tokens"] == 12
    for key in ("kl_k3", "kl_k1", "ess_ratio", "entropy"):
        assert bad[key] == pytest.approx(bad_plain[key], rel=1e-6), key
    assert bad["kl_k3"] > 10 * metrics.per_island["ok"]["kl_k3"]
    assert metrics.overall["tokens"] == 12 and plain.overall["tokens"] == 24  # the loss saw 'ok' only
    assert metrics.overall["quarantined_trajectories"] == 4


def test_an_update_whose_every_island_is_quarantined_changes_nothing():
    batch = _synthetic_batch()
    grads, metrics = _grads(frozenset({"ok", "bad"}), batch)
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())
    assert metrics.overall["tokens"] == 0 and metrics.overall["loss"] == 0.0
    assert metrics.per_island["ok"]["tokens"] == 12


# ---------------------------------------------------------------- a fleet with real numerics


@pytest.fixture(scope="module")
def fleet_root(tmp_path_factory):
    return tmp_path_factory.mktemp("drift-fleet")


@pytest.fixture(scope="module")
def warm_model(fleet_root):
    from tests.drift_fleet import TASK
    from workers.up.demo_task import warmed_up_model

    return warmed_up_model(fleet_root / "state", TASK)


def _fleet(root, drift: DriftSection, model_dir):
    from tests.drift_fleet import Fleet, make_island

    islands = [
        make_island("isl-bf16", "bf16"),
        make_island("isl-fp8", "fp8_e4m3"),
        make_island("isl-mxfp4", "mxfp4"),
        make_island("isl-broken", "mxfp4", "wrong_dequant"),
    ]
    return Fleet(root, islands, drift, model_dir=model_dir)


DETECTION_UPDATES = 3
"""The faulty island must be flagged by this update: `min_tokens` (128) of it, at ~55 tokens an update."""


@pytest.mark.slow  # ~15 s of CPU: a warm-up and 4 reference engines
def test_a_fleet_flags_the_island_that_dequantizes_wrongly_and_never_a_healthy_one(fleet_root, warm_model):
    fleet = _fleet(fleet_root / "flag", DriftSection(), warm_model)
    for _ in range(6):
        asyncio.run(fleet.step())
    flagged = [(c.island_id, c.state, c.version) for c in fleet.changes]
    assert len(flagged) == 1 and flagged[0][:2] == ("isl-broken", "flagged"), flagged
    assert flagged[0][2] <= DETECTION_UPDATES
    kl = {island: s.kl_k3 for island, s in fleet.guard.states().items()}
    print("windowed kl_k3:", {k: f"{v:.2e}" for k, v in kl.items()}, "baseline", fleet.guard.baseline_kl_k3)
    # the measured order: the fault is orders of magnitude off, mxfp4 above bf16
    assert kl["isl-broken"] > 100 * max(kl["isl-bf16"], kl["isl-fp8"], kl["isl-mxfp4"])
    assert kl["isl-mxfp4"] > kl["isl-bf16"]


@pytest.mark.slow
def test_with_quarantine_the_broken_island_leaves_the_loss_while_it_is_flagged(fleet_root, warm_model):
    fleet = _fleet(fleet_root / "quarantine", DriftSection(quarantine=True), warm_model)
    for _ in range(5):
        asyncio.run(fleet.step())
    flagged_at = next(c.version for c in fleet.changes if c.island_id == "isl-broken")
    assert all(c.quarantined for c in fleet.changes)
    for version, quarantined in fleet.quarantined_by_version.items():
        metrics = fleet.history[version - 1]
        broken = metrics.per_island["isl-broken"]
        if version > flagged_at:
            assert quarantined == {"isl-broken"}
            # the loss's tokens are the healthy islands' only; the broken one is still measured
            healthy = sum(m["tokens"] for i, m in metrics.per_island.items() if i != "isl-broken")
            assert metrics.overall["tokens"] == healthy and broken["tokens"] > 0
            assert broken["kl_k3"] > 0.1
        else:
            assert quarantined == frozenset()
    assert len(fleet.quarantined_by_version) - flagged_at >= 2  # it was quarantined for updates, not one


# ---------------------------------------------------------------- the live view of `sprawl up`


def test_the_live_view_shows_flagged_islands_and_their_windowed_kl():
    from rich.console import Console

    from schemas import IslandDrift, TrainerMetrics
    from workers.up.live_view import progress_line, render
    from workers.up.monitor import IslandState, RunMonitor, RunState

    monitor = RunMonitor.__new__(RunMonitor)  # only its event handling: no log, no tasks
    monitor.state = state = RunState("r")
    for island_id, view in (("isl-ok", "bf16"), ("isl-bad", "mxfp4")):
        state.islands[island_id] = IslandState(island_id, view, view, version=3, state="serving")

    def drift(state_: str, version: int) -> IslandDrift:
        return IslandDrift(
            run_id="r",
            island_id="isl-bad",
            view="mxfp4",
            state=state_,
            version=version,
            kl_k3=3.2,
            ess_ratio=0.2,
            baseline_kl_k3=1e-3,
            factor=50.0,
            quarantined=True,
        )

    per_island = {"isl-bad": {"kl_k3": 3.1, "window_kl_k3": 3.2}, "isl-ok": {"kl_k3": 1e-4, "window_kl_k3": 2e-4}}
    metrics = TrainerMetrics(run_id="r", step=3, version=3, metrics={"islands_flagged": 1.0}, per_island=per_island)
    asyncio.run(monitor._apply(metrics))
    asyncio.run(monitor._apply(drift("flagged", 2)))
    asyncio.run(monitor._apply(drift("recovered", 1)))  # an older verdict arriving late changes nothing
    assert [d.island_id for d in state.flagged_islands()] == ["isl-bad"]
    console = Console(width=200, record=True)
    console.print(render(state, None, phase="training", target=10))
    text = console.export_text()
    assert "isl-bad FLAGGED + QUARANTINED since v2 (KL 3.20e+00 vs baseline 1.00e-03)" in text
    bad_row = next(line for line in text.splitlines() if "isl-bad" in line and "mxfp4" in line)
    assert "QUARANTINED" in bad_row and "3.20e+00" in bad_row
    ok_row = next(line for line in text.splitlines() if "isl-ok" in line)
    assert "2.00e-04" in ok_row and " ok " in ok_row
    assert "drift guard flagged isl-bad" in progress_line(state, phase="training", target=10)

    asyncio.run(monitor._apply(drift("recovered", 5)))
    console = Console(width=200, record=True)
    console.print(render(state, None, phase="training", target=10))
    assert "no island flagged" in console.export_text() and state.flagged_islands() == []
