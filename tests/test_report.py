"""The HTML run report, from small synthetic tables shaped like the archive's views.

DuckDB tables stand in for the Parquet views (same names and column layout: `metrics` as a struct,
`per_group` as JSON text, `views` as a list of structs), so the report's real queries run without a
stack. `test_audit.py` draws the same report from a real archive on S3.
"""

import re

import duckdb
import numpy as np
import pytest

from workers.up.report import (
    REPORT_FILE_NAME,
    human_bytes,
    report_sections,
    rolling_mean,
    run_folder,
    write_run_report,
)


def _archive_like(with_dead_letters: bool) -> tuple[duckdb.DuckDBPyConnection, list[str]]:
    con = duckdb.connect()
    # 40 updates: odd versions trained 300 tokens all one version behind, even ones 100 fresh tokens.
    # The archive's metric values are DOUBLEs (the trainer's floats), not DuckDB's DECIMAL literals.
    con.execute("""CREATE TABLE metrics AS SELECT v AS version, v AS step,
        {'reward_mean': (0.2 + v / 100 + CASE WHEN v % 2 = 0 THEN 0.1 ELSE -0.1 END)::DOUBLE,
         'tokens': (CASE WHEN v % 2 = 0 THEN 100 ELSE 300 END)::DOUBLE,
         'staleness_0': (CASE WHEN v % 2 = 0 THEN 1 ELSE 0 END)::DOUBLE,
         'staleness_1': (CASE WHEN v % 2 = 0 THEN 0 ELSE 1 END)::DOUBLE,
         'staleness_2': 0::DOUBLE, 'staleness_3_4': 0::DOUBLE, 'staleness_5_8': 0::DOUBLE,
         'staleness_9_plus': 0::DOUBLE} AS metrics,
        '{"bf16": {"kl_k3": 0.001}, "fp8_e4m3": {"kl_k3": ' || (0.01 + v / 1000) || '}}' AS per_group
        FROM range(1, 41) AS t(v)""")
    # Keyframes every 10 versions, 2 MB; patches of 20 kB in between: two orders of magnitude apart.
    con.execute("""CREATE TABLE versions AS SELECT v AS version,
        TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_seconds(v * 10) AS produced_at,
        [{'view': 'bf16', 'kind': CASE WHEN v % 10 = 0 THEN 'keyframe' ELSE 'patch' END,
          'bytes': CASE WHEN v % 10 = 0 THEN 2000000 ELSE 20000 END,
          'changed_elements': CASE WHEN v % 10 = 0 THEN 1000 ELSE 12 END, 'total_elements': 1000}] AS views
        FROM range(0, 41) AS t(v)""")
    con.execute("""CREATE TABLE islands AS SELECT {'island_id': 'isl-' || i} AS island, v AS current_version,
        TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_seconds(v * 10 + 1 + i) AS produced_at
        FROM range(0, 41) AS t(v), range(0, 2) AS s(i)""")
    con.execute("""CREATE TABLE rewards AS SELECT CASE WHEN i % 5 = 0 THEN 'timeout' END AS error_class
        FROM range(0, 50) AS t(i)""")
    views = ["metrics", "versions", "islands", "rewards"]
    if with_dead_letters:
        con.execute("""CREATE TABLE dead_letters AS SELECT
            TIMESTAMPTZ '2026-01-01 00:05:00+00' AS produced_at, 'trajectories' AS stream, 'c' AS consumer,
            'unknown_type' AS error_class, 'rl.r.traj.g0' AS original_subject, 1 AS original_seq,
            1 AS num_delivered, 'unknown event type ''mystery.v1''' AS reason""")
        views.append("dead_letters")
    return con, views


def _section(page: str, slug: str) -> tuple[str, str]:
    """The section's class attribute and its inner HTML."""
    match = re.search(rf'<section id="{slug}" class="([^"]*)">(.*?)</section>', page, re.S)
    assert match, slug
    return match[1], match[2]


def test_the_report_lands_in_the_run_folder(tmp_path):
    con, views = _archive_like(with_dead_letters=False)
    folder = run_folder(tmp_path / ".sprawl", "run-1")
    assert folder == (tmp_path / ".sprawl").resolve() / "runs" / "run-1"  # where `sprawl up` keeps the run
    path = write_run_report(con, views, "run-1", folder)
    assert path == folder / REPORT_FILE_NAME
    assert path.read_text().startswith("<!doctype html>")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [REPORT_FILE_NAME]


