"""`sprawl report`: one self-contained HTML page of a run's health, plots embedded as PNG.

Every plot reads the archive through the same DuckDB views as `sprawl sql`; a plot whose data is
missing says so in the page instead of drawing an empty frame. The page lands in the run's folder
beside `up`'s logs, never in whatever folder the command was started from.

The work is split so each step can be checked on its own: `report_sections` queries and draws
(matplotlib figures, not yet rendered), `render_page` turns sections into HTML, and
`write_run_report` puts the page in a folder.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator, PercentFormatter

from pipeline.audit import query
from pipeline.sql import printable

REPORT_FILE_NAME = "report.html"

# Applied while figures are drawn and saved: readable at the page's width without zooming.
_STYLE = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
_WIDE = (11.0, 4.8)
_TWO_PANELS = (13.0, 4.8)

STALENESS_BUCKETS = {
    "staleness_0": "0",
    "staleness_1": "1",
    "staleness_2": "2",
    "staleness_3_4": "3-4",
    "staleness_5_8": "5-8",
    "staleness_9_plus": "9+",
}
"""The trainer's per-update staleness histogram (share of that update's tokens per bucket), as labels."""


@dataclass
class Section:
    """One part of the page: a title, a figure (or nothing to draw), and a note."""

    slug: str
    """The section's HTML id."""
    title: str
    figure: Figure | None = None
    note: str = ""
    """Shown under the title: what the plot means, or why there is nothing to draw."""
    note_class: str = "note"
    """How the note looks: `note`, `empty` (no data yet, grey) or `none` (nothing went wrong, green)."""
    alert: bool = False
    """Something needs attention (dead letters): the section is shown in red."""
    table_html: str = ""


def run_folder(state_dir: Path, run_id: str) -> Path:
    """A run's folder, as `sprawl up` lays it out: `<state_dir>/runs/<run_id>` (logs, report)."""
    return state_dir.resolve() / "runs" / run_id


def write_run_report(con: duckdb.DuckDBPyConnection, views: list[str], run_id: str, output_dir: Path) -> Path:
    """Write `<output_dir>/report.html` (creating the folder) and return its path.

    `output_dir` is explicit so no caller falls back on the current folder; the run's own folder
    is `run_folder(settings.state_dir, run_id)`.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    return write_report(con, views, run_id, output_dir / REPORT_FILE_NAME)


def write_report(con: duckdb.DuckDBPyConnection, views: list[str], run_id: str, output: Path) -> Path:
    """Write the page to exactly `output` (a file path). Prefer `write_run_report`."""
    with matplotlib.rc_context(_STYLE):
        page = render_page(run_id, report_sections(con, views))
    output.write_text(page)
    return output


# ------------------------------------------------------------------ sections


def report_sections(con: duckdb.DuckDBPyConnection, views: list[str]) -> list[Section]:
    """Every section of the page, in order, with its figure drawn but not yet rendered."""
    builders: list[Callable[[duckdb.DuckDBPyConnection, list[str]], Section]] = [
        _reward,
        _kl,
        _staleness,
        _download_sizes,
        _propagation,
        _reward_outcomes,
        _dead_letters,
    ]
    sections = [build(con, views) for build in builders]
    if "stability" in views:  # only an experiment's archive has this section's data
        sections.insert(0, _stability(con, views))
    return sections


def _rows(con, views, sql: str, needs: tuple[str, ...]) -> list[tuple] | None:
    """The query's rows, or None when a view it reads is not in the archive (yet)."""
    if not all(v in views for v in needs):
        return None
    return query(con, views, sql).fetchall()


def _no_data(slug: str, title: str) -> Section:
    return Section(slug, title, note="no data in the archive yet", note_class="empty")


def _reward(con, views) -> Section:
    slug, title = "reward", "Reward over updates"
    rows = _rows(
        con,
        views,
        "SELECT version, metrics.reward_mean FROM metrics WHERE metrics.reward_mean IS NOT NULL ORDER BY version",
        ("metrics",),
    )
    if not rows:
        return _no_data(slug, title)
    versions = np.array([r[0] for r in rows], dtype=float)
    rewards = np.array([r[1] for r in rows], dtype=float)
    window = rolling_window(len(rewards))
    fig = Figure(figsize=_WIDE, layout="constrained")
    ax = fig.subplots()
    # One update's mean reward is noisy (a handful of prompt groups): faint points for each, the
    # rolling mean on top for the trend.
    ax.scatter(versions, rewards, s=12, alpha=0.3, color="tab:blue", label="one update")
    ax.plot(versions, rolling_mean(rewards, window), color="tab:blue", linewidth=2.2, label=_window_label(window))
    ax.set_title("Mean reward per update")
    ax.set_xlabel("policy version (one per optimizer update)")
    ax.set_ylabel("reward (verifier score, mean over the update)")
    ax.legend(loc="best")
    return Section(slug, title, fig)


