"""`sprawl experiment stability`: the collapse rule, the matrix, the runs' command lines, the outputs.

The rule and the summaries are pure functions over per-update metrics, tested on hand-made series.
Each run's `sprawl up` command line is parsed by the real CLI (so a flag the experiment passes that
`up` does not take fails here, not an hour into a matrix). The end-to-end `--quick` experiment, real
runs against a real stack, is `slow`.
"""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
from pydantic import ValidationError

from workers.cli import parse
from workers.experiment.collapse import CollapseRule, judge, summarize_cell
from workers.experiment.stability import (
    CORRECTIONS,
    FLEETS,
    ExperimentOptions,
    PlannedRun,
    Recorded,
    StabilitySettings,
    plan,
    relative_rows,
    summarize,
    up_command,
    write_outputs,
)


def _series(rewards, **others):
    n = len(rewards)
    return {"reward_mean": list(rewards), "kl_k3": others.get("kl", [0.01] * n)} | {
        k: v for k, v in others.items() if k != "kl"
    }


# ---------------------------------------------------------------- the rule


def test_a_run_whose_reward_holds_is_stable_and_its_figures_are_the_stated_means():
    outcome = judge(_series([0.5, 0.6, 0.7, 0.4, 0.6, 0.65, 0.7, 0.75, 0.8, 0.7]), CollapseRule())
    assert not outcome.collapsed and outcome.updates_to_collapse is None
    assert outcome.start_reward == pytest.approx(0.6)
    assert outcome.final_reward == pytest.approx((0.65 + 0.7 + 0.75 + 0.8 + 0.7) / 5)
    assert outcome.kl_mean == pytest.approx(0.01)


def test_collapse_is_dated_to_the_first_of_the_consecutive_low_updates():
    # start 0.6; threshold 0.45. One low update (index 3) is noise; five in a row from update 6 are not.
    rewards = [0.6, 0.6, 0.6, 0.3, 0.6, 0.44, 0.4, 0.3, 0.2, 0.1, 0.5]
    outcome = judge(_series(rewards), CollapseRule())
    assert outcome.collapsed and outcome.updates_to_collapse == 6


def test_four_low_updates_then_a_good_one_do_not_count():
    rewards = [0.6, 0.6, 0.6, 0.1, 0.1, 0.1, 0.1, 0.6, 0.1, 0.1, 0.1, 0.1]
    assert not judge(_series(rewards), CollapseRule()).collapsed


def test_a_non_finite_loss_or_gradient_is_a_collapse_at_once():
    n = 8
    bad_grad = _series([0.6] * n, grad_norm=[1.0, 1.0, -1.0, 1.0, 1, 1, 1, 1], loss=[0.0] * n)
    assert judge(bad_grad, CollapseRule()).updates_to_collapse == 3
    bad_loss = _series([0.6] * n, grad_norm=[1.0] * n, loss=[0.0, math.nan] + [0.0] * 6)
    assert judge(bad_loss, CollapseRule()).updates_to_collapse == 2


def test_the_format_error_requirement_applies_only_when_set():
    rewards = [0.6, 0.6, 0.6] + [0.1] * 6
    errors = [0.0] * 9
    assert judge(_series(rewards, format_error_rate=errors), CollapseRule()).collapsed
    strict = CollapseRule(format_error_rate=0.2)
    assert not judge(_series(rewards, format_error_rate=errors), strict).collapsed
    assert "format_error_rate >= 0.2" in strict.describe()
    assert judge(_series(rewards, format_error_rate=[0.0] * 3 + [0.5] * 6), strict).updates_to_collapse == 4


def test_an_empty_run_cannot_be_judged():
    with pytest.raises(ValueError, match="without updates"):
        judge({"reward_mean": []}, CollapseRule())


def test_a_cell_summary_has_its_seeds_spread_and_collapse_counts():
    rule = CollapseRule()
    stable = judge(_series([0.6] * 10), rule)
    falls = judge(_series([0.6, 0.6, 0.6] + [0.1] * 7), rule)
    cell = summarize_cell("mixed", "none", [stable, falls, falls])
    assert (cell.seeds, cell.collapsed, cell.updates_to_collapse) == (3, 2, 4)
    assert cell.final_reward_mean == pytest.approx((0.6 + 0.1 + 0.1) / 3)
    assert cell.final_reward_sd == pytest.approx(0.288675, rel=1e-4)
    assert summarize_cell("mixed", "none", [stable]).final_reward_sd == 0.0


# ---------------------------------------------------------------- the matrix


def test_the_full_matrix_is_every_fleet_and_correction_for_each_seed_seed_major():
    runs = plan(ExperimentOptions(name="stability"))
    assert len(runs) == len(FLEETS) * len(CORRECTIONS) * 3
    assert {r.seed for r in runs[: len(FLEETS) * len(CORRECTIONS)]} == {0}  # every cell once before seed 1
    assert {(r.fleet, r.correction) for r in runs} == {(f, c) for f in FLEETS for c in CORRECTIONS}
    assert FLEETS["mixed"] == ("bf16", "fp8_e4m3", "mxfp4") and len(set(map(len, FLEETS.values()))) == 1


