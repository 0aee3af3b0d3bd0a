"""The archive: every event to Parquet on S3 exactly once, SQL views over it, canned audits and the report."""

import asyncio
import base64
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from pipeline.audit import _VIEW_EVENTS, AUDITS, ArchiveMissing, empty_view_sql, lineage_sql, open_archive, query
from pipeline.errors import SprawlError
from pipeline.topology import STREAMS, TRAJECTORIES
from schemas import DeadLetter, IslandHeartbeat, IslandIdentity, Reward
from schemas.archive import parquet_glob
from tests.chain_helpers import signed_trust
from tests.servers import connection_env
from tests.trainer_data import make_groups, publish_groups, write_initial_model
from workers.archiver import ArchiverSettings, ArchiveSection, drain_once
from workers.trainer.loop import Trainer
from workers.trainer.settings import TrainerSection, TrainerSettings
from workers.up.report import write_report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_model(tmp_path_factory.mktemp("audit-model"))


async def _stream_counts(event_log, run_id) -> dict[str, int]:
    counts = {}
    for stream in STREAMS:
        info = await event_log.js.stream_info(stream.name, subjects_filter=stream.run_filter(run_id))
        counts[stream.label] = sum((info.state.subjects or {}).values())
    return counts


async def _a_run(event_log, settings, model_dir):
    from pipeline.blobstore import S3BlobStore

    await publish_groups(event_log, make_groups(model_dir, settings.run_id, 4))
    section = TrainerSection(model_dir=model_dir, groups_per_batch=2, trainer_id="audit", max_versions=2)
    trainer_settings = TrainerSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log", "streams"}),
        trust=signed_trust(),
        trainer=section,
    )
    await Trainer(trainer_settings, event_log, S3BlobStore(settings.blobs)).run(asyncio.Event())
    for version, view in [(0, "bf16"), (1, "bf16"), (1, "fp8_e4m3"), (2, "fp8_e4m3")]:
        island = IslandIdentity(island_id=f"isl-{view}", accelerator="cpu", view=view, engine="torch", group=view)
        await event_log.append(
            IslandHeartbeat(
                run_id=settings.run_id,
                island=island,
                current_version=version,
                tokens_per_s=10.0 * (version + 1),
                prompt_groups_done=version,
            )
        )
    for i, error in enumerate(["timeout", "process_limit", None]):
        await event_log.append(
            Reward(
                run_id=settings.run_id,
                trajectory_id=f"extra-{i}",
                group_id="x",
                value=0.0,
                verifier="code_tests",
                verifier_version="1",
                duration_s=1.0,
                error_class=error,
            )
        )
    await event_log.append(
        DeadLetter(
            run_id=settings.run_id,
            reason="unknown event type 'mystery.v1'",
            error_class="unknown_type",
            stream=TRAJECTORIES.label,
            consumer="c",
            original_subject=f"rl.{settings.run_id}.traj.g0",
            original_seq=1,
            num_delivered=1,
            payload=b"{}",
        )
    )
    await event_log.js.publish(f"rl.{settings.run_id}.traj.junk", b"\x00 not an event")


def _archiver_settings(settings, **archive) -> ArchiverSettings:
    return ArchiverSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log"}), archive=ArchiveSection(**archive)
    )


