"""The parts of `sprawl up` that need no servers: options, run identity, the reward comparison,
the byte totals and the live view's rendering."""

import pytest
from pydantic import ValidationError
from rich.console import Console

from schemas import TrainerMetrics
from workers.up.live_view import render, sparkline
from workers.up.monitor import RunState, VersionRecord
from workers.up.orchestrate import UpOptions, choose_run_id, loss_fields, remember_run


def test_correction_names_map_to_trainer_loss_settings():
    assert loss_fields("sc+mis+mask") == {"score_centering": True, "mask_replay": True, "importance": "mis"}
    assert loss_fields("none") == {"score_centering": False, "mask_replay": False, "importance": "none"}
    assert loss_fields("tis,seq,ppo")["importance_level"] == "sequence"
    with pytest.raises(ValueError, match="unknown correction 'magic'"):
        loss_fields("sc+magic")


def test_options_accept_view_aliases_and_refuse_nonsense():
    options = UpOptions(views="bf16,fp8", islands=3)
    assert options.views == ["bf16", "fp8_e4m3"]
    assert options.island_views() == ["bf16", "fp8_e4m3", "bf16"]
    assert UpOptions(quick=True).target_versions < UpOptions().target_versions
    with pytest.raises(ValidationError, match="unknown view 'int4'"):
        UpOptions(views="bf16,int4")
    with pytest.raises(ValidationError, match="at least 1"):
        UpOptions(islands=0)


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
