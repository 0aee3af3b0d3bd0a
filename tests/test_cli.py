import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.blobstore import S3BlobStore
from pipeline.sql import open_duckdb
from tests.servers import connection_env

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


def _auditor(settings) -> dict[str, str]:
    """The test stack's auditor: without it `sprawl sql` would look for a store on the default port (and
    wait out its retries, or read a local `just up` stack's)."""
    return os.environ | connection_env(settings, "auditor")


def test_sql_command_line_prints_json_rows(settings):
    env_args = ["--run", settings.run_id]
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "sql", "select 6 * 7 as answer", "--json", *env_args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=_auditor(settings),
    )
    assert json.loads(result.stdout) == [{"answer": 42}]
    # a run with no archive yet: plain DuckDB answers, and says why the views are missing
    assert f"run {settings.run_id} has no archive" in result.stderr


def test_sql_table_escapes_what_could_drive_a_terminal(settings):
    """A program's stderr or a refused payload reaches the table as escapes, never as a terminal
    command (ESC, CSI, BEL, OSC) nor as rich markup."""
    query = "select chr(27) || '[2J' || chr(7) || chr(155) || '[bold]x[/bold]' || chr(27) || ']0;pwned' || chr(7) as s"
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "sql", query, "--run", settings.run_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=_auditor(settings),
    )
    assert r"\x1B[2J\x07\x9B[bold]x[/bold]\x1B]0;pwned\x07" in result.stdout
    assert not any(ch in result.stdout for ch in "\x1b\x07\x9b")


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


# ---------------------------------------------------------------- flags derived from the settings


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    import structlog

    from workers.cli import main

    saved = structlog.get_config()
    try:
        code = main(list(argv))
    finally:
        # `main` points the logs at this test's captured stderr, which closes with the test.
        structlog.configure(**saved)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    import os

    for name in list(os.environ):
        if name.startswith("SPRAWL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no `.sprawl/current_run` of this checkout's own runs


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, workers.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["up", "--versions", "-5"], "sprawl: error: versions: Input should be greater than or equal to 1 (got '-5')"),
        (["audit", "lineage"], "sprawl: error: `sprawl audit lineage` needs a VERSION (e.g. `sprawl audit lineage 3`)"),
        (
            ["trainer", "--trainer.checkpoint-every", "0"],
            "sprawl: error: trainer.checkpoint_every: Input should be greater than or equal to 1 (got '0')",
        ),
        (
            ["trainer", "--chain.keyframe-every", "0"],
            "sprawl: error: chain.keyframe_every: Input should be greater than or equal to 1 (got '0')",
        ),
        (
            ["trainer", "--trainer.loss.importance-level", "Token"],
            "sprawl: error: trainer.loss.importance_level: Input should be 'token' or 'sequence' (got 'Token')",
        ),
        (["up", "--correction", "sc+magic"], "sprawl: error: correction: unknown correction 'magic'"),
        (["trainer", "--bogus"], "sprawl: error: unrecognized arguments: --bogus (see `sprawl trainer --help`)"),
        (["sql"], "sprawl: error: the following arguments are required: QUERY"),
        (["bench", "nope"], "sprawl: error: name: Input should be 'log', 'delta'"),
    ],
)
def test_user_errors_are_one_line_on_stderr(capsys, clean_env, argv, expected):
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(expected), err


def test_a_config_file_with_a_typo_and_a_bad_value_names_both(capsys, clean_env, tmp_path):
    toml = tmp_path / "trainer.toml"
    toml.write_text('[trainer]\ncheckpoint_evry = 5\n[trainer.loss]\nimportance_level = "Token"\n')
    code, _, err = _main(capsys, "trainer", "--config", str(toml))
    assert code == 2
    assert sorted(err.splitlines()) == [
        "sprawl: error: trainer.checkpoint_evry: Extra inputs are not permitted (got 5)",
        "sprawl: error: trainer.loss.importance_level: Input should be 'token' or 'sequence' (got 'Token')",
    ]
    code, _, err = _main(capsys, "trainer", "--config", str(tmp_path / "absent.toml"))
    assert code == 2 and err.count("\n") == 1 and "absent.toml does not exist" in err


def test_the_console_script_prints_no_traceback(clean_env):
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "audit", "lineage"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr == "sprawl: error: `sprawl audit lineage` needs a VERSION (e.g. `sprawl audit lineage 3`)\n"


def test_every_settings_field_is_a_flag_with_its_docstring_as_help(capsys, clean_env):
    from workers.trainer.settings import TrainerSettings

    with pytest.raises(SystemExit):
        _main(capsys, "trainer", "--help")
    text = " ".join(capsys.readouterr().out.split())
    for section, model in (("", TrainerSettings), ("trainer.", None), ("trainer.loss.", None), ("chain.", None)):
        fields = (model or _section(TrainerSettings, section)).model_fields
        for name, field in fields.items():
            if field.annotation is not None and hasattr(field.annotation, "model_fields"):
                continue  # a section: its fields are flags of their own
            flag = f"--{section}{name}".replace("_", "-")
            assert flag in text, flag
            assert " ".join(field.description.split())[:30] in text, flag


def _section(model, dotted: str):
    for part in dotted.strip(".").split("."):
        model = model.model_fields[part].annotation
    return model


def test_the_documented_options_of_up_parse(clean_env):
    from workers.cli import parse

    invocation = parse(
        [
            "up",
            "--quick",
            "--islands",
            "3",
            "--views",
            "bf16,fp8",
            "--correction",
            "sc+mis+mask",
            "--fresh",
            "--versions",
            "4",
            "--json",
            "--no-live",
            "--state-dir",
            "somewhere",
            "--trainer.learning-rate",
            "0.001",
        ]
    )
    options, settings = invocation.options, invocation.settings
    assert (options.quick, options.islands, options.views) == (True, 3, ["bf16", "fp8_e4m3"])
    assert (options.correction, options.fresh, options.versions) == ("sc+mis+mask", True, 4)
    assert options.json_output is True and options.live is False
    assert str(settings.state_dir) == "somewhere" and settings.trainer.learning_rate == 0.001
    assert settings.trainer.groups_per_batch == 8  # the demo's default for what the flags do not name


def test_flags_beat_variables_beat_the_file_and_sql_remembers_the_last_up_run(clean_env, monkeypatch, tmp_path):
    from workers.cli import parse

    toml = tmp_path / "s.toml"
    toml.write_text('[nats]\nurl = "nats://file:1"\nconnect_timeout_s = 9.0\n[archive]\nflush_events = 7\n')
    monkeypatch.setenv("SPRAWL_NATS__CONNECT_TIMEOUT_S", "3")
    settings = parse(["sql", "select 1", "--config", str(toml), "--nats.url", "nats://flag:2"]).settings
    assert (settings.nats.url, settings.nats.connect_timeout_s, settings.archive.flush_events) == (
        "nats://flag:2",
        3.0,
        7,
    )
    state = tmp_path / "state"
    state.mkdir()
    (state / "current_run").write_text("run-remembered\n")
    assert parse(["sql", "select 1", "--state-dir", str(state)]).settings.run_id == "run-remembered"
    assert parse(["sql", "select 1", "--state-dir", str(state), "--run", "mine"]).settings.run_id == "mine"
    monkeypatch.setenv("SPRAWL_RUN_ID", "from-env")
    assert parse(["audit", "kl", "--state-dir", str(state)]).settings.run_id == "from-env"
    assert parse(["trainer", "--state-dir", str(state)]).settings.run_id == "from-env"
