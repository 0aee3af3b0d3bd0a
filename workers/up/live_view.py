"""The live terminal view of `sprawl up` (rich), and the plain progress line when there is no terminal."""

from __future__ import annotations

import time

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from workers.up.monitor import RunState, ServiceHealth
from workers.up.supervisor import Supervisor
from workers.up.watchdog import Stall

_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60, low: float = 0.0, high: float = 1.0) -> str:
    """Values resampled to `width` buckets (bucket means), drawn as block characters between low and high."""
    if not values:
        return ""
    buckets = max(1, min(width, len(values)))
    out = []
    for b in range(buckets):
        lo = b * len(values) // buckets
        chunk = values[lo : max(lo + 1, (b + 1) * len(values) // buckets)]
        mean = sum(chunk) / len(chunk)
        level = (mean - low) / (high - low) if high > low else 0.0
        out.append(_BLOCKS[min(len(_BLOCKS) - 1, max(0, int(level * len(_BLOCKS))))])
    return "".join(out)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _latest(state: RunState, key: str) -> float | None:
    for m in reversed(state.metrics):
        if key in m.metrics:
            return m.metrics[key]
    return None


def _island_kl(state: RunState, island_id: str, group: str) -> float | None:
    """The island's KL as the drift guard judges it (windowed), else its group's KL of the last update."""
    for m in reversed(state.metrics):
        if "window_kl_k3" in m.per_island.get(island_id, {}):
            return m.per_island[island_id]["window_kl_k3"]
        if group in m.per_group and "kl_k3" in m.per_group[group]:
            return m.per_group[group]["kl_k3"]
    return None


def drift_line(state: RunState) -> Text:
    """The drift guard's flagged islands, each with its KL against the baseline it was judged by."""
    flagged = state.flagged_islands()
    if not flagged:
        return Text("no island flagged", style="green")
    line = Text()
    for index, d in enumerate(flagged):
        if index:
            line.append(", ")
        line.append(
            f"{d.island_id} FLAGGED{' + QUARANTINED' if d.quarantined else ''} since v{d.version} "
            f"(KL {d.kl_k3:.2e} vs baseline {d.baseline_kl_k3:.2e})",
            style="bold red",
        )
    return line


def services_line(services: list[ServiceHealth]) -> Text:
    """Each service's state: an outage shows in red with how long it has lasted."""
    line = Text()
    for index, service in enumerate(services):
        if index:
            line.append("  ·  ")
        if service.up:
            line.append(f"{service.name}: up", style="green")
        else:
            line.append(f"{service.name}: UNREACHABLE for {time.time() - service.since:.0f}s", style="bold red")
    return line


def render(
    state: RunState,
    supervisor: Supervisor | None,
    *,
    phase: str,
    target: int | None,
    services: list[ServiceHealth] | None = None,
    stall: Stall | None = None,
) -> Group:
    elapsed = time.time() - state.started_at
    head = state.head
    header = Text.assemble(
        ("sprawl up ", "bold"),
        (f"run {state.run_id}", "cyan"),
        f"  ·  {phase}  ·  {elapsed:,.0f}s",
    )

    trainer = Table.grid(padding=(0, 2))
    trainer.add_column(style="dim")
    trainer.add_column()
    step_times = [m.metrics["update_s"] for m in state.metrics[-10:] if "update_s" in m.metrics]
    recent = [v for _, v in sorted(state.versions.items())[-11:]]  # the last 10 updates
    span_s = recent[-1].at - recent[0].at if len(recent) > 1 else 0.0
    per_version = span_s / (len(recent) - 1) if span_s > 0 else None
    trainer.add_row("version", f"{head if head is not None else '-'}" + (f" / {target}" if target is not None else ""))
    trainer.add_row(
        "step time",
        (f"{sum(step_times) / len(step_times):.2f}s update" if step_times else "-")
        + (f", {per_version:.2f}s per version" if per_version else ""),
    )
    stale = _latest(state, "staleness_mean")
    if per_version is not None:
        samples = sum(v.consumed for v in recent[1:]) / span_s
        trainer.add_row("throughput", f"{samples:.0f} trained samples/s")
    trainer.add_row("staleness", f"{stale:.2f} versions (mean, last update)" if stale is not None else "-")
    reward = _latest(state, "reward_mean")
    trainer.add_row("reward", f"{reward:.3f} (last update)" if reward is not None else "-")
    patch, full, _ = state.bytes_totals()
    trainer.add_row(
        "bytes",
        f"patches {human_bytes(patch)} vs full checkpoints {human_bytes(full)}"
        + (f" ({patch / full:.1%})" if full else ""),
    )
    letters = sum(state.dead_letters.values())
    trainer.add_row(
        "dead letters",
        (f"{letters} " + ", ".join(f"{k}: {v}" for k, v in state.dead_letters.items())) if letters else "0",
    )
    trainer.add_row("dropped groups", str(state.dropped_groups))
    trainer.add_row("drift", drift_line(state))

    islands = Table("island", "view", "serving", "state", "tok/s", "trajectories", "KL k3", "drift", expand=False)
    for island in sorted(state.islands.values(), key=lambda i: i.island_id):
        kl = _island_kl(state, island.island_id, island.group)
        verdict = state.drift.get(island.island_id)
        flagged = verdict is not None and verdict.state == "flagged"
        islands.add_row(
            island.island_id,
            island.view,
            "-" if island.version is None else f"v{island.version}",
            island.state,
            f"{island.tokens_per_s:.0f}",
            str(state.trajectories_by_island.get(island.island_id, 0)),
            "-" if kl is None else f"{kl:.2e}",
            Text("QUARANTINED" if flagged and verdict.quarantined else "FLAGGED", style="bold red")
            if flagged
            else Text("ok", style="green"),
        )

    curve = [r for _, r in state.reward_curve()]
    reward_panel = Text(sparkline(curve, width=50) or "(no updates yet)")
    if len(curve) >= 5:
        k = max(1, len(curve) // 5)
        first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
        reward_panel.append(f"  first fifth {first:.2f} → last fifth {last:.2f}  ({len(curve)} updates)", style="dim")

    parts: list = [header]
    if services:
        parts.append(services_line(services))
    if stall is not None:
        parts.append(Panel(Text(stall.line(), style="bold red"), title="STALLED", title_align="left", style="red"))
    parts += [
        Panel(trainer, title="trainer", title_align="left"),
        Panel(islands, title="islands", title_align="left"),
        Panel(reward_panel, title="reward per update (0 to 1)", title_align="left"),
    ]
    if supervisor is not None:
        workers = Table("worker", "state", "pid", "restarts", "last exit", expand=False)
        for worker in supervisor.workers.values():
            pid = worker.process.pid if worker.process is not None else "-"
            last = "-" if worker.last_exit is None else f"{worker.last_exit}: {worker.last_reason or '(no output)'}"
            workers.add_row(worker.spec.name, worker.state, str(pid), str(worker.restarts), last[:100])
        events = "\n".join(supervisor.events[-3:])
        parts.append(Panel(Group(workers, Text(events, style="yellow")) if events else workers, title="workers"))
    return Group(*parts)


def progress_line(
    state: RunState,
    *,
    phase: str,
    target: int | None,
    services: list[ServiceHealth] | None = None,
    stall: Stall | None = None,
) -> str:
    """One line for logs and non-terminals (an outage and a stall are on it too)."""
    reward = _latest(state, "reward_mean")
    down = [f"{s.name} UNREACHABLE for {time.time() - s.since:.0f}s" for s in services or [] if not s.up]
    flagged = [d.island_id for d in state.flagged_islands()]
    return (
        f"[{time.time() - state.started_at:6.0f}s] {phase}: version {state.head}/{target}, "
        f"reward {reward if reward is None else round(reward, 3)}, "
        f"trajectories {dict(state.trajectories_by_view)}, dead letters {sum(state.dead_letters.values())}"
        + (f"; drift guard flagged {', '.join(flagged)}" if flagged else "")
        + "".join(f"; {d}" for d in down)
        + (f"; {stall.line()}" if stall is not None else "")
    )
