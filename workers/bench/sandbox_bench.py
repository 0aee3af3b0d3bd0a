"""`sprawl bench sandbox`: start latency cold and warm, throughput, the cost of hardening, and the
hostile catalogue.

All in one run: a plain `python -c` subprocess is the baseline for bubblewrap's overhead; cold
starts spawn a sandbox per program; warm runs take one from the pool, hardened (cgroup, seccomp,
scratch tmpfs, fresh keyring) and, as the baseline for what hardening costs, without it;
throughput runs trivial programs with the pool sized to the 2 cores; the hostile catalogue counts
what stayed contained and every wrong answer that scored above 0 (`reward_hacks_scored`).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from pipeline.sandbox import SandboxSettings
from pipeline.sandbox.bubblewrap import BwrapSandboxPool
from pipeline.sandbox.unsandboxed import UnsandboxedRunner

TRIVIAL = "print(sum(range(1000)))"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _plain(n: int, settings: SandboxSettings) -> list[float]:
    runner = UnsandboxedRunner(settings, warn=False)  # the benchmark's baseline, not a verifier
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = await runner.run(TRIVIAL)
        assert result.error_class is None, result.stderr
        times.append(time.perf_counter() - t0)
    return times


async def _cold(n: int, settings: SandboxSettings) -> list[float]:
    pool = BwrapSandboxPool(settings.model_copy(update={"pool_size": 0}))
    await pool.start()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = await pool.run(TRIVIAL)
        assert result.error_class is None, result.stderr
        times.append(time.perf_counter() - t0)
    await pool.close()
    return times


async def _warm_latency(n: int, settings: SandboxSettings, *, hardened: bool) -> list[float]:
    pool = BwrapSandboxPool(settings.model_copy(update={"pool_size": 2}), hardened=hardened)
    await pool.start()
    times = []
    for _ in range(n):
        while pool._ready.empty():  # measure the warm path: wait until the pool has refilled
            await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        result = await pool.run(TRIVIAL)
        assert result.error_class is None, result.stderr
        times.append(time.perf_counter() - t0)
        await pool.settled()  # each warm run on a quiet pool: the previous one's clean-up is not counted
    await pool.close()
    return times


async def _throughput(n: int, settings: SandboxSettings) -> float:
    concurrency = os.cpu_count() or 2
    pool = BwrapSandboxPool(settings.model_copy(update={"pool_size": concurrency * 2}))
    await pool.start()
    await asyncio.sleep(1.0)
    total = n * 2
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await pool.run(TRIVIAL)

    await asyncio.gather(*(one() for _ in range(total)))
    rate = total / (time.perf_counter() - t0)
    await pool.close()
    return rate


def bench_sandbox(quick: bool) -> tuple[list[dict], dict]:
    settings = SandboxSettings(wall_timeout_s=5, cpu_seconds=2)
    n = 20 if quick else 100

    async def main() -> dict:
        plain = await _plain(n, settings)
        cold = await _cold(n, settings)
        # Interleaved halves, so that a burst of load on a shared machine falls on both alike.
        warm: list[float] = []
        unhardened: list[float] = []
        for _ in range(2):
            unhardened += await _warm_latency(n // 2, settings, hardened=False)
            warm += await _warm_latency(n // 2, settings, hardened=True)
        rate = await _throughput(n, settings)
        hostile = await _hostile_catalogue(settings)
        return {"plain": plain, "cold": cold, "warm": warm, "unhardened": unhardened, "rate": rate, **hostile}

    r = asyncio.run(main())
    rows = [
        {
            "what": "plain subprocess",
            "p50_ms": statistics.median(r["plain"]) * 1e3,
            "p99_ms": _pct(r["plain"], 0.99) * 1e3,
        },
        {
            "what": "bubblewrap cold",
            "p50_ms": statistics.median(r["cold"]) * 1e3,
            "p99_ms": _pct(r["cold"], 0.99) * 1e3,
        },
        {
            "what": "bubblewrap warm pool",
            "p50_ms": statistics.median(r["warm"]) * 1e3,
            "p99_ms": _pct(r["warm"], 0.99) * 1e3,
        },
        {
            "what": "bubblewrap warm pool, unhardened (baseline)",
            "p50_ms": statistics.median(r["unhardened"]) * 1e3,
            "p99_ms": _pct(r["unhardened"], 0.99) * 1e3,
        },
    ]
    summary = {
        "quick": quick,
        "runs": n,
        "plain_p50_ms": round(rows[0]["p50_ms"], 2),
        "cold_p50_ms": round(rows[1]["p50_ms"], 2),
        "cold_p99_ms": round(rows[1]["p99_ms"], 2),
        "warm_p50_ms": round(rows[2]["p50_ms"], 2),
        "warm_p99_ms": round(rows[2]["p99_ms"], 2),
        "warm_unhardened_p50_ms": round(rows[3]["p50_ms"], 2),
        "warm_vs_unhardened": round(statistics.median(r["warm"]) / statistics.median(r["unhardened"]), 3),
        "overhead_vs_subprocess": round(statistics.median(r["cold"]) / statistics.median(r["plain"]), 3),
        "verifications_per_s": round(r["rate"], 1),
        "hostile_contained": r["contained"],
        "hostile_total": r["total"],
        "hostile_escaped": r["escaped"],
        "reward_hacks_scored": r["hacks_scored"],
        "uids_retired": r["retired"],
    }
    table = [{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows]
    return table, summary


async def _hostile_catalogue(settings: SandboxSettings) -> dict:
    """Each hostile program as a code answer. Contained: reward 0 with one of its error classes and a
    healthy sandbox after it. A reward hack: a wrong answer that scored above 0 (must never happen)."""
    from workers.bench.hostile_programs import CORRECT_ADD, add_group, catalogue, code_answer, open_listener
    from workers.rewards.verifiers import CodeTests

    listener = open_listener()
    group = add_group(run_id="b")
    # CPU-bound cases get a wall clock far above their CPU limit; the wall-clock cases a short one.
    pool = BwrapSandboxPool(settings.model_copy(update={"pool_size": 2, "max_processes": 24, "wall_timeout_s": 60}))
    short = BwrapSandboxPool(settings.model_copy(update={"pool_size": 1, "max_processes": 24}))
    await pool.start()
    await short.start()
    contained, hacks, escaped = 0, 0, []
    cases = catalogue(listener.getsockname()[1])
    try:
        for name, case in cases.items():
            chosen = short if case.wall_clock else pool
            verdict = await CodeTests().verify(code_answer(case.code, run_id="b"), group, chosen)
            healthy = await CodeTests().verify(code_answer(CORRECT_ADD, run_id="b"), group, chosen)
            hacks += verdict.value > 0
            if verdict.value == 0.0 and verdict.error_class in case.classes and healthy.value == 1.0:
                contained += 1
            else:
                escaped.append(f"{name}: {verdict.value} {verdict.error_class}")
        for p in (pool, short):
            await p.settled()
    finally:
        listener.close()
        await pool.close()
        await short.close()
    return {
        "contained": contained,
        "total": len(cases),
        "escaped": escaped,
        "hacks_scored": hacks,
        "retired": len(pool.retired) + len(short.retired),
    }
