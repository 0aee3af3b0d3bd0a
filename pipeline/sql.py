"""DuckDB over the blob store: the httpfs extension from its PyPI wheel, nothing downloaded at run time.

The audit issue adds views over the Parquet archive; this module owns the
connection: where the extension lives, an S3 secret built from the same
settings every worker uses, and `printable(bytes, limit)`, a SQL function that
shows bytes someone else wrote (a refused payload) without letting them drive the
terminal. It also owns what `sprawl sql` needs around a user's query: DuckDB's
errors as one-line `QueryError`s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse

import duckdb
from duckdb.sqltypes import BIGINT, BLOB, VARCHAR

from pipeline.config import S3BlobSettings, SprawlSettings
from pipeline.errors import SprawlError


def extension_directory() -> Path:
    """The folder of the `duckdb-ext-httpfs` wheel, laid out as DuckDB's extension directory."""
    spec = importlib.util.find_spec("duckdb_ext")
    if spec is None or not spec.submodule_search_locations:
        raise SprawlError(
            "the DuckDB httpfs extension is not installed",
            hint="pip install duckdb-ext-httpfs==1.4.4.20260205 (it must match duckdb 1.4.4)",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "extensions"


def open_duckdb(settings: SprawlSettings, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(
        database,
        config={
            "extension_directory": str(extension_directory()),
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
        },
    )
    try:
        con.execute("LOAD httpfs")
    except duckdb.Error as exc:
        raise SprawlError(
            f"DuckDB could not load httpfs from {extension_directory()}: {exc}",
            hint=f"duckdb {duckdb.__version__} needs the duckdb-ext-httpfs wheel of the same version",
        ) from exc
    blobs = settings.blobs
    if isinstance(blobs, S3BlobSettings):
        options = {
            "TYPE": "s3",
            "KEY_ID": blobs.access_key_id,
            "SECRET": blobs.secret_access_key.get_secret_value(),
            "REGION": blobs.region,
        }
        if blobs.endpoint_url:
            endpoint = urlparse(blobs.endpoint_url)
            options |= {
                "ENDPOINT": endpoint.netloc,
                "URL_STYLE": "path",
                "USE_SSL": "true" if endpoint.scheme == "https" else "false",
            }
        if blobs.ca_file is not None:  # the stack's own CA: verify its certificate against that, not the system's
            con.execute(f"SET ca_cert_file = {_literal(str(blobs.ca_file))}")
            con.execute("SET enable_server_cert_verification = true")
        rendered = ", ".join(f"{k} {_literal(v)}" for k, v in options.items())
        con.execute(f"CREATE OR REPLACE SECRET sprawl_s3 ({rendered})")
    con.create_function("printable", printable, [BLOB, BIGINT], VARCHAR, side_effects=False)
    return con


# ------------------------------------------------------------------ bytes on a terminal

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Control and format characters (every terminal escape starts with one: ESC, CSI), surrogates (a byte
that did not decode), private-use and unassigned code points, line and paragraph separators."""


def printable(data: bytes | None, limit: int) -> str | None:
    """`data` as one line of text that is safe to print: UTF-8 where it decodes; every byte that does
    not, and every character in `_UNSAFE_CATEGORIES`, escaped (`\\xNN`, `\\uNNNN`); the backslash
    doubled, so an escape is never ambiguous. Cut after `limit` characters (never inside an
    escape), with `…` saying so. In SQL: `printable(payload, 200)`, `printable(encode(text), 120)`."""
    if data is None:
        return None
    text = bytes(data).decode("utf-8", errors="surrogateescape")
    pieces: list[str] = []
    length = 0
    for char in text:
        piece = _escaped(char)
        if length + len(piece) > limit:
            return "".join(pieces) + "…"
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)


def _escaped(char: str) -> str:
    code = ord(char)
    if char == "\\":
        return "\\\\"
    if 0xDC80 <= code <= 0xDCFF:  # a byte surrogateescape kept: it did not decode as UTF-8
        return f"\\x{code - 0xDC00:02X}"
    if unicodedata.category(char) in _UNSAFE_CATEGORIES:
        return f"\\x{code:02X}" if code <= 0xFF else f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"
    return char


def _literal(value: str) -> str:
    if value in {"true", "false"}:
        return value
    return "'" + value.replace("'", "''") + "'"


# ------------------------------------------------------------------ a user's query


class QueryError(SprawlError):
    """DuckDB refused a query someone typed: its message on one line, and what to try."""

    def __init__(self, message: str, *, hint: str, duckdb_error: str):
        self.duckdb_error = duckdb_error
        """DuckDB's exception class, e.g. `ParserException`."""
        super().__init__(message, hint=hint)


# First match wins: a subclass goes before its base.
_HINTS: tuple[tuple[type[duckdb.Error], str], ...] = (
    (
        duckdb.ParserException,
        "the query is not valid SQL: check the words near the one DuckDB quotes; "
        "strings take 'single quotes', names \"double quotes\"",
    ),
    (duckdb.BinderException, "`DESCRIBE <view>` lists a view's columns"),
    (duckdb.ConversionException, "a value does not fit the type it is cast to; TRY_CAST gives NULL instead"),
    (
        duckdb.IOException,
        "a file the query reads could not be opened: is the object store up (`sprawl stack status`)? "
        "`--fresh` archives what is in the log first",
    ),
    (duckdb.OutOfMemoryException, "the result does not fit in memory: aggregate it or add a LIMIT"),
)


def query_error(exc: duckdb.Error, views: Sequence[str] = ()) -> QueryError:
    """The `QueryError` for a DuckDB error raised by a user's query over `views`."""
    if isinstance(exc, duckdb.CatalogException):
        hint = (
            f"views in this archive: {', '.join(views)}; an event type appears once the archiver has flushed one"
            if views
            else "no archive views are open (plain DuckDB): the run has no archive yet"
        )
    else:
        hint = next((h for kind, h in _HINTS if isinstance(exc, kind)), "DuckDB's message says what it refused")
    return QueryError(_one_line(str(exc)), hint=hint, duckdb_error=type(exc).__name__)


@contextlib.contextmanager
def user_query_errors(views: Sequence[str] = ()) -> Iterator[None]:
    """Turn any DuckDB error raised inside into a `QueryError`.

    Wrap both the `con.sql(...)` and whatever fetches or writes the result: DuckDB parses and binds
    eagerly but executes lazily, so a bad cast or an unreadable file only fails on the fetch.
    """
    try:
        yield
    except duckdb.Error as exc:
        raise query_error(exc, views) from None


def _one_line(message: str) -> str:
    """DuckDB's message without its caret display (`LINE 1: ...` and a `^` under the spot): the CLI
    prints one line, and the first lines already name the token or column."""
    kept = []
    for line in message.splitlines():
        if line.startswith("LINE "):
            break
        if line.strip():
            kept.append(line.strip())
    return " ".join(kept) or message.strip()