def rolling_window(n: int) -> int:
    """About a tenth of the run, 1 to 25 updates: smooths without hiding the trend. Odd, so a centred
    window has as many updates on each side."""
    return max(1, min(25, n // 10)) | 1


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling mean; near the ends the window shrinks to what exists instead of padding."""
    half = window // 2
    return np.array([values[max(0, i - half) : i + window - half].mean() for i in range(len(values))])


def _window_label(window: int) -> str:
    return "rolling mean" if window == 1 else f"rolling mean ({window} updates)"


def _kl(con, views) -> Section:
    slug, title = "kl", "KL per island group"
    rows = _rows(
        con,
        views,
        """SELECT g, version, CAST(json_extract(per_group, '$."' || g || '".kl_k3') AS DOUBLE) AS kl
           FROM metrics, unnest(json_keys(per_group)) AS t(g) ORDER BY g, version""",
        ("metrics",),
    )
    rows = [r for r in rows or [] if r[2] is not None]
    if not rows:
        return _no_data(slug, title)
    fig = Figure(figsize=_WIDE, layout="constrained")
    ax = fig.subplots()
    for group, (versions, values) in _series(rows).items():
        ax.plot(versions, values, marker="o", markersize=3, linewidth=1.2, label=group)
    ax.set_title("Sampler-trainer mismatch, KL(sampler || trainer), per island group")
    ax.set_xlabel("policy version (one per optimizer update)")
    ax.set_ylabel("KL, k3 estimator (nats per token)")
    ax.legend(title="island group", loc="best")
    return Section(
        slug,
        title,
        fig,
        note="Each island group serves one precision; a group whose KL climbs drifts from the trainer.",
    )


def _stability(con, views) -> Section:
    """The stability experiment's table and curves, from its `stability_result.v1` events."""
    from workers.experiment.collapse import RunOutcome
    from workers.experiment.plots import RunCurves, stability_figure
    from workers.experiment.stability import CORRECTIONS, PlannedRun, Recorded, relative_rows, summarize

    slug, title = "stability", "Stability experiment: collapse by fleet and correction"
    rows = _rows(
        con,
        views,
        # A cell's seed recorded twice (an experiment continued with another rule, a retried append)
        # counts once: its newest record.
        """SELECT fleet, correction, seed, updates, collapsed, updates_to_collapse, start_reward, final_reward,
                  kl_mean, series, collapse_rule
           FROM stability
           QUALIFY row_number() OVER (PARTITION BY fleet, correction, seed ORDER BY produced_at DESC) = 1
           ORDER BY fleet, correction, seed""",
        ("stability",),
    )
    if not rows:
        return _no_data(slug, title)

    def nan(value) -> float:
        return math.nan if value is None else float(value)

    recorded = []
    for r in rows:
        series = json.loads(r[9]) if isinstance(r[9], str) else dict(r[9] or {})
        curves = {name: [nan(v) for v in values] for name, values in series.items()}
        recorded.append(
            Recorded(PlannedRun(r[0], r[1], r[2]), RunOutcome(r[3], r[4], r[5], r[6], nan(r[7]), nan(r[8])), curves)
        )
    cells = relative_rows(summarize(recorded))
    fig = stability_figure(
        [RunCurves(r.run.fleet, r.run.correction, r.run.seed, r.series) for r in recorded],
        [c for c in CORRECTIONS if any(r.run.correction == c for r in recorded)],
    )
    columns = ["fleet", "correction", "collapsed", "updates to collapse", "final reward", "mean KL", "vs baseline"]
    table = [
        (
            c["fleet"],
            c["correction"],
            f"{c['collapsed']}/{c['seeds']}",
            "-" if c["updates_to_collapse"] is None else f"{c['updates_to_collapse']:.0f}",
            f"{c['final_reward_mean']:.3f} ± {c['final_reward_sd']:.3f}",
            f"{c['kl_mean']:.2e}",
            "-" if c["final_reward_vs_baseline"] is None else f"{c['final_reward_vs_baseline']:.2f}x reward",
        )
        for c in cells
    ]
    return Section(
        slug,
        title,
        fig,
        note=f"Rule: {rows[0][10]}. Mean over seeds; the band spans the lowest to the highest seed.",
        table_html=_table(columns, table),
    )


def _series(rows: list[tuple]) -> dict[str, tuple[list, list]]:
    """(name, x, y) rows to one (xs, ys) series per name."""
    series: dict[str, tuple[list, list]] = {}
    for name, x, y in rows:
        xs, ys = series.setdefault(name, ([], []))
        xs.append(x)
        ys.append(y)
    return series


def _staleness(con, views) -> Section:
    slug, title = "staleness", "Staleness distribution"
    # Each update reports the share of *its* tokens per bucket; weighting those shares by the
    # update's token count gives the share of all trained tokens, which sums to 1.
    weighted = ", ".join(f"CAST(sum(metrics.tokens * metrics.{column}) AS DOUBLE)" for column in STALENESS_BUCKETS)
    rows = _rows(con, views, f"SELECT {weighted}, CAST(sum(metrics.tokens) AS DOUBLE) FROM metrics", ("metrics",))
    if not rows or not rows[0][-1] or rows[0][0] is None:
        return _no_data(slug, title)
    *bucket_tokens, total = rows[0]
    shares = [(tokens or 0.0) / total for tokens in bucket_tokens]
    fig = Figure(figsize=_WIDE, layout="constrained")
    ax = fig.subplots()
    bars = ax.bar(list(STALENESS_BUCKETS.values()), shares, color="tab:purple")
    ax.bar_label(bars, labels=[f"{share:.1%}" for share in shares], padding=2)
    ax.set_ylim(0, min(1.0, max(shares) * 1.15) or 1.0)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(f"Token staleness over the run ({int(total):,} trained tokens)")
    ax.set_xlabel("staleness (trainer version minus the version that sampled the token)")
    ax.set_ylabel("share of all trained tokens")
    return Section(slug, title, fig)


def _download_sizes(con, views) -> Section:
    slug, title = "download-sizes", "Patch and keyframe size per version"
    rows = _rows(
        con,
        views,
        """SELECT v.view, v.kind, version, v.bytes, v.changed_elements / v.total_elements
           FROM versions, unnest(views) AS u(v) ORDER BY v.view, version""",
        ("versions",),
    )
    if not rows:
        return _no_data(slug, title)
    fig = Figure(figsize=_TWO_PANELS, layout="constrained")
    sizes, changed = fig.subplots(1, 2)
    for index, view in enumerate(sorted({r[0] for r in rows})):
        color = f"C{index}"
        patches = [r for r in rows if r[0] == view and r[1] == "patch"]
        keyframes = [r for r in rows if r[0] == view and r[1] == "keyframe"]
        # Keyframes are few and orders of magnitude larger than patches: big outlined markers on a
        # log axis keep both visible (bars from zero would hide one or the other).
        if patches:
            sizes.plot(
                [r[2] for r in patches],
                [r[3] for r in patches],
                "o-",
                color=color,
                markersize=3,
                linewidth=1,
                label=f"{view} patch",
            )
            changed.plot(
                [r[2] for r in patches], [100.0 * r[4] for r in patches], "o-", color=color, markersize=3, label=view
            )
        sizes.scatter(
            [r[2] for r in keyframes],
            [r[3] for r in keyframes],
            marker="D",
            s=70,
            color=color,
            edgecolors="black",
            zorder=3,
            label=f"{view} keyframe",
        )
    sizes.set_yscale("log")
    # Ticks at powers of two read as round sizes (16 KiB, 2 MiB); powers of ten would not.
    sizes.yaxis.set_major_locator(LogLocator(base=2, numticks=12))
    sizes.yaxis.set_minor_locator(NullLocator())
    sizes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value)))
    sizes.set_title("Download size per version: keyframes vs patches")
    sizes.set_xlabel("policy version")
    sizes.set_ylabel("bytes a sampler downloads (log scale)")
    sizes.legend(loc="best")
    changed.set_title("Served elements whose bits changed (patches)")
    changed.set_xlabel("policy version")
    changed.set_ylabel("changed elements (% of the view's elements)")
    if changed.lines:
        changed.legend(title="view", loc="best")
    else:
        changed.text(0.5, 0.5, "no patches yet", transform=changed.transAxes, ha="center", color="grey")
    return Section(slug, title, fig)