def test_no_dead_letters_is_a_calm_none_not_an_error(tmp_path):
    con, views = _archive_like(with_dead_letters=False)
    page = write_run_report(con, views, "run-1", tmp_path).read_text()
    css_class, inner = _section(page, "dead-letters")
    assert css_class != "alert"
    assert '<p class="none">None' in inner and "<img" not in inner
    assert all(_section(page, slug)[0] != "alert" for slug in re.findall(r'<section id="([^"]+)"', page))


def test_dead_letters_are_shown_in_red_with_what_was_refused(tmp_path):
    con, views = _archive_like(with_dead_letters=True)
    page = write_run_report(con, views, "run-1", tmp_path).read_text()
    css_class, inner = _section(page, "dead-letters")
    assert css_class == "alert"
    assert "<img" in inner and "mystery.v1" in inner  # the plot and the latest dead letters' reasons
    assert re.search(r"section\.alert[^{]*\{[^}]*#c00", page)  # the alert class is what makes it red


def test_every_plot_has_a_title_and_labelled_axes():
    con, views = _archive_like(with_dead_letters=True)
    sections = report_sections(con, views)
    assert all(section.figure is not None for section in sections)
    for section in sections:
        for ax in section.figure.axes:
            assert ax.get_title(), section.slug
            assert ax.get_xlabel(), section.slug
            assert ax.get_ylabel(), section.slug


def test_every_plot_is_in_the_page_with_its_axis_labels_as_alt_text(tmp_path):
    con, views = _archive_like(with_dead_letters=True)
    page = write_run_report(con, views, "run-1", tmp_path).read_text()
    alts = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)
    assert len(alts) == 7 and "no data" not in page
    assert "share of all trained tokens against staleness" in page


def test_the_reward_is_a_rolling_mean_over_faint_points():
    con, views = _archive_like(with_dead_letters=False)
    ax = _axes(report_sections(con, views), "reward")[0]
    (raw,) = ax.collections
    assert raw.get_alpha() < 0.5 and len(raw.get_offsets()) == 40
    (trend,) = ax.get_lines()
    assert "rolling mean" in trend.get_label()
    # The synthetic reward alternates +-0.1 around a slow rise: the rolling mean keeps (mostly) the rise.
    raw_steps = np.abs(np.diff(raw.get_offsets()[:, 1]))
    trend_steps = np.abs(np.diff(trend.get_ydata()))
    assert trend_steps.max() < raw_steps.min() / 2


def test_staleness_is_the_share_of_all_trained_tokens():
    con, views = _archive_like(with_dead_letters=False)
    ax = _axes(report_sections(con, views), "staleness")[0]
    shares = [bar.get_height() for bar in ax.patches]
    # 20 updates of 100 fresh tokens, 20 of 300 one-behind: weighted by tokens, not by updates.
    assert shares == pytest.approx([0.25, 0.75, 0, 0, 0, 0])
    assert "8,000 trained tokens" in ax.get_title()


def test_keyframes_and_patches_are_both_visible_on_a_log_axis():
    con, views = _archive_like(with_dead_letters=False)
    sizes, changed = _axes(report_sections(con, views), "download-sizes")
    assert sizes.get_yscale() == "log"
    labels = sizes.get_legend_handles_labels()[1]
    assert labels == ["bf16 patch", "bf16 keyframe"]
    (keyframes,) = sizes.collections
    assert len(keyframes.get_offsets()) == 5  # versions 0, 10, 20, 30, 40
    assert changed.get_lines()[0].get_ydata().max() == pytest.approx(1.2)  # patches only, in percent


def test_missing_views_say_so_instead_of_drawing():
    con = duckdb.connect()
    sections = report_sections(con, [])
    assert all(section.figure is None for section in sections)
    assert {section.note for section in sections if section.slug != "dead-letters"} == {"no data in the archive yet"}


def test_byte_ticks_are_human_readable():
    assert [human_bytes(v) for v in (512, 20_000, 2_000_000)] == ["512 B", "19.5 KiB", "1.91 MiB"]


def test_rolling_mean_shrinks_its_window_at_the_ends():
    assert rolling_mean(np.array([0.0, 2.0, 4.0, 6.0]), 3).tolist() == [1.0, 2.0, 4.0, 5.0]


def _axes(sections, slug):
    (section,) = [s for s in sections if s.slug == slug]
    return section.figure.axes