async def test_archive_sql_audits_and_report(event_log, settings, model_dir, tmp_path):
    await _a_run(event_log, settings, model_dir)
    archived = await drain_once(_archiver_settings(settings, flush_events=7))
    counts = await _stream_counts(event_log, settings.run_id)  # with the dead letter the drain appended
    assert archived == sum(counts.values())
    con, views = open_archive(settings)
    assert {"versions", "trajectories", "rewards", "metrics", "islands", "dead_letters", "undecodable"} <= set(views)
    for stream, n in counts.items():
        if n == 0:
            continue
        files = f"s3://{settings.blobs.bucket}/{parquet_glob(settings.run_id, stream=stream)}"
        rows = con.sql(
            f"SELECT count(*), count(DISTINCT log_seq) FROM read_parquet('{files}', union_by_name = true)"
        ).fetchone()
        assert rows == (n, n), stream
    assert con.sql("SELECT count(*) FROM trajectories").fetchone()[0] == 16
    error_class, reason = con.sql("SELECT error_class, reason FROM undecodable").fetchone()
    assert error_class == "malformed" and reason.startswith("not a JSON event object"), (error_class, reason)
    # The junk was dead-lettered by the archiver itself (nobody else reads that subject's stream here).
    refused = con.sql(
        "SELECT stream, consumer, error_class, payload FROM dead_letters WHERE original_subject LIKE '%.traj.junk'"
    ).fetchall()
    assert refused == [("trajectories", f"{settings.run_id}-archiver-trajectories", "malformed", b"\x00 not an event")]
    for name, sql in AUDITS.items():
        assert query(con, views, sql).fetchall(), name
    kl = query(con, views, AUDITS["kl"]).fetchall()
    assert {row[1] for row in kl} == {"bf16", "fp8_e4m3"}
    lineage = query(con, views, lineage_sql(con, views, 2)).fetchall()
    assert len(lineage) == 8 and all(row[3] is not None for row in lineage)  # every member joined to its island
    for view in views:  # a view with no file yet has the columns its first file will bring
        if view in _VIEW_EVENTS:
            real = {row[0] for row in con.sql(f"DESCRIBE {view}").fetchall()}
            empty = {row[0] for row in con.sql(f"DESCRIBE {empty_view_sql(_VIEW_EVENTS[view])}").fetchall()}
            assert real == empty, (view, real ^ empty)
    with pytest.raises(SprawlError, match="views in this archive"):
        query(con, views, "SELECT * FROM nonexistent_view")
    with pytest.raises(SprawlError, match="DESCRIBE"):
        query(con, views, "SELECT no_such_column FROM rewards")

    page = write_report(con, views, settings.run_id, tmp_path / "report.html").read_text()
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 7 and "no data" not in page
    import matplotlib.image

    for encoded in images:
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(encoded)), format="png")
        assert np.asarray(pixels).std() > 0.01  # something was drawn


def test_missing_archive_says_how_to_start_the_archiver(settings):
    with pytest.raises(ArchiveMissing, match="start the archiver"):
        open_archive(settings, run_id="nobody-archived-this")


async def test_dead_letters_audit_of_a_run_without_any_returns_no_rows(event_log, settings):
    """A run that archived events but never dead-lettered one: the audit answers with zero rows."""
    island = IslandIdentity(island_id="isl", accelerator="cpu", view="bf16", engine="torch")
    await event_log.append(IslandHeartbeat(run_id=settings.run_id, island=island, current_version=0))
    assert await drain_once(_archiver_settings(settings)) == 1
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")},
        **connection_env(settings, "auditor"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "audit", "dead-letters", "--json", "--run", settings.run_id],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


async def test_dead_letters_keep_their_fields_and_the_audit_prints_the_refused_bytes_escaped(event_log, settings):
    """Before: the archive's own `stream` and `payload` columns overwrote the dead letter's, so every
    row said `stream=deadletter` and `payload` held the dead letter itself, not the refused bytes."""
    refused = b"\x1b]0;owned\x07\x1b[2J\x9b" + b"A" * 400  # retitle the terminal, clear it, a C1 CSI
    await event_log.append(
        DeadLetter(
            run_id=settings.run_id,
            reason="refused: \x1b[31mred\x1b[0m",
            error_class="malformed",
            stream="rewards",
            consumer="c1",
            original_subject=f"rl.{settings.run_id}.reward.g0.t0",
            original_seq=41,
            num_delivered=2,
            payload=refused,
        )
    )
    assert await drain_once(_archiver_settings(settings)) == 1
    con, _ = open_archive(settings)
    row = con.sql("SELECT stream, original_seq, consumer, payload, log_stream FROM dead_letters").fetchall()
    assert row == [("rewards", 41, "c1", refused, "deadletter")]

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")},
        **connection_env(settings, "auditor"),
    }
    command = [sys.executable, "-m", "workers.cli", "audit", "dead-letters", "--run", settings.run_id]
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert as_json.returncode == 0, as_json.stderr
    (shown,) = json.loads(as_json.stdout)
    where = (shown["stream"], shown["seq"], shown["consumer"], shown["error_class"])
    assert where == ("rewards", 41, "c1", "malformed")
    assert shown["reason"] == "refused: \\x1B[31mred\\x1B[0m"
    assert shown["payload"].startswith("\\x1B]0;owned\\x07\\x1B[2J\\x9BAAA") and shown["payload"].endswith("…")
    assert len(shown["payload"]) <= 161 and shown["payload_bytes"] == len(refused)
    as_table = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert as_table.returncode == 0, as_table.stderr
    assert "owned" in as_table.stdout
    for output in (as_json.stdout, as_table.stdout):
        assert not {"\x1b", "\x07", "\x9b"} & set(output)  # nothing reaches the terminal raw
