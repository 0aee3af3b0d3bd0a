"""SQL over the run's archive: DuckDB views named after the events, and the canned audits."""

from __future__ import annotations

import duckdb
import msgspec.inspect as mi

from pipeline.blobstore import S3BlobStore, open_blob_store
from pipeline.config import S3BlobSettings, SprawlSettings
from pipeline.errors import SprawlError
from pipeline.sql import open_duckdb
from schemas import (
    DeadLetter,
    Event,
    GroupDropped,
    IslandDrift,
    IslandHeartbeat,
    PolicyVersion,
    PromptGroup,
    Reward,
    StabilityResult,
    TrainerCheckpoint,
    TrainerLease,
    TrainerMetrics,
    Trajectory,
)
from schemas.archive import (
    ARCHIVE_ROOT,
    JSON_TEXT_FIELDS,
    ROW_COLUMNS,
    UNDECODABLE,
    UNDECODABLE_COLUMNS,
    ArchiveKey,
    parquet_glob,
    run_prefix,
)

_VIEW_EVENTS: dict[str, type[Event]] = {
    "versions": PolicyVersion,
    "prompts": PromptGroup,
    "trajectories": Trajectory,
    "rewards": Reward,
    "islands": IslandHeartbeat,
    "metrics": TrainerMetrics,
    "dead_letters": DeadLetter,
    "checkpoints": TrainerCheckpoint,
    "dropped_groups": GroupDropped,
    "leases": TrainerLease,
    "island_drift": IslandDrift,
    "stability": StabilityResult,
}
VIEWS: dict[str, str] = {name: cls.type_tag() for name, cls in _VIEW_EVENTS.items()} | {"undecodable": UNDECODABLE}
"""View name -> the archived event type it reads."""


class ArchiveMissing(SprawlError):
    pass


def archived_types(settings: SprawlSettings, run_id: str) -> set[str]:
    blobs = open_blob_store(settings.blobs)
    return {key.event_type for key in ArchiveKey.parse_listing(blobs.list_keys(run_prefix(run_id)))}


def open_archive(settings: SprawlSettings, run_id: str | None = None) -> tuple[duckdb.DuckDBPyConnection, list[str]]:
    """A DuckDB connection with one view per event type; returns the names of those with archived files.

    A type the run has no file of yet (no dead letters, say) still gets its view, empty and with the
    columns its files would have, so a canned audit answers with zero rows instead of failing.
    """
    run_id = run_id or settings.run_id
    if not isinstance(settings.blobs, S3BlobSettings):
        raise ArchiveMissing("SQL audits read the archive from S3", hint="configure an s3 blob store")
    present = archived_types(settings, run_id)
    if not present:
        raise ArchiveMissing(
            f"run {run_id} has no archive in s3://{settings.blobs.bucket}/{ARCHIVE_ROOT}/",
            hint="start the archiver (`sprawl archiver`, part of `just up`) and wait one flush",
        )
    con = open_duckdb(settings)
    bucket = S3BlobStore(settings.blobs).bucket
    names = []
    for view, event_type in VIEWS.items():
        if event_type in present:
            path = f"s3://{bucket}/{parquet_glob(run_id, event_type)}"
            con.execute(f"CREATE VIEW {view} AS SELECT * FROM read_parquet('{path}', union_by_name = true)")
            names.append(view)
        else:
            con.execute(f"CREATE VIEW {view} AS {empty_view_sql(_VIEW_EVENTS.get(view))}")
    return con, names


# ---------------------------------------------------------------- the columns of a type with no file yet

_ROW_SQL_TYPES = {
    "log_stream": "VARCHAR",
    "log_seq": "BIGINT",
    "log_subject": "VARCHAR",
    "log_published_at": "TIMESTAMPTZ",
    "log_payload": "BLOB",
}
# The archiver's columns on every row (a KeyError here: give a new one its type), then the hive
# partitions DuckDB reads from the path (`date` as a DATE: DuckDB casts partition values it recognizes).
_ROW_TYPES = {name: _ROW_SQL_TYPES[name] for name in ROW_COLUMNS} | {
    "event_type": "VARCHAR",
    "run_id": "VARCHAR",
    "date": "DATE",
}


