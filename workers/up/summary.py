"""The end-of-run summary of `sprawl up`: the figures as a dict (for `--json`) and as text."""

from __future__ import annotations

from pathlib import Path

from workers.up.live_view import human_bytes
from workers.up.monitor import RunState
from workers.up.supervisor import Supervisor

SQL_SUGGESTIONS = [
    (
        "trajectories and reward by island view",
        "SELECT t.island.view AS view, count(*) AS trajectories, round(avg(r.value), 3) AS reward "
        "FROM trajectories t JOIN rewards r USING (trajectory_id) GROUP BY 1",
    ),
    (
        "bytes shipped per version and view",
        "SELECT version, v.view, v.kind, v.bytes FROM versions, unnest(views) AS u(v) ORDER BY version DESC LIMIT 10",
    ),
    (
        "staleness of what each update trained on",
        "SELECT version, round(metrics.staleness_mean, 2) AS staleness, round(metrics.reward_mean, 3) AS reward "
        "FROM metrics ORDER BY version DESC LIMIT 10",
    ),
]


def summarize(
    state: RunState,
    supervisor: Supervisor,
    options,
    *,
    wall_s: float,
    report: Path | None,
    start_version: int,
    interrupted: bool,
) -> tuple[dict, str]:
    comparison = state.comparison()
    patch, full, shipped = state.bytes_totals()
    islands = []
    for name, worker in supervisor.workers.items():
        if name.startswith("sampler-"):
            island_id = name.removeprefix("sampler-")
            view = worker.spec.labels.get("view", "")
            islands.append({"island": island_id, "view": view})
    per_view = dict(state.trajectories_by_view)
    for island in islands:
        island["trajectories"] = state.trajectories_by_island.get(island["island"], 0)
    trained_views = sorted(
        {g for m in state.metrics for g in m.per_group}  # sampler groups (views) the updates trained on
    )
    summary = {
        "run_id": state.run_id,
        "versions": state.head or 0,
        "versions_this_run": (state.head or 0) - start_version,
        "reward_first": None if comparison is None else round(comparison.first, 4),
        "reward_last": None if comparison is None else round(comparison.last, 4),
        "reward_ci": None if comparison is None else round(comparison.ci, 4),
        "learned": None if comparison is None else comparison.improved,
        "groups_compared": None if comparison is None else [comparison.groups_first, comparison.groups_last],
        "islands": islands,
        "trained_views": trained_views,
        "trajectories_by_view": per_view,
        "rewards": state.rewards_seen,
        "patch_bytes": patch,
        "keyframe_bytes": full,
        "shipped_bytes": shipped,
        "dead_letters": sum(state.dead_letters.values()),
        "dropped_groups": state.dropped_groups,
        "restarts": {name: w.restarts for name, w in supervisor.workers.items()},
        "report": None if report is None else str(report),
        "interrupted": interrupted,
        "wall_s": round(wall_s, 1),
    }
    lines = [
        "",
        ("interrupted" if interrupted else "finished")
        + f": run {state.run_id}, {summary['versions_this_run']} versions this time (head v{summary['versions']}), "
        f"{wall_s:.0f}s",
    ]
    if comparison is None:
        lines.append("reward: too few updates to compare")
    else:
        verdict = "improved beyond the CI" if comparison.improved else "no change beyond the CI"
        lines.append(
            f"reward: first 20% of updates {comparison.first:.3f}, last 20% {comparison.last:.3f} "
            f"({comparison.last - comparison.first:+.3f} ± {comparison.ci:.3f}, 95% CI over "
            f"{comparison.groups_first}+{comparison.groups_last} groups): {verdict}"
        )
    lines.append(
        "islands: " + ", ".join(f"{i['island']} ({i['view']}) {i['trajectories']} trajectories" for i in islands)
    )
    if full:
        lines.append(
            f"bytes: patches {human_bytes(patch)} vs {human_bytes(full)} as full checkpoints "
            f"({patch / full:.1%}); {human_bytes(shipped)} shipped in all, keyframes included"
        )
    restarts = sum(summary["restarts"].values())
    lines.append(
        f"dead letters: {summary['dead_letters']}, dropped groups: {summary['dropped_groups']}, "
        f"worker restarts: {restarts}"
    )
    if report is not None:
        lines.append(f"report: {report}")
    lines.append("try:")
    for what, sql in SQL_SUGGESTIONS:
        lines += [f"  # {what}", f'  just sql "{sql}"']
    return summary, "\n".join(lines)