def test_quick_is_two_cells_one_seed_and_filters_narrow_the_matrix():
    quick = plan(ExperimentOptions(name="stability", quick=True))
    assert [(r.fleet, r.correction, r.seed) for r in quick] == [("homogeneous", "sc+mis", 0), ("mixed", "none", 0)]
    narrowed = plan(ExperimentOptions(name="stability", fleets="mixed", corrections="none,sc+mis", seeds=2))
    assert len(narrowed) == 4 and {r.fleet for r in narrowed} == {"mixed"}


@pytest.mark.parametrize(("field", "value"), [("fleets", "fp4only"), ("corrections", "sc+magic"), ("seeds", 0)])
def test_bad_options_are_refused_before_any_run(field, value):
    with pytest.raises(ValidationError):
        ExperimentOptions(name="stability", **{field: value})


def test_run_ids_are_subject_tokens():
    from pipeline.topology import token

    run_id = PlannedRun("mixed", "sc+mis+mask", 2).run_id("stab-20261201-120000")
    assert token(run_id, "run_id") == "stab-20261201-120000-mixed-sc_mis_mask-s2"


def test_each_runs_command_line_is_one_that_sprawl_up_accepts_with_the_stress_applied(tmp_path):
    settings = StabilitySettings(state_dir=tmp_path)
    run = PlannedRun("mixed", "sc+mis+mask", 1)
    command = up_command(settings, run, run.run_id("stab-x"), 40, tmp_path / "up.toml")
    (tmp_path / "up.toml").write_text("[trainer]\nlearning_rate = 0.0002\n")
    assert command[:4] == [sys.executable, "-m", "workers.cli", "up"]
    invocation = parse(command[3:])
    options, up = invocation.options, invocation.settings
    assert options.fresh and options.versions == 40 and options.islands == 3 and not options.live
    assert options.views == ["bf16", "fp8_e4m3", "mxfp4"] and options.correction == "sc+mis+mask"
    assert up.run_id == "stab-x-mixed-sc_mis_mask-s1"
    assert up.trainer.seed == 1 and up.trainer.learning_rate == 0.0002  # the config file reached it
    stress = settings.stress
    assert up.trainer.max_staleness == stress.max_staleness
    assert up.trainer.train_temperature == stress.train_temperature
    assert (up.prompts.temperature, up.prompts.top_p) == (stress.sample_temperature, stress.top_p)
    assert up.prompts.groups_ahead == stress.groups_ahead
    assert up.prompts.temperature != up.trainer.train_temperature  # the default stress is a mismatch


