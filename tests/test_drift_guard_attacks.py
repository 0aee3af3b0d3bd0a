"""The drift guard attacked: as a broken or hostile island would (a fresh id every few trajectories, an
id claimed by two samplers, logprobs that make the KL infinite or NaN, a kept set without the sampled
token) and as an unlucky run would (a broken majority, a silent flagged island, a batch quarantined
whole). Units on the guard and `run_update` on a tiny model: no stack."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.batching import GroupBatchItem
from pipeline.off_policy.settings import LossSection
from schemas import IslandDrift, IslandIdentity, Reward, SamplingParams, TrainerMetrics, Trajectory, VersionSpan
from schemas.codec import decode_event, encode_event
from workers.trainer.drift_guard import UNJUDGED, DriftGuard
from workers.trainer.settings import DriftSection, TrainerSection
from workers.trainer.update import LOG_RATIO_BOUND, build_tensors, run_update

CFG = DriftSection(window=4, factor=20.0, recover_factor=5.0, floor_kl_k3=1e-4, min_islands=3, min_tokens=100)
HEALTHY = {"bf16": 1e-4, "fp8": 2e-4, "mxfp4": 2e-3}


def _update(**kls: float | tuple[float, float]) -> dict[str, dict[str, float]]:
    """island=kl or island=(kl, tokens); 100 tokens unless told."""
    out = {}
    for island, value in kls.items():
        kl, tokens = value if isinstance(value, tuple) else (value, 100.0)
        out[island] = {"tokens": tokens, "kl_k3": kl, "ess_ratio": 0.9}
    return out


def _event(change) -> IslandDrift:
    """The event the trainer appends for a change, through the log's codec (what a reader gets)."""
    event = change.event("r")
    assert isinstance(event, IslandDrift)
    decoded = decode_event(encode_event(event))
    assert decoded == event
    return decoded


# ---------------------------------------------------------------- evasion


def test_an_island_that_takes_a_fresh_id_every_update_is_caught_as_the_unjudged_pool():
    guard = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    changes = []
    for version in range(1, 9):
        # 30 tokens of a broken island under a new id each update: no id ever reaches min_tokens (100)
        changes += guard.observe(version, _update(**HEALTHY, **{f"rot-{version}": (0.5, 30.0)}))
        assert guard.unjudged_tokens == 30.0
    assert [(c.island_id, c.state, c.version) for c in changes] == [(UNJUDGED, "flagged", 4)]  # 4 x 30 >= 100
    assert changes[0].baseline_kl_k3 == 2e-4 and changes[0].quarantined
    _event(changes[0])
    # its next fresh id leaves the loss; judged islands stay in it
    assert guard.quarantine_for({"bf16", "fp8", "mxfp4", "rot-9"}) == {UNJUDGED, "rot-9"}
    # and the ids it threw away do not pile up in the guard
    for version in range(9, 200):
        guard.observe(version, _update(**HEALTHY, **{f"rot-{version}": (0.5, 30.0)}))
    assert len(guard._windows) <= len(HEALTHY) + 1 + CFG.window


def test_before_it_the_rotating_island_was_never_judged_nor_visible():
    """The hole the pool closes: per id, nothing ever reaches min_tokens."""
    guard = DriftGuard(CFG)
    for version in range(1, 9):
        guard.observe(version, _update(**HEALTHY, **{f"rot-{version}": (0.5, 30.0)}))
    assert all(s.tokens < CFG.min_tokens for island, s in guard.states().items() if island.startswith("rot-"))
    assert guard.flagged == {UNJUDGED}


def test_at_a_fleet_start_every_island_is_unjudged_and_that_is_no_verdict():
    guard = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    # 4 islands of 30 tokens, one broken: the pool has 120 tokens at once, but no island is judged yet
    fleet = {"a": (1e-4, 30.0), "b": (2e-4, 30.0), "c": (2e-3, 30.0), "bad": (0.5, 30.0)}
    for version in range(1, 4):
        assert guard.observe(version, _update(**fleet)) == []
        assert guard.quarantine_for(set(fleet)) == frozenset()
    # once they are judged (4 x 30), the broken one is flagged by its own id, not the pool
    assert [(c.island_id, c.state) for c in guard.observe(4, _update(**fleet))] == [("bad", "flagged")]


def test_a_healthy_newcomer_is_not_flagged_by_the_pool():
    guard = DriftGuard(CFG)
    for version in range(1, 10):
        assert guard.observe(version, _update(**HEALTHY, new=(1e-3, 30.0))) == []
    assert guard.unjudged_tokens == 0.0  # judged from its 4th update on