def human_bytes(value: float) -> str:
    """A byte count for an axis tick: 512 B, 1.5 KiB, 3 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def _propagation(con, views) -> Section:
    slug, title = "propagation", "Version propagation per island"
    rows = _rows(
        con,
        views,
        """WITH first_serve AS (
               SELECT island.island_id AS island, current_version AS version, min(produced_at) AS t
               FROM islands WHERE current_version IS NOT NULL GROUP BY ALL)
           SELECT f.island, f.version, epoch(f.t) - epoch(v.produced_at) FROM first_serve f
           JOIN versions v ON v.version = f.version ORDER BY f.island, f.version""",
        ("islands", "versions"),
    )
    if not rows:
        return _no_data(slug, title)
    fig = Figure(figsize=_WIDE, layout="constrained")
    ax = fig.subplots()
    for island, (versions, seconds) in _series(rows).items():
        # Island and trainer clocks are different hosts': a negative lag is skew, drawn as 0.
        ax.plot(versions, [max(s, 0.0) for s in seconds], marker="o", markersize=3, linewidth=1.2, label=island)
    ax.set_title("Time from a version's append to an island serving it")
    ax.set_xlabel("policy version")
    ax.set_ylabel("seconds to first heartbeat at the version")
    ax.legend(title="island", loc="best")
    return Section(
        slug, title, fig, note="Heartbeats are periodic: each point is late by up to one heartbeat interval."
    )


def _reward_outcomes(con, views) -> Section:
    slug, title = "reward-outcomes", "Sandbox / verifier outcomes"
    rows = _rows(
        con,
        views,
        "SELECT coalesce(error_class, 'ok'), count(*) FROM rewards GROUP BY ALL ORDER BY 2 DESC, 1",
        ("rewards",),
    )
    if not rows:
        return _no_data(slug, title)
    fig = _count_bars(
        [r[0] for r in rows],
        [r[1] for r in rows],
        title="Reward outcomes by error class",
        xlabel="verifier outcome (ok: ran to completion, else its error class)",
        ylabel="rewards (count)",
        color="tab:green",
    )
    return Section(slug, title, fig)


def _dead_letters(con, views) -> Section:
    slug, title = "dead-letters", "Dead letters"
    # The archive has a view per event type it has seen: no view means no dead letter was ever written.
    rows = _rows(
        con, views, "SELECT stream || ': ' || error_class, count(*) FROM dead_letters GROUP BY ALL", ("dead_letters",)
    )
    if not rows:
        return Section(slug, title, note="None: every message was handled by its consumer.", note_class="none")
    total = sum(r[1] for r in rows)
    fig = _count_bars(
        [r[0] for r in rows],
        [r[1] for r in rows],
        title="Dead letters by stream and error class",
        xlabel="stream: error class",
        ylabel="dead letters (count)",
        color="tab:red",
    )
    latest = query(
        con,
        views,
        """SELECT produced_at, stream, consumer, error_class, original_subject, reason
           FROM dead_letters ORDER BY produced_at DESC LIMIT 20""",
    )
    # Subjects and reasons carry bytes a hostile producer chose: escaped and cut before they reach the page.
    shown = [(*row[:4], printable(row[4].encode(), 120), printable(row[5].encode(), 160)) for row in latest.fetchall()]
    return Section(
        slug,
        title,
        fig,
        note=f"{total} message(s) were refused for good; `sprawl audit dead-letters` lists them all.",
        alert=True,
        table_html=_table(latest.columns, shown),
    )


def _count_bars(labels: list, counts: list, *, title: str, xlabel: str, ylabel: str, color: str) -> Figure:
    fig = Figure(figsize=_WIDE, layout="constrained")
    ax = fig.subplots()
    bars = ax.bar([str(label) for label in labels], counts, color=color, width=0.6)
    ax.bar_label(bars, padding=2)
    ax.margins(y=0.12)
    spare = max(0.0, (4 - len(labels)) / 2)  # one or two bars keep a bar's width, centred
    ax.set_xlim(-0.5 - spare, len(labels) - 0.5 + spare)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig


# ------------------------------------------------------------------ the page

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1300px; margin: 2em auto; padding: 0 1em; color: #222; }
section { margin: 2em 0; padding-left: 1em; border-left: 4px solid #ddd; }
section.alert { border-left-color: #c00; }
section.alert h2 { color: #c00; }
img { max-width: 100%; height: auto; }
.note { color: #555; }
.empty { color: #777; font-style: italic; }
.none { color: #2a7a2a; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; }
"""


