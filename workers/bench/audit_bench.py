"""`sprawl bench audit`: archive N synthetic trajectory events through the real archiver, then time the
canned audits in DuckDB and the same answers computed with pyarrow over the same Parquet files.

N is 1 M (200 k with --quick). Besides the trajectories, a few versions (one with lineage over
1000 of them), heartbeats, metrics and dead letters make every audit non-empty.
"""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pyarrow import fs

from infra.streams import apply
from pipeline.audit import AUDITS, lineage_sql, open_archive, query
from pipeline.blobstore import open_blob_store
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.topology import Kind, run_subject
from schemas import (
    BlobPointer,
    DeadLetter,
    IslandHeartbeat,
    IslandIdentity,
    PolicyVersion,
    Reward,
    TensorDigest,
    TrainerMetrics,
    Trajectory,
    VersionSpan,
    ViewVersion,
)
from schemas.archive import event_type_prefix
from schemas.lineage import Lineage, LineageGroup, LineageMember, encode_lineage, lineage_key
from workers.archiver import ArchiverSettings, ArchiveSection, drain_once
from workers.bench.private_stack import private_stack

RUN = "benchaudit"
ISLANDS = [
    IslandIdentity(
        island_id=f"isl-{i}",
        accelerator="cpu",
        view="bf16" if i % 2 else "fp8_e4m3",
        engine="torch",
        group="bf16" if i % 2 else "fp8_e4m3",
    )
    for i in range(8)
]


def _trajectory(i: int) -> Trajectory:
    return Trajectory(
        run_id=RUN,
        trajectory_id=f"t{i}",
        group_id=f"g{i // 8}",
        sample_index=i % 8,
        task="arith",
        prompt_token_ids=[1, 2, 3, 4],
        output_token_ids=[5, 6, 7, 8],
        logprobs=[-0.5] * 4,
        finish_reason="stop",
        version_spans=[VersionSpan(version=i % 5, start=0, end=4)],
        island=ISLANDS[i % 8],
    )


async def _publish(event_log: EventLog, n: int, blobs) -> float:
    t0 = time.perf_counter()
    window = 512
    for start in range(0, n, window):
        await asyncio.gather(*(event_log.append(_trajectory(i)) for i in range(start, min(n, start + window))))
    elapsed = time.perf_counter() - t0
    lineage = Lineage(
        version=1,
        groups=[
            LineageGroup(f"g{g}", [LineageMember(f"t{g * 8 + k}", g * 8 + k + 1, 0) for k in range(8)])
            for g in range(125)
        ],
    )
    ref = blobs.put_bytes(encode_lineage(lineage), lineage_key(RUN, 1))
    for version in (0, 1):
        view = ViewVersion(
            view="bf16",
            kind="keyframe" if version == 0 else "patch",
            base_version=version - 1 or None,
            blobs=[BlobPointer(uri="s3://x/y", sha256="0" * 64, bytes=1000)],
            tensors=[TensorDigest(name="w", dtype="BF16", shape=[1], xxh3="0" * 32, changed=1)],
            root_hash="0" * 32,
            bytes=1000 if version == 0 else 10,
            changed_elements=1,
            total_elements=100,
        )
        await event_log.append(
            PolicyVersion(
                run_id=RUN,
                version=version,
                parent_version=version - 1 or None,
                trainer_step=version,
                views=[view],
                lineage_uri=ref.uri if version else None,
            )
        )
        await event_log.append(
            TrainerMetrics(
                run_id=RUN,
                step=version,
                version=version,
                metrics={
                    "staleness_mean": 1.0,
                    "staleness_0": 0.5,
                    "staleness_1": 0.5,
                    "staleness_2": 0.0,
                    "staleness_3_4": 0.0,
                    "staleness_5_8": 0.0,
                    "staleness_9_plus": 0.0,
                    "reward_mean": 0.5,
                },
                per_group={"bf16": {"kl_k3": 0.01, "kl_k1": 0.01, "reward_mean": 0.5}},
            )
        )
    for island in ISLANDS:
        await event_log.append(IslandHeartbeat(run_id=RUN, island=island, current_version=1, tokens_per_s=100.0))
    for i in range(1000):
        await event_log.append(
            Reward(
                run_id=RUN,
                trajectory_id=f"t{i}",
                group_id=f"g{i // 8}",
                value=float(i % 2),
                verifier="exact",
                verifier_version="1",
                duration_s=0.0,
            )
        )
    await event_log.append(
        DeadLetter(
            run_id=RUN,
            reason="bench",
            error_class="unknown_type",
            stream="trajectories",
            consumer="c",
            original_subject=run_subject(RUN, Kind.TRAJECTORIES, "g0"),
            original_seq=1,
            num_delivered=1,
            payload=b"",
        )
    )
    return elapsed