def test_an_island_that_calls_itself_the_pool_is_pooled():
    guard = DriftGuard(CFG)
    for version in range(1, 3):
        guard.observe(version, _update(**HEALTHY, **{UNJUDGED: (0.5, 60.0)}))
    assert guard.flagged == {UNJUDGED}


def test_an_id_claimed_by_two_samplers_is_visible_in_the_metrics():
    """Ids are self-declared (a sampler credential may append any trajectory of the run): the trainer
    cannot tell the impersonator from the island, but it counts the distinct samplers behind an id."""
    batch = _batch([("ok", "bf16", [-2.0, -2.5, -1.0]), ("ok", "fp8_e4m3", [-9.0, -8.0, -9.0])])
    metrics = _run(batch)
    assert metrics.per_island["ok"]["identities"] == 2.0
    alone = _run(_batch([("ok", "bf16", [-2.0, -2.5, -1.0]), ("ok", "bf16", [-2.0, -2.5, -1.0])]))
    assert alone.per_island["ok"]["identities"] == 1.0


# ---------------------------------------------------------------- an unlucky fleet


def test_a_broken_majority_hides_behind_the_median_unless_a_ceiling_is_set():
    fleet = {"good": 2e-4, "bad1": 0.5, "bad2": 0.6}
    median_only = DriftGuard(CFG)
    for version in range(1, 4):
        assert median_only.observe(version, _update(**fleet)) == []  # each broken one vs half a broken KL
    ceiling = DriftGuard(CFG.model_copy(update={"ceiling_kl_k3": 5e-2}))
    changes = ceiling.observe(1, _update(**fleet))
    assert sorted((c.island_id, c.state) for c in changes) == [("bad1", "flagged"), ("bad2", "flagged")]
    # repaired, they recover below the ceiling's recovery line (5e-2 x 5 / 20), whatever the median says
    recovered = []
    for version in range(2, 8):
        recovered += [c.island_id for c in ceiling.observe(version, _update(good=2e-4, bad1=1e-3, bad2=1e-3))]
    assert sorted(recovered) == ["bad1", "bad2"] and ceiling.flagged == frozenset()


def test_all_islands_alike_is_no_drift():
    guard = DriftGuard(CFG)
    for version in range(1, 10):
        assert guard.observe(version, _update(a=3e-3, b=3e-3, c=3e-3, d=3e-3)) == []


def test_a_silent_flagged_island_keeps_its_verdict_and_recovers_when_it_returns_healthy():
    guard = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    guard.observe(1, _update(**HEALTHY, bad=0.5))
    for version in range(2, 20):  # silent: no evidence either way, and its numbers are forgotten
        assert guard.observe(version, _update(**HEALTHY)) == []
    assert guard.flagged == {"bad"} and guard.quarantine_for({"bad", "bf16"}) == {"bad"} and "bad" not in guard._windows
    # back and repaired: quarantined but measured, so it can recover
    changes = guard.observe(20, _update(**HEALTHY, bad=2e-4))
    assert [(c.island_id, c.state) for c in changes] == [("bad", "recovered")]


def test_a_restarted_guard_keeps_the_pool_quarantined_from_the_lineage():
    guard = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    guard.restore_flagged(frozenset({UNJUDGED, "rot-3"}))  # what a lineage recorded
    assert guard.quarantine_for({"bf16", "rot-4"}) == {UNJUDGED, "rot-3", "bf16", "rot-4"}  # nothing judged yet
    guard.observe(1, _update(**HEALTHY, **{"rot-4": (0.5, 30.0)}))
    assert guard.quarantine_for({"bf16", "rot-5"}) == {UNJUDGED, "rot-3", "rot-5"}


# ---------------------------------------------------------------- numbers that are not numbers


