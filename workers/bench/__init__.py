"""`sprawl bench <name>`: benchmarks as commands, reporting ratios against a baseline from the same run."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

BENCHES = ("log", "delta", "sync", "trainer", "sandbox", "audit")


def run_bench(name: str, *, quick: bool, as_json: bool) -> int:
    if name == "log":
        from workers.bench.log_bench import bench_log

        rows, summary = bench_log(quick=quick)
    elif name == "delta":
        from workers.bench.delta_bench import bench_delta

        rows, summary = bench_delta(quick=quick)
    elif name == "sync":
        from workers.bench.sync_bench import bench_sync

        rows, summary = bench_sync(quick=quick)
    elif name == "trainer":
        from workers.bench.trainer_bench import bench_trainer

        rows, summary = bench_trainer(quick=quick)
    elif name == "sandbox":
        from workers.bench.sandbox_bench import bench_sandbox

        rows, summary = bench_sandbox(quick=quick)
    elif name == "audit":
        from workers.bench.audit_bench import bench_audit

        rows, summary = bench_audit(quick=quick)
    else:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHES)}")
    console = Console(width=max(160, Console().width))
    table = Table(title=f"sprawl bench {name}")
    for column in rows[0]:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    console.print(table)
    if as_json:
        print(json.dumps(summary, sort_keys=True))
    return 0
