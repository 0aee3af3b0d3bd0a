"""`sprawl bench <name>`: benchmarks as commands, reporting ratios against a baseline from the same run.

A benchmark is a module here with a `bench_<name>(quick: bool) -> (rows, summary)` function and one
entry in `BENCHES`; `sprawl bench` takes its choices from there.
"""

from __future__ import annotations

import importlib
import json

BENCHES: dict[str, str] = {
    "log": "workers.bench.log_bench:bench_log",
    "delta": "workers.bench.delta_bench:bench_delta",
    "sync": "workers.bench.sync_bench:bench_sync",
    "trainer": "workers.bench.trainer_bench:bench_trainer",
    "sandbox": "workers.bench.sandbox_bench:bench_sandbox",
    "audit": "workers.bench.audit_bench:bench_audit",
    "faults": "workers.bench.faults_bench:bench_faults",
    "failover": "workers.bench.failover_bench:bench_failover",
}
"""Name -> `module:function` (imported only when that benchmark runs)."""


def run_bench(name: str, *, quick: bool, as_json: bool, wan: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    from pipeline.errors import SprawlError

    if name not in BENCHES:
        raise SprawlError(f"unknown benchmark {name!r}", hint=f"choose one of {', '.join(BENCHES)}")
    if wan and name != "sync":
        raise SprawlError(f"--wan is an option of `sprawl bench sync`, not of {name!r}")
    module, _, function = BENCHES[name].partition(":")
    bench = getattr(importlib.import_module(module), function)
    rows, summary = bench(quick=quick, wan=True) if wan else bench(quick=quick)
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