def empty_view_sql(event: type[Event] | None) -> str:
    """A SELECT with no rows and the columns the archiver writes for `event` (None: undecodable rows)."""
    columns: dict[str, str] = {}
    if event is not None:
        info = mi.type_info(event)
        assert isinstance(info, mi.StructType)
        columns |= {f.encode_name: _sql_type(f.type, f.encode_name) for f in info.fields}
    else:
        columns |= dict.fromkeys(UNDECODABLE_COLUMNS, "VARCHAR")
    columns |= _ROW_TYPES  # no event field shares a name with these (the log_ prefix)
    rendered = ", ".join(f'CAST(NULL AS {sql}) AS "{name}"' for name, sql in columns.items())
    return f"SELECT * FROM (SELECT {rendered}) WHERE false"


def _sql_type(t: mi.Type, name: str = "") -> str:
    """The DuckDB type of a field as the archiver writes it (see `_columns` in workers/archiver.py)."""
    if name in JSON_TEXT_FIELDS:
        return "VARCHAR"
    match t:
        case mi.Metadata(type=inner):  # a constrained type (pattern, bounds): stored as the type itself
            return _sql_type(inner, name)
        case mi.LiteralType(values=values) if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return "BIGINT"
        case mi.UnionType(types=types):
            present = [u for u in types if not isinstance(u, mi.NoneType)]
            return _sql_type(present[0], name) if len(present) == 1 else "VARCHAR"
        case mi.BoolType():
            return "BOOLEAN"
        case mi.IntType():
            return "BIGINT"
        case mi.FloatType():
            return "DOUBLE"
        case mi.DateTimeType():
            return "TIMESTAMPTZ"
        case mi.BytesType():
            return "BLOB"
        case mi.ListType(item_type=item) | mi.VarTupleType(item_type=item) | mi.SetType(item_type=item):
            return f"{_sql_type(item)}[]"
        case mi.DictType(value_type=value):
            return f"MAP(VARCHAR, {_sql_type(value)})"
        case mi.StructType(fields=fields, array_like=False) if fields:
            members = ", ".join(f'"{f.encode_name}" {_sql_type(f.type, f.encode_name)}' for f in fields)
            return f"STRUCT({members})"
    return "VARCHAR"  # strings, literals, and anything the archiver stores as text


def query(con: duckdb.DuckDBPyConnection, views: list[str], sql: str) -> duckdb.DuckDBPyRelation:
    try:
        return con.sql(sql)
    except duckdb.CatalogException as exc:
        raise SprawlError(
            f"{exc}".splitlines()[0],
            hint=f"views in this archive: {', '.join(views)}; an event type appears once the archiver has flushed one",
        ) from None
    except duckdb.BinderException as exc:
        raise SprawlError(f"{exc}".splitlines()[0], hint="`DESCRIBE <view>` lists a view's columns") from None


