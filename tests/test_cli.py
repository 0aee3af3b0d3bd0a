import io
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.sql import open_duckdb

pytestmark = pytest.mark.integration


def test_bench_log_prints_one_json_object_last():
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "bench", "log", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("overhead_ratio_1k", "overhead_ratio_64k", "events_per_s_1k", "overhead_ratio_2m"):
        assert summary[key] > 0, key
    assert "sprawl bench log" in result.stdout


def test_sql_reads_parquet_from_the_blob_store(settings):
    buffer = io.BytesIO()
    pq.write_table(pa.table({"version": [1, 2, 3], "kl": [0.1, 0.2, 0.4]}), buffer)
    ref = S3BlobStore(settings.blobs).put_bytes(buffer.getvalue(), key=f"t/{settings.run_id}/m.parquet")
    con = open_duckdb(settings)
    assert con.execute(f"select max(kl), count(*) from read_parquet('{ref.uri}')").fetchone() == (0.4, 3)


def test_sql_command_line_prints_json_rows(settings):
    env_args = ["--run", settings.run_id]
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "sql", "select 6 * 7 as answer", "--json", *env_args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(result.stdout) == [{"answer": 42}]


@pytest.mark.slow
def test_bench_delta_reports_bitexact_and_the_anchor_ratios():
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "bench", "delta", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bitexact"] is True
    for key in ("size_vs_xor_zstd", "size_vs_entropy", "encode_speed_vs_xor_zstd", "apply_speed_vs_xor_zstd"):
        assert summary["synthetic_1pct"][key] > 0
    assert 0 < summary["adam_bf16"]["changed_fraction"] < 1
    assert 0 < summary["adam_fp8"]["size_vs_keyframe"] < 1


def test_every_worker_and_tool_has_its_command():
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    for command in (
        "stack",
        "up",
        "infra",
        "sql",
        "audit",
        "report",
        "archiver",
        "sampler",
        "sidecar",
        "trainer",
        "rewards",
        "bench",
    ):
        assert command in result.stdout, command