def test_a_nan_or_infinite_kl_is_broken_and_blinds_nobody():
    # Before, NaN compared false with every line: never flagged, and as the median of the others it made
    # every baseline NaN, so no island of the fleet could be flagged or recover.
    inf = DriftGuard(CFG)
    assert [c.island_id for c in inf.observe(1, _update(**HEALTHY, inf=math.inf))] == ["inf"]
    guard = DriftGuard(CFG)
    update = _update(**HEALTHY, nan=math.nan, bad=0.5)  # 3 broken of 6: the median is still a healthy one
    update["missing"] = {"tokens": 100.0, "ess_ratio": math.nan}
    changes = guard.observe(1, update)
    assert sorted(c.island_id for c in changes) == ["bad", "missing", "nan"]
    assert all(math.isfinite(c.kl_k3) and math.isfinite(c.baseline_kl_k3) for c in changes)
    for change in changes:
        _event(change)
    # what goes into the metrics event is finite, so the event decodes
    report = guard.report()
    event = TrainerMetrics(run_id="r", step=1, version=1, metrics={}, per_island=report)
    assert decode_event(encode_event(event)) == event
    # with most islands non-finite, the healthy ones are still judged against a finite baseline
    assert guard.baseline_kl_k3 < math.inf and "bf16" not in guard.flagged


def test_zero_and_negative_token_updates_are_ignored():
    guard = DriftGuard(CFG)
    update = _update(**HEALTHY)
    update["ghost"] = {"tokens": 0.0}
    update["neg"] = {"tokens": -5.0, "kl_k3": 9.0, "ess_ratio": 0.1}
    assert guard.observe(1, update) == [] and set(guard.states()) == set(HEALTHY)
    assert guard.observe(2, {}) == []


# ---------------------------------------------------------------- the update


def _batch(rows, kept=None) -> list[GroupBatchItem]:
    """rows: (island, view, logprobs) per group of 4 alike trajectories."""
    items = []
    for g, (island, view, logprobs) in enumerate(rows):
        trajectories, rewards = [], []
        for i in range(4):
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
                    logprobs=logprobs,
                    finish_reason="stop",
                    version_spans=[VersionSpan(version=0, start=0, end=3)],
                    island=IslandIdentity(island_id=island, accelerator="cpu", view=view, engine="torch"),
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=3),
                    top_p_kept_ids=kept,
                    producer=f"sampler/host-{view}/1",
                )
            )
            rewards.append(
                Reward(
                    run_id="r",
                    trajectory_id=tid,
                    group_id=f"g{g}",
                    value=float(i % 2),
                    verifier="v",
                    verifier_version="1",
                    duration_s=0.0,
                )
            )
        items.append(GroupBatchItem(f"g{g}", trajectories, rewards, [0, 1, 2, 3], [0, 1, 2, 3]))
    return items


def _model():
    from tests.tiny_models import tiny_moe

    return tiny_moe(seed=5).train()


def _run(batch, cfg: TrainerSection | None = None, quarantined=frozenset(), model=None, optimizer=None):
    torch.manual_seed(0)
    model = model if model is not None else _model()
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    return run_update(model, optimizer, batch, cfg or TrainerSection(), 0, quarantined)


def _decodes(metrics) -> None:
    event = TrainerMetrics(
        run_id="r",
        step=1,
        version=1,
        metrics=metrics.overall,
        per_group=metrics.per_group,
        per_island=metrics.per_island,
    )
    assert decode_event(encode_event(event)) == event


def test_logprobs_that_make_the_kl_infinite_give_finite_metrics_that_the_log_can_carry():
    # -1e300 is valid JSON and -inf in float32 (pi/mu = inf, k3 = inf - inf = NaN before); a logprob of
    # +1e4 underflows pi/mu to 0 (k3 = inf before): either made the TrainerMetrics undecodable
    batch = _batch(
        [
            ("ok", "bf16", [-2.0, -2.5, -1.0]),
            ("inf", "bf16", [-1e300, -2.5, -1.0]),
            ("under", "bf16", [1e4, 1e4, 1e4]),
        ]
    )
    metrics = _run(batch)
    _decodes(metrics)
    ok, inf, under = (metrics.per_island[i]["kl_k3"] for i in ("ok", "inf", "under"))
    # bounded by the clamp (k3 of log ratio r is e^r - 1 - r: e^50 above, 49 below), far above a token of
    # an island that samples like the trainer's model
    assert inf == pytest.approx(math.exp(LOG_RATIO_BOUND) / 3, rel=0.01) and under == pytest.approx(LOG_RATIO_BOUND - 1)
    assert min(inf, under) > 10 * ok
    # beside a healthy fleet, both are flagged (before, the NaN one never could be)
    guard = DriftGuard(CFG.model_copy(update={"min_tokens": 1}))
    fleet = _update(**HEALTHY) | {i: metrics.per_island[i] for i in ("inf", "under")}
    assert {c.island_id for c in guard.observe(1, fleet)} == {"inf", "under"}