def render_page(run_id: str, sections: list[Section]) -> str:
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = "".join(_render_section(section) for section in sections)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>sprawl run {html.escape(run_id)}</title>
<style>{_CSS}</style></head>
<body><h1>sprawl run <code>{html.escape(run_id)}</code></h1>
<p class="note">Generated {generated} from the run's Parquet archive (the same views as <code>sprawl sql</code>).</p>
{body}</body></html>"""


def _render_section(section: Section) -> str:
    css_class = "alert" if section.alert else "ok"
    parts = [f'<section id="{section.slug}" class="{css_class}"><h2>{html.escape(section.title)}</h2>']
    if section.note:
        parts.append(f'<p class="{section.note_class}">{html.escape(section.note)}</p>')
    if section.figure is not None:
        alt = html.escape(describe_axes(section.figure), quote=True)
        parts.append(f'<img alt="{alt}" src="data:image/png;base64,{_png(section.figure)}"/>')
    parts.append(section.table_html)
    parts.append("</section>")
    return "".join(parts)


def describe_axes(fig: Figure) -> str:
    """The figure's titles and axis labels, as the image's alt text."""
    return " | ".join(f"{ax.get_title()}: {ax.get_ylabel()} against {ax.get_xlabel()}" for ax in fig.axes)


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode()


def _table(columns: list[str], rows: list[tuple]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