def _pyarrow_answers(settings) -> dict[str, float]:
    """The lineage, fleet and per-island trajectory counts, computed with pyarrow instead of SQL."""
    blobs = settings.blobs
    s3 = fs.S3FileSystem(
        access_key=blobs.access_key_id,
        secret_key=blobs.secret_access_key.get_secret_value(),
        endpoint_override=blobs.endpoint_url,
        scheme="http",
        region=blobs.region,
    )

    def dataset(event_type: str) -> ds.Dataset:
        return ds.dataset(f"{blobs.bucket}/{event_type_prefix(RUN, event_type)}", filesystem=s3, format="parquet")

    times = {}
    t0 = time.perf_counter()
    trajectories = dataset("trajectory.v1")
    wanted = pa.array([f"t{i}" for i in range(1000)])
    found = trajectories.to_table(columns=["trajectory_id", "island"], filter=pc.field("trajectory_id").isin(wanted))
    members = pa.table(
        {"trajectory_id": found["trajectory_id"], "island": pc.struct_field(found["island"], "island_id")}
    )
    rewards = dataset("reward.v1").to_table(columns=["trajectory_id", "value"])
    members.join(rewards, "trajectory_id")
    times["lineage"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    islands = dataset("island_heartbeat.v2").to_table()
    islands.group_by([]).aggregate([("current_version", "max")])
    times["fleet"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = trajectories.to_table(columns=["island"])
    pc.value_counts(pc.struct_field(table["island"], "island_id"))
    times["trajectories_by_island"] = time.perf_counter() - t0
    return times


def bench_audit(quick: bool) -> tuple[list[dict], dict]:
    configure_logging("bench", fmt="json", level="WARNING")
    n = 200_000 if quick else 1_000_000

    async def main(settings) -> tuple[float, float, int]:
        event_log = await EventLog.connect(settings, worker="bench-audit")
        try:
            await apply(event_log.js, settings.streams, RUN)
            publish_s = await _publish(event_log, n, open_blob_store(settings.blobs))
        finally:
            await event_log.close()
        archiver = ArchiverSettings(
            **{**settings.model_dump(include={"nats", "blobs", "log"}), "run_id": RUN},
            archive=ArchiveSection(flush_events=50_000),
        )
        t0 = time.perf_counter()
        archived = await drain_once(archiver)
        return publish_s, time.perf_counter() - t0, archived

    with private_stack(RUN) as settings:
        settings = settings.model_copy(update={"run_id": RUN})
        publish_s, archive_s, archived = asyncio.run(main(settings))
        con, views = open_archive(settings)
        rows = []
        sqls = {
            **AUDITS,
            "lineage": lineage_sql(con, views, 1),
            "trajectories_by_island": "SELECT island.island_id, count(*) FROM trajectories GROUP BY ALL",
        }
        audit_times = {}
        for name, sql in sqls.items():
            t0 = time.perf_counter()
            result = query(con, views, sql).fetchall()
            audit_times[name] = time.perf_counter() - t0
            rows.append({"audit": name, "duckdb_s": audit_times[name], "rows": len(result)})
        arrow = _pyarrow_answers(settings)
    for row in rows:
        row["pyarrow_s"] = arrow.get(row["audit"])
    compared = [name for name in arrow if name in audit_times]
    summary = {
        "quick": quick,
        "events": n,
        "archived": archived,
        "publish_events_per_s": round(n / publish_s, 1),
        "archive_events_per_s": round(archived / archive_s, 1),
        "max_audit_s": round(max(audit_times.values()), 4),
        "audit_vs_pyarrow": round(sum(audit_times[c] for c in compared) / sum(arrow[c] for c in compared), 4),
        "audits_s": {k: round(v, 4) for k, v in audit_times.items()},
    }
    table = [
        {
            "audit": r["audit"],
            "rows": r["rows"],
            "duckdb s": f"{r['duckdb_s']:.3f}",
            "pyarrow s": "-" if r["pyarrow_s"] is None else f"{r['pyarrow_s']:.3f}",
        }
        for r in rows
    ]
    return table, summary