def test_a_diverged_model_still_gives_a_metrics_event_that_decodes():
    model = _model()
    with torch.no_grad():
        next(iter(model.parameters())).fill_(math.nan)
    metrics = _run(_batch([("ok", "bf16", [-2.0, -2.5, -1.0])]), model=model)
    _decodes(metrics)
    assert metrics.overall["nonfinite_metrics"] > 0 and "loss" not in metrics.overall


def test_a_kept_set_without_the_sampled_token_does_not_make_the_loss_nan():
    # mask replay on (the default loss): the sampled token is 7+i, 9, 2; the island claims it kept only 3
    batch = _batch([("ok", "bf16", [-2.0, -2.5, -1.0]), ("evil", "bf16", [-2.0, -2.5, -1.0])], kept=[[3], [3], [3]])
    metrics = _run(batch)
    assert math.isfinite(metrics.overall["loss"]) and metrics.overall["grad_norm"] >= 0
    _decodes(metrics)


def test_an_honest_kept_set_is_unchanged():
    batch = _batch([("ok", "bf16", [-2.0, -2.5, -1.0])], kept=[[3, 7, 8, 9, 10], [9, 4], [2]])
    trajectories = [t for item in batch for t in item.trajectories]
    bt = build_tensors(trajectories, 64, 0, None)
    expected = torch.zeros_like(bt.kept)
    for i in range(len(trajectories)):
        for j, ids in enumerate([[3, 7, 8, 9, 10], [9, 4], [2]]):
            expected[i, j, ids] = True
    expected[0:1, 0, 7] = True  # row 0 sampled 7, in its set already; rows 1-3 sampled 8, 9, 10: in it too
    assert torch.equal(bt.kept, expected)


def test_a_batch_quarantined_whole_moves_no_weight_and_no_optimizer_state():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batch = _batch([("ok", "bf16", [-2.0, -2.5, -1.0]), ("bad", "bf16", [-9.0, -8.0, -9.0])])
    _run(batch, model=model, optimizer=optimizer)  # a real step first: Adam has momentum now
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}
    metrics = _run(batch, quarantined=frozenset({"ok", "bad"}), model=model, optimizer=optimizer)
    assert metrics.overall["tokens"] == 0 and metrics.overall["loss"] == 0.0 and metrics.overall["grad_norm"] == 0.0
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in state[name].items()), name
    # still measured: the guard can see them recover
    assert metrics.per_island["bad"]["tokens"] == 12 and metrics.per_island["bad"]["kl_k3"] > 0
    _decodes(metrics)


def test_a_group_quarantined_whole_beside_a_healthy_one_trains_on_the_healthy_one_only():
    batch = _batch([("ok", "bf16", [-2.0, -2.5, -1.0]), ("bad", "bf16", [-9.0, -8.0, -9.0])])
    cfg = TrainerSection(loss=LossSection(importance="none", score_centering=False, mask_replay=False))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = run_update(model, optimizer, batch, cfg, 0, frozenset({"bad"}))
    healthy_only = _model()
    run_update(healthy_only, torch.optim.SGD(healthy_only.parameters(), lr=0.0), batch[:1], cfg, 0)
    # the healthy group's advantages are its own (GRPO normalizes within a group), the loss's mean is
    # over its tokens only: the gradient is the one of the healthy group alone
    for (name, p), q in zip(model.named_parameters(), healthy_only.parameters(), strict=True):
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8), name
    assert metrics.overall["tokens"] == 12 and math.isfinite(metrics.overall["loss"])


def test_the_trainer_resolves_the_pool_to_the_ids_of_its_batch():
    """What the loop hands `run_update` (and records in the lineage) is a set of concrete ids."""
    guard = DriftGuard(CFG.model_copy(update={"quarantine": True}))
    for version in range(1, 5):
        guard.observe(version, _update(**HEALTHY, **{f"rot-{version}": (0.5, 30.0)}))
    assert guard.flagged == {UNJUDGED}
    batch = _batch([("bf16", "bf16", [-2.0, -2.5, -1.0]), ("rot-x", "bf16", [-2.0, -2.5, -1.0])])
    quarantined = guard.quarantine_for({t.island.island_id for item in batch for t in item.trajectories})
    assert quarantined == {UNJUDGED, "rot-x"}
    metrics = _run(batch, quarantined=quarantined)
    assert metrics.overall["quarantined_trajectories"] == 4 and metrics.overall["tokens"] == 12
    assert metrics.per_island["rot-x"]["tokens"] == 12  # measured all the same
