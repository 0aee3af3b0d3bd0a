"""DuckDB over the blob store: the httpfs extension from its PyPI wheel, nothing downloaded at run time.

The audit issue adds views over the Parquet archive; this module owns the
connection: where the extension lives, and an S3 secret built from the same
settings every worker uses.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from urllib.parse import urlparse

import duckdb

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
        rendered = ", ".join(f"{k} {_literal(v)}" for k, v in options.items())
        con.execute(f"CREATE OR REPLACE SECRET sprawl_s3 ({rendered})")
    return con


def _literal(value: str) -> str:
    if value in {"true", "false"}:
        return value
    return "'" + value.replace("'", "''") + "'"
