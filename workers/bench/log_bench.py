"""Append+ack throughput of `EventLog.append` against raw nats-py JetStream publishes of the same bytes.

Runs against a private, temporary stack on free ports (never the user's), one
event in flight at a time (the latency-bound case a trainer or sampler sees).
Rounds alternate raw and ours so drift on a shared machine hits both alike.
The 2 MiB case is claim-checked (S3 put + a small event), against a raw 2 MiB
publish; the local nats-server allows 8 MiB payloads so the baseline exists.
"""

from __future__ import annotations

import asyncio
import time

from infra.stack import StackSettings
from infra.streams import apply
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.topology import Kind, run_subject, token
from schemas import encode_event
from schemas.events import IslandIdentity, Trajectory, VersionSpan
from workers.bench.private_stack import private_stack

SIZES = {"1k": 1024, "64k": 64 * 1024, "2m": 2 * 1024 * 1024}
ISLAND = IslandIdentity(island_id="bench", accelerator="cpu", view="bf16", engine="torch")


def _event(run_id: str, size: int, n: int) -> Trajectory:
    """A trajectory whose encoded size is exactly `size` bytes (padded through `text`)."""
    base = Trajectory(
        run_id=run_id,
        trajectory_id=f"b{size}-{n}",
        group_id="g0",
        sample_index=0,
        task="bench",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        version_spans=[VersionSpan(version=0, start=0, end=2)],
        island=ISLAND,
    )
    pad = size - len(encode_event(base))
    return Trajectory(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "text": "x" * max(pad, 0)})


async def _time_raw(event_log: EventLog, subjects: list[str], payloads: list[bytes]) -> float:
    t0 = time.perf_counter()
    for subject, payload in zip(subjects, payloads, strict=True):
        await event_log.js.publish(subject, payload)
    return time.perf_counter() - t0


async def _time_ours(event_log: EventLog, events: list[Trajectory]) -> tuple[float, bool]:
    claim_checked = False
    t0 = time.perf_counter()
    for event in events:
        claim_checked |= (await event_log.append(event)).claim_checked
    return time.perf_counter() - t0, claim_checked


async def _measure(settings: StackSettings, quick: bool) -> tuple[list[dict], dict]:
    counts = {"1k": 300, "64k": 150, "2m": 8} if quick else {"1k": 3000, "64k": 1000, "2m": 40}
    rounds = 3 if quick else 5
    event_log = await EventLog.connect(settings, worker="bench")
    await apply(event_log.js, settings.streams, settings.run_id)
    rows, summary = [], {"quick": quick, "rounds": rounds}
    try:
        for label, size in SIZES.items():
            per_round = max(1, counts[label] // rounds)
            ours_s = raw_s = 0.0
            claim_checked = False
            # Round 0 warms connections, the stream's file blocks and S3; it is not counted.
            run = token(settings.run_id, "run_id")
            for r in range(rounds + 1):
                events = [_event(settings.run_id, size, r * per_round + i) for i in range(per_round)]
                raw = [encode_event(e) for e in events]
                # One subject per message, like ours: TRAJECTORIES keeps one message per subject.
                raw_subjects = [
                    run_subject(run, Kind.TRAJECTORIES, "raw", f"{label}-{e.trajectory_id}") for e in events
                ]
                ours_first = r % 2 == 1
                if ours_first:
                    ours, claim = await _time_ours(event_log, events)
                raw_time = await _time_raw(event_log, raw_subjects, raw)
                if not ours_first:
                    ours, claim = await _time_ours(event_log, events)
                claim_checked |= claim
                if r > 0:
                    ours_s += ours
                    raw_s += raw_time
            n = per_round * rounds
            ratio = ours_s / raw_s
            rows.append(
                {
                    "size": label,
                    "events": n,
                    "raw ev/s": n / raw_s,
                    "sprawl ev/s": n / ours_s,
                    "overhead (ours/raw)": ratio,
                    "claim-checked": claim_checked,
                }
            )
            summary[f"overhead_ratio_{label}"] = round(ratio, 4)
            summary[f"events_per_s_{label}"] = round(n / ours_s, 2)
            summary[f"raw_events_per_s_{label}"] = round(n / raw_s, 2)
            summary[f"mib_per_s_{label}"] = round(n * size / ours_s / 2**20, 2)
    finally:
        await event_log.close()
    return rows, summary


def bench_log(quick: bool) -> tuple[list[dict], dict]:
    configure_logging("bench", fmt="json", level="WARNING")
    with private_stack("bench") as settings:
        return asyncio.run(_measure(settings, quick))