def test_outputs_have_the_json_columns_relative_to_the_baseline_and_a_plot(tmp_path):
    rule = CollapseRule()
    results = []
    for fleet, correction, rewards in [
        ("homogeneous", "sc+mis", [0.5] * 10),
        ("mixed", "none", [0.5, 0.5, 0.5] + [0.1] * 7),
    ]:
        for seed in range(2):
            series = _series(rewards, kl=[0.01 if fleet == "homogeneous" else 0.04] * 10)
            results.append(Recorded(PlannedRun(fleet, correction, seed), judge(series, rule), series))
    cells = summarize(results)
    rows = relative_rows(cells)
    assert [(r["fleet"], r["correction"]) for r in rows] == [("homogeneous", "sc+mis"), ("mixed", "none")]
    assert rows[0]["final_reward_vs_baseline"] == pytest.approx(1.0)
    assert rows[1]["final_reward_vs_baseline"] == pytest.approx(0.2) and rows[1]["kl_vs_baseline"] == pytest.approx(4)
    assert rows[1]["collapsed"] == 2 and rows[1]["updates_to_collapse"] == 4
    write_outputs(tmp_path, cells, results, StabilitySettings(state_dir=tmp_path), "stab-t")
    with (tmp_path / "table.csv").open() as f:
        table = list(csv.DictReader(f))
    required = {"fleet", "correction", "seeds", "collapsed", "updates_to_collapse", "final_reward_mean"}
    assert required | {"final_reward_sd", "kl_mean"} <= set(table[0]) and len(table) == 2
    assert table[0]["updates_to_collapse"] == "" and table[1]["updates_to_collapse"] == "4"
    with (tmp_path / "series.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4 * 10
    assert (tmp_path / "stability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "settings.json").read_text())["collapse_rule"] == rule.describe()


# ---------------------------------------------------------------- the real thing


@pytest.mark.slow
def test_quick_experiment_end_to_end_records_in_the_archive_and_continues(tmp_path):
    from infra import stack
    from tests.servers import stack_settings
    from tests.test_up import _sprawl

    settings = stack_settings(tmp_path / "state")
    try:
        out = tmp_path / "out"
        args = ["experiment", "stability", "--quick", "--json", "--experiment-id", "stab-t", "--output", str(out)]
        done = _sprawl(settings, *args, timeout=1800)
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["collapse_rule"] and len(result["cells"]) == 2
        for cell in result["cells"]:
            assert cell["seeds"] == 1 and 0 <= cell["collapsed"] <= 1
            assert 0 <= cell["final_reward_mean"] <= 1 and cell["kl_mean"] > 0
        mixed = next(c for c in result["cells"] if c["fleet"] == "mixed")
        homogeneous = next(c for c in result["cells"] if c["fleet"] == "homogeneous")
        assert homogeneous["final_reward_vs_baseline"] == pytest.approx(1.0)
        assert mixed["kl_mean"] > 0
        with (out / "table.csv").open() as f:
            assert len(list(csv.DictReader(f))) == 2

        sql = _sprawl(
            settings, "sql", "--run-id", "stab-t", "--json", "SELECT fleet, collapsed FROM stability", timeout=300
        )
        assert sql.returncode == 0, sql.stderr
        assert len(json.loads(sql.stdout.strip().splitlines()[-1])) == 2
        report = _sprawl(settings, "report", "--run-id", "stab-t", "--output", str(tmp_path / "r"), timeout=300)
        assert report.returncode == 0, report.stderr
        assert "Stability experiment" in (tmp_path / "r" / "report.html").read_text()

        # The same id again: both runs are recorded, nothing is rerun.
        again = _sprawl(settings, *args, timeout=600)
        assert again.returncode == 0, again.stderr[-4000:]
        assert again.stderr.count("recorded earlier") == 2
        assert json.loads(again.stdout.strip().splitlines()[-1])["cells"] == result["cells"]
    finally:
        stack.down(settings)


def test_a_crashed_attempt_gets_a_run_of_its_own():
    run = PlannedRun("mixed", "none", 0)
    assert run.run_id("stab-x") == "stab-x-mixed-none-s0"
    assert run.run_id("stab-x", 2) == "stab-x-mixed-none-s0-a2"


def test_a_run_whose_metrics_are_not_exactly_versions_one_to_n_is_refused():
    from types import SimpleNamespace

    from workers.experiment.stability import RunFailed, check_versions

    def metrics(versions):
        return [SimpleNamespace(version=v) for v in versions]

    check_versions(metrics(range(1, 6)), 5, "r")
    for bad in (range(1, 5), range(2, 7), [1, 2, 3, 4, 4], range(1, 7)):
        with pytest.raises(RunFailed, match=r"not exactly 1\.\.5"):
            check_versions(metrics(bad), 5, "r")


def test_the_json_line_has_null_where_a_figure_is_missing(tmp_path):
    from workers.experiment.stability import result_json

    no_tokens = {"reward_mean": [0.5] * 6, "kl_k3": [math.nan] * 6}
    results = [Recorded(PlannedRun("mixed", "none", 0), judge(no_tokens, CollapseRule()), no_tokens)]
    line = json.dumps(
        result_json("stab-x", summarize(results), StabilitySettings(state_dir=tmp_path), 6), allow_nan=False
    )
    assert json.loads(line)["cells"][0]["kl_mean"] is None


def test_the_report_section_reads_the_newest_record_of_each_seed():
    import duckdb

    from workers.up.report import _stability

    con = duckdb.connect()
    con.sql(
        """CREATE TABLE stability (fleet TEXT, correction TEXT, seed INT, updates INT, collapsed BOOL,
           updates_to_collapse INT, start_reward DOUBLE, final_reward DOUBLE, kl_mean DOUBLE, series TEXT,
           collapse_rule TEXT, produced_at TIMESTAMP)"""
    )
    falls = json.dumps({"reward_mean": [0.6, 0.6, 0.6, 0.1, 0.1, 0.1, 0.1, 0.1], "kl_k3": [0.02] * 8})
    holds = json.dumps({"reward_mean": [0.6] * 8, "kl_k3": [0.01, None] + [0.01] * 6})
    con.sql(
        f"""INSERT INTO stability VALUES
        ('homogeneous', 'sc+mis', 0, 8, false, NULL, 0.6, 0.6, 0.01, '{holds}', 'rule', '2026-12-01 10:00'),
        ('mixed', 'none', 0, 8, true, 4, 0.6, 0.1, 0.02, '{falls}', 'rule', '2026-12-01 10:00'),
        ('mixed', 'none', 0, 8, true, 4, 0.6, 0.1, 0.02, '{falls}', 'rule', '2026-12-01 11:00')"""
    )
    section = _stability(con, ["stability"])
    assert section.figure is not None and "rule" in section.note
    assert section.table_html.count("<tr>") == 1 + 2  # header + one row per cell: the repeated seed once
    assert "1/1" in section.table_html and "0.17x reward" in section.table_html
