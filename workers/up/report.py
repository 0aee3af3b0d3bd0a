"""`sprawl report`: one self-contained HTML page of a run's health, plots embedded as PNG.

Every plot reads the archive through the same DuckDB views as `sprawl sql`; a plot whose data is
missing says so in the page instead of drawing an empty frame.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import duckdb

from pipeline.audit import query


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _rows(con, views, sql: str, needs: tuple[str, ...]) -> list[tuple] | None:
    if not all(v in views for v in needs):
        return None
    return query(con, views, sql).fetchall()


def _plots(con: duckdb.DuckDBPyConnection, views: list[str]) -> list[tuple[str, list[tuple] | None, object]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def line(title, xs_ys: dict[str, tuple[list, list]], ylabel: str, logy: bool = False):
        fig, ax = plt.subplots(figsize=(7, 3))
        for label, (xs, ys) in xs_ys.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        if len(xs_ys) > 1:
            ax.legend()
        return fig

    def bars(title, labels, values, ylabel):
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.bar([str(label) for label in labels], values)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        return fig

    plots = []
    rows = _rows(con, views, "SELECT version, metrics.reward_mean FROM metrics ORDER BY version", ("metrics",))
    plots.append(
        (
            "Reward over updates",
            rows,
            lambda r: line("Reward (mean) per version", {"reward": ([x[0] for x in r], [x[1] for x in r])}, "reward"),
        )
    )
    rows = _rows(
        con,
        views,
        """SELECT g, version, CAST(json_extract(per_group, '$."' || g || '".kl_k3') AS DOUBLE)
                 FROM metrics, unnest(json_keys(per_group)) AS t(g) ORDER BY g, version""",
        ("metrics",),
    )

    def kl(r):
        series: dict[str, tuple[list, list]] = {}
        for group, version, value in r:
            series.setdefault(group, ([], []))
            series[group][0].append(version)
            series[group][1].append(value)
        return line("KL(mu || pi), k3 estimator, per island group", series, "k3")

    plots.append(("KL per island group", rows, kl))
    rows = _rows(
        con,
        views,
        """SELECT sum(metrics.staleness_0), sum(metrics.staleness_1), sum(metrics.staleness_2),
                 sum(metrics.staleness_3_4), sum(metrics.staleness_5_8), sum(metrics.staleness_9_plus) FROM metrics""",
        ("metrics",),
    )
    plots.append(
        (
            "Staleness distribution",
            rows if rows and rows[0][0] is not None else None,
            lambda r: bars(
                "Token staleness (share, summed over updates)", ["0", "1", "2", "3-4", "5-8", "9+"], list(r[0]), "share"
            ),
        )
    )
    rows = _rows(
        con,
        views,
        """SELECT version, v.kind, v.bytes, v.changed_elements / v.total_elements
                 FROM versions, unnest(views) AS u(v) WHERE v.view = 'bf16' ORDER BY version""",
        ("versions",),
    )

    def sizes(r):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
        patch = [(x[0], x[2]) for x in r if x[1] == "patch"]
        key = [(x[0], x[2]) for x in r if x[1] == "keyframe"]
        a.bar([p[0] for p in patch], [p[1] for p in patch], label="patch bytes")
        a.bar([k[0] for k in key], [k[1] for k in key], label="keyframe bytes")
        a.set_yscale("log")
        a.legend()
        a.set_title("Bytes per version (bf16 view)")
        b.plot([x[0] for x in r if x[1] == "patch"], [x[3] for x in r if x[1] == "patch"], marker="o")
        b.set_title("Changed fraction of served bits")
        return fig

    plots.append(("Patch size per version", rows, sizes))
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

    def propagation(r):
        series: dict[str, tuple[list, list]] = {}
        for island, version, seconds in r:
            series.setdefault(island, ([], []))
            series[island][0].append(version)
            series[island][1].append(max(seconds, 0.0))
        return line("Version propagation: first heartbeat at a version minus its append (s)", series, "seconds")

    plots.append(("Version propagation per island", rows, propagation))
    rows = _rows(
        con,
        views,
        """SELECT coalesce(error_class, 'ok'), count(*) FROM rewards GROUP BY ALL ORDER BY 2 DESC""",
        ("rewards",),
    )
    plots.append(
        (
            "Sandbox / verifier outcomes",
            rows,
            lambda r: bars("Reward outcomes by error class", [x[0] for x in r], [x[1] for x in r], "count"),
        )
    )
    rows = _rows(
        con,
        views,
        """SELECT stream || ': ' || error_class, count(*) FROM dead_letters GROUP BY ALL""",
        ("dead_letters",),
    )
    plots.append(
        (
            "Dead letters",
            rows,
            lambda r: bars("Dead letters by stream and class", [x[0] for x in r], [x[1] for x in r], "count"),
        )
    )
    return plots


def write_report(con: duckdb.DuckDBPyConnection, views: list[str], run_id: str, output: Path) -> Path:
    sections = []
    for title, rows, draw in _plots(con, views):
        if not rows:
            body = "<p class='empty'>no data in the archive yet</p>"
        else:
            body = f"<img alt='{html.escape(title)}' src='data:image/png;base64,{_png(draw(rows))}'/>"
        sections.append(f"<section><h2>{html.escape(title)}</h2>{body}</section>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>sprawl run {html.escape(run_id)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}} .empty{{color:#a00}}</style></head>
<body><h1>sprawl run <code>{html.escape(run_id)}</code></h1>{"".join(sections)}</body></html>"""
    output.write_text(page)
    return output
