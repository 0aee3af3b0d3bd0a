"""`sprawl sql` around a user's query: every DuckDB error is one `QueryError` line, and `--fresh`
gives up on an unreachable log after a bounded connection attempt instead of retrying forever."""

import asyncio
import socket

import pytest
from pydantic import ValidationError

from pipeline.config import NatsSettings, SprawlSettings
from pipeline.errors import LogUnavailable, SprawlError
from pipeline.eventlog import connect_nats
from pipeline.sql import QueryError, open_duckdb, printable, user_query_errors


@pytest.fixture
def con():
    con = open_duckdb(SprawlSettings())
    con.execute("CREATE TABLE rewards AS SELECT 1.0 AS value")
    yield con
    con.close()


@pytest.mark.parametrize(
    ("sql", "duckdb_error", "said"),
    [
        ("selec 1", "ParserException", 'syntax error at or near "selec"'),
        ("SELECT * FROM nonexistent_view", "CatalogException", "nonexistent_view"),
        ("SELECT no_such_column FROM rewards", "BinderException", "no_such_column"),
        # These two pass parsing and binding and only fail once the result is fetched.
        ("SELECT 'a'::INTEGER", "ConversionException", "Could not convert string 'a'"),
        ("SELECT * FROM read_parquet('/nonexistent/*.parquet')", "IOException", "/nonexistent/*.parquet"),
        ("SELECT error('refused by the query')", "InvalidInputException", "refused by the query"),
    ],
)
def test_every_duckdb_error_of_a_query_is_one_line_with_a_hint(con, sql, duckdb_error, said):
    with pytest.raises(QueryError) as caught, user_query_errors(["rewards"]):
        con.sql(sql).fetchall()
    error = caught.value
    assert isinstance(error, SprawlError)  # what the CLI prints as `sprawl: error: ...`
    assert error.duckdb_error == duckdb_error
    assert said in error.message
    assert error.hint
    assert "\n" not in str(error)
    assert "LINE 1" not in str(error)  # DuckDB's caret display needs several lines: left out


def test_a_missing_view_names_the_views_there_are(con):
    with (
        pytest.raises(QueryError, match="views in this archive: metrics, rewards"),
        user_query_errors(["metrics", "rewards"]),
    ):
        con.sql("SELECT * FROM versions")


def test_queries_that_succeed_pass_through(con):
    with user_query_errors(["rewards"]):
        assert con.sql("SELECT sum(value) FROM rewards").fetchall() == [(1.0,)]


async def test_an_unreachable_log_fails_after_a_bounded_attempt():
    """Before: the first connection retried forever, so `sprawl sql --fresh` (and every worker) hung,
    printing a warning every 0.5 s."""
    # A bound socket that never listens: connections to its port are refused, and no other
    # process can take the port while the test holds it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"nats://127.0.0.1:{closed.getsockname()[1]}"
        nats_settings = NatsSettings(url=url, connect_timeout_s=1.0, reconnect_wait_s=0.05, connect_attempts=3)
        # The guard only turns a regression (retrying forever) into a failure instead of a hung run.
        with pytest.raises(LogUnavailable) as caught:
            await asyncio.wait_for(connect_nats(nats_settings, "test"), timeout=120)
    error = caught.value
    assert isinstance(error, SprawlError)
    assert url in error.message and "3 attempts" in error.message
    assert "sprawl stack status" in error.hint
    assert "\n" not in str(error)


def test_fewer_than_two_attempts_is_refused():
    with pytest.raises(ValidationError, match="connect_attempts"):
        NatsSettings(connect_attempts=1)


@pytest.mark.integration
async def test_a_reachable_log_connects_and_keeps_reconnecting_after(settings):
    nc = await connect_nats(settings.nats, "test")
    try:
        assert nc.options["max_reconnect_attempts"] == -1  # a later server restart is waited out
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("data", "limit", "shown"),
    [
        (b"plain text", 100, "plain text"),
        ("é ✓ 日本".encode(), 100, "é ✓ 日本"),  # printable UTF-8 stays as it is
        (b"\x1b[31mred\x1b[0m", 100, "\\x1B[31mred\\x1B[0m"),  # terminal escapes
        (b"\x00\x07\t\n\r\x7f", 100, "\\x00\\x07\\x09\\x0A\\x0D\\x7F"),  # C0 and DEL
        ("\u009b2J".encode(), 100, "\\x9B2J"),  # C1 CSI as a character ...
        (b"\x9b2J\xff", 100, "\\x9B2J\\xFF"),  # ... and as bytes that are not UTF-8
        ("\u202eevil\u2028".encode(), 100, "\\u202Eevil\\u2028"),  # bidi override, line separator
        (b"a\\x1B", 100, "a\\\\x1B"),  # a backslash is doubled: an escape is never ambiguous
        (b"abcdef", 3, "abc…"),
        (b"\x00\x00\x00", 9, "\\x00\\x00…"),  # never cut inside an escape
        (None, 10, None),
    ],
)
def test_printable_escapes_what_could_drive_a_terminal(data, limit, shown):
    assert printable(data, limit) == shown


def test_printable_is_a_sql_function_of_every_connection(con):
    assert con.sql("SELECT printable(from_hex('1b5b324a41'), 20), printable(encode('ok'), 20)").fetchall() == [
        ("\\x1B[2JA", "ok")
    ]