AUDITS = {
    "staleness": """
        SELECT version, step, round(metrics.staleness_mean, 3) AS staleness_mean,
               round(metrics.staleness_0, 3) AS fresh, round(metrics.staleness_1, 3) AS one_behind,
               round(metrics.staleness_2 + metrics.staleness_3_4, 3) AS two_to_four,
               round(metrics.staleness_5_8 + metrics.staleness_9_plus, 3) AS five_plus
        FROM metrics ORDER BY version""",
    "kl": """
        SELECT version, g AS island_group,
               round(CAST(json_extract(per_group, '$."' || g || '".kl_k3') AS DOUBLE), 5) AS kl_k3,
               round(CAST(json_extract(per_group, '$."' || g || '".kl_k1') AS DOUBLE), 5) AS kl_k1,
               round(CAST(json_extract(per_group, '$."' || g || '".reward_mean') AS DOUBLE), 3) AS reward_mean
        FROM metrics, unnest(json_keys(per_group)) AS t(g) ORDER BY version, island_group""",
    # Per island: its heartbeats, then the drift guard's view of it. The windowed KL comes from the
    # newest trainer metrics that judged it (`per_island`, JSON text or, in files written before it was
    # archived as text, a struct: read through the row's JSON so either works, and a run archived before
    # the field has NULLs); the drift state is its newest island_drift verdict ('ok' when it never had one).
    "fleet": """
        WITH beats AS (
            SELECT island.island_id AS island, island.view AS view, island.accelerator AS accelerator,
                   island.engine AS engine, max(current_version) AS version, max(prompt_groups_done) AS groups_done,
                   max(tokens_generated) AS tokens, round(max(tokens_per_s), 1) AS peak_tokens_per_s,
                   max(produced_at) AS last_seen
            FROM islands GROUP BY ALL),
        per_island AS (
            SELECT version, CASE json_type(j) WHEN 'VARCHAR' THEN json(j ->> '$') ELSE j END AS j
            FROM (SELECT version, to_json(m) -> '$.per_island' AS j FROM metrics m)
            WHERE json_type(j) IN ('OBJECT', 'VARCHAR')),
        judged AS (
            SELECT i AS island,
                   arg_max(CAST(json_extract(j, '$."' || i || '".window_kl_k3') AS DOUBLE), version)
                       AS window_kl_k3,
                   arg_max(CAST(json_extract(j, '$."' || i || '".baseline_kl_k3') AS DOUBLE), version)
                       AS baseline_kl_k3,
                   arg_max(CAST(json_extract(j, '$."' || i || '".window_ess_ratio') AS DOUBLE), version)
                       AS window_ess_ratio
            FROM per_island, unnest(json_keys(j)) AS t(i)
            WHERE json_extract(j, '$."' || i || '".window_kl_k3') IS NOT NULL
            GROUP BY i),
        drift AS (
            SELECT island_id AS island, arg_max(state, version) AS drift_state,
                   max(version) AS drift_since_version, arg_max(quarantined, version) AS quarantined
            FROM island_drift GROUP BY island_id),
        names AS (SELECT island FROM beats UNION SELECT island FROM judged UNION SELECT island FROM drift)
        SELECT names.island, beats.view, beats.accelerator, beats.engine, beats.version, beats.groups_done,
               beats.tokens, beats.peak_tokens_per_s, beats.last_seen,
               coalesce(drift.drift_state, 'ok') AS drift_state, drift.drift_since_version,
               coalesce(drift.quarantined AND drift.drift_state = 'flagged', false) AS quarantined,
               judged.window_kl_k3, judged.baseline_kl_k3, round(judged.window_ess_ratio, 4) AS window_ess_ratio
        FROM names LEFT JOIN beats USING (island) LEFT JOIN judged USING (island) LEFT JOIN drift USING (island)
        ORDER BY names.island""",
    # What was refused, where and by whom; text someone else wrote goes through `printable` (see
    # pipeline/sql.py), so a payload full of terminal escapes prints as escapes.
    "dead-letters": """
        SELECT produced_at, stream, original_seq AS seq, consumer, error_class,
               printable(encode(reason), 120) AS reason, octet_length(payload) AS payload_bytes,
               printable(payload, 160) AS payload, printable(encode(original_subject), 120) AS subject,
               num_delivered
        FROM dead_letters ORDER BY produced_at, stream, seq""",
}


def lineage_sql(con: duckdb.DuckDBPyConnection, views: list[str], version: int) -> str:
    row = query(con, views, f"SELECT lineage_uri FROM versions WHERE version = {int(version)}").fetchone()
    if row is None:
        raise SprawlError(f"version {version} is not in the archive", hint="`SELECT version FROM versions`")
    if row[0] is None:
        raise SprawlError(f"version {version} has no lineage (version 0 is the initial weights)")
    joins = []
    select = ["m.group_id", "m.trajectory_id", "m.trajectory_seq"]
    if "trajectories" in views:
        joins.append("LEFT JOIN trajectories t ON t.trajectory_id = m.trajectory_id")
        select += [
            "t.island.island_id AS island",
            "t.island.view AS view",
            "list_transform(t.version_spans, s -> s.version) AS sampled_at_versions",
            "len(t.output_token_ids) AS tokens",
        ]
    if "rewards" in views:
        joins.append("LEFT JOIN rewards r ON r.trajectory_id = m.trajectory_id")
        select += ["r.value AS reward", "r.error_class"]
    # Members are `schemas.lineage.LineageMember` arrays: [trajectory_id, trajectory_seq, reward_seq].
    return f"""
        WITH lineage AS (SELECT unnest(groups) AS g FROM read_json('{row[0]}')),
             m AS (SELECT g.group_id AS group_id, unnest(g.members) AS member FROM lineage),
             m2 AS (SELECT group_id, json_extract_string(CAST(member AS JSON), '$[0]') AS trajectory_id,
                           CAST(json_extract(CAST(member AS JSON), '$[1]') AS BIGINT) AS trajectory_seq FROM m)
        SELECT {", ".join(select)} FROM m2 AS m {" ".join(joins)} ORDER BY m.group_id, m.trajectory_id"""
