"""`sprawl`: the one console script. Subcommands parse their config before importing anything heavy."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path

from pipeline.errors import SprawlError


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="TOML settings file (else SPRAWL_CONFIG)")
    parser.add_argument("--run", dest="run_id", default=None, help="run id (else SPRAWL_RUN_ID, default 'local')")
    parser.add_argument("--state-dir", type=Path, default=None, help="state folder (default .sprawl)")


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    overrides: dict[str, object] = {}
    if args.run_id:
        overrides["run_id"] = args.run_id
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    return overrides


def _last_up_run(args: argparse.Namespace) -> str | None:
    """The run `sprawl up` last ran under this state folder, when nothing else names a run: so that
    `just sql` right after `just up` queries that run."""
    if args.run_id or os.environ.get("SPRAWL_RUN_ID") or args.config or os.environ.get("SPRAWL_CONFIG"):
        return None
    marker = (args.state_dir or Path(os.environ.get("SPRAWL_STATE_DIR", ".sprawl"))) / "current_run"
    return marker.read_text().strip() or None if marker.is_file() else None


def _settings(cls, args: argparse.Namespace):
    """Load a worker's settings and set up its logs (before anything heavy is imported)."""
    from pipeline.config import load_settings
    from pipeline.logs import configure_logging

    overrides = _overrides(args)
    remembered = _last_up_run(args)
    if remembered is not None:
        overrides["run_id"] = remembered
    settings = load_settings(cls, args.config, **overrides)
    configure_logging(settings.run_id, settings.log_format, settings.log_level)
    return settings


def _stack_settings(args: argparse.Namespace):
    from infra.stack import StackSettings

    return _settings(StackSettings, args)


def _print_stack(st) -> None:
    word = "already running" if st.already_running else "up"
    print(f"stack {word} (state: {st.state_dir})")
    for name, url in st.endpoints().items():
        print(f"  {name:<13} {url}")
    print(f"  {'buckets':<13} {', '.join(st.buckets)}")
    for server in st.servers:
        print(f"  {server.name:<13} pid {server.pid}, log {server.log_file}")


def cmd_stack(args: argparse.Namespace) -> int:
    from infra import stack

    settings = _stack_settings(args)
    if args.action == "up":
        _print_stack(stack.up(settings))
    elif args.action == "down":
        stopped = stack.down(settings)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    else:
        st = stack.status(settings)
        if st is None:
            print("stack is not running")
            return 1
        _print_stack(st)
    return 0


async def _apply_infra(settings) -> list[str]:
    from infra.streams import apply
    from pipeline.eventlog import connect_nats

    nc = await connect_nats(settings.nats, name="sprawl-infra-apply")
    try:
        report = await apply(nc.jetstream(), settings.streams, settings.run_id)
    finally:
        await nc.close()
    return (
        [f"created {x}" for x in report.created]
        + [f"updated {x}" for x in report.updated]
        + [f"unchanged {x}" for x in report.unchanged]
    )


def cmd_infra(args: argparse.Namespace) -> int:
    from pipeline.config import SprawlSettings

    settings = _settings(SprawlSettings, args)
    for line in asyncio.run(_apply_infra(settings)):
        print(line)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """The stack, the whole fleet, a real short RL run on a mixed-precision fleet, and its summary."""
    from pydantic import ValidationError

    from infra.stack import StackSettings
    from workers.up.orchestrate import UpOptions, run_up

    try:
        options = UpOptions(
            quick=args.quick,
            islands=args.islands,
            views=args.views,
            correction=args.correction,
            fresh=args.fresh,
            json_output=args.json,
            versions=args.versions,
            live=False if args.no_live else None,
        )
    except ValidationError as exc:
        raise SprawlError(
            "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors()), hint="see `sprawl up --help`"
        ) from None
    result = run_up(options, StackSettings, args.config, _overrides(args))
    if args.json:
        print(json.dumps(result.summary))
    return 130 if result.interrupted else 0


def _emit(relation, fmt: str, output: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = list(relation.columns)
    if fmt == "parquet":
        if output is None:
            raise SprawlError("--format parquet needs --output FILE")
        relation.write_parquet(str(output))
        return
    rows = relation.fetchall()
    if fmt == "json":
        text = json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str)
    elif fmt == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows(rows)
        text = buffer.getvalue()
    else:
        table = Table(*columns)
        for row in rows:
            table.add_row(*(str(v) for v in row))
        Console(width=200).print(table)
        return
    if output is not None:
        output.write_text(text)
    else:
        print(text)


def _archive(args: argparse.Namespace):
    from pipeline.audit import open_archive
    from pipeline.config import SprawlSettings

    settings = _settings(SprawlSettings, args)
    if getattr(args, "fresh", False):
        from workers.archiver import ArchiverSettings, drain_once

        asyncio.run(drain_once(_settings(ArchiverSettings, args)))
    return settings, *open_archive(settings)


def cmd_sql(args: argparse.Namespace) -> int:
    """DuckDB SQL over the run's archive (views named after the events), or plain DuckDB if there is none."""
    from pipeline.audit import VIEWS, ArchiveMissing, query
    from pipeline.config import SprawlSettings
    from pipeline.sql import open_duckdb

    try:
        _, con, views = _archive(args)
    except (ArchiveMissing, SprawlError) as exc:  # no archive (or no S3): plain DuckDB still answers
        if any(re.search(rf"\b{name}\b", args.query.lower()) for name in VIEWS):
            raise
        print(f"sprawl: note: {exc}", file=sys.stderr)
        con, views = open_duckdb(_settings(SprawlSettings, args)), []
    _emit(query(con, views, args.query), args.format, args.output)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """The canned audits."""
    from pipeline.audit import AUDITS, lineage_sql, query

    _, con, views = _archive(args)
    sql = lineage_sql(con, views, args.version) if args.name == "lineage" else AUDITS[args.name]
    _emit(query(con, views, sql), args.format, args.output)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from workers.up.report import write_report

    settings, con, views = _archive(args)
    path = write_report(con, views, settings.run_id, args.output)
    print(f"report written to {path}")
    return 0


def cmd_archiver(args: argparse.Namespace) -> int:
    from workers.archiver import ArchiverSettings, run_archiver

    asyncio.run(run_archiver(_settings(ArchiverSettings, args)))
    return 0


def cmd_sampler(args: argparse.Namespace) -> int:
    """A sampler island: engine + version follower + prompt consumer."""
    from workers.sampler.worker import SamplerSettings, run_sampler

    asyncio.run(run_sampler(_settings(SamplerSettings, args)))
    return 0


def cmd_sidecar(args: argparse.Namespace) -> int:
    """The version-aware HTTP sidecar in front of one engine."""
    from workers.sampler.sidecar import SidecarSettings, run_sidecar

    asyncio.run(run_sidecar(_settings(SidecarSettings, args)))
    return 0


def cmd_trainer(args: argparse.Namespace) -> int:
    """The trainer: corrected GRPO updates, versions out, recovery by replay."""
    from workers.trainer.loop import run_trainer
    from workers.trainer.settings import TrainerSettings

    asyncio.run(run_trainer(_settings(TrainerSettings, args)))
    return 0


def cmd_rewards(args: argparse.Namespace) -> int:
    """The reward worker: verifiers, sandboxed."""
    from workers.rewards.worker import RewardSettings, run_rewards

    asyncio.run(run_rewards(_settings(RewardSettings, args)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from workers.bench import run_bench

    return run_bench(args.name, quick=args.quick, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sprawl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_stack = sub.add_parser("stack", help="the local nats-server + SeaweedFS stack")
    p_stack.add_argument("action", choices=["up", "down", "status"])
    _common(p_stack)
    p_stack.set_defaults(func=cmd_stack)

    p_up = sub.add_parser("up", help="the stack, the fleet and a real short RL run, live, with a summary")
    p_up.add_argument("--quick", action="store_true", help="a shorter run (30 updates)")
    p_up.add_argument("--islands", type=int, default=2, help="sampler islands (default 2)")
    p_up.add_argument("--views", default="bf16,fp8", help="served views, assigned to islands in turn (bf16, fp8)")
    p_up.add_argument(
        "--correction", default="sc+mis+mask", help="off-policy correction: sc, mis, tis, mask, geo, seq, ppo, none"
    )
    p_up.add_argument("--fresh", action="store_true", help="start a new run instead of continuing the last one")
    p_up.add_argument("--versions", type=int, default=None, help="updates to add (default 500, quick 30)")
    p_up.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")
    p_up.add_argument("--no-live", action="store_true", help="progress lines instead of the live view")
    _common(p_up)
    p_up.set_defaults(func=cmd_up)

    p_infra = sub.add_parser("infra", help="declare streams and consumers")
    p_infra.add_argument("action", choices=["apply"])
    _common(p_infra)
    p_infra.set_defaults(func=cmd_infra)

    def _output_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
        parser.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
        parser.add_argument("--output", type=Path, default=None, help="write to a file instead of stdout")
        parser.add_argument("--fresh", action="store_true", help="archive what is in the log first")

    p_sql = sub.add_parser("sql", help="DuckDB SQL over the run's archive (views: versions, trajectories, ...)")
    p_sql.add_argument("query")
    _output_options(p_sql)
    _common(p_sql)
    p_sql.set_defaults(func=cmd_sql)

    p_audit = sub.add_parser("audit", help="canned audits: staleness, kl, lineage VERSION, fleet, dead-letters")
    p_audit.add_argument("name", choices=["staleness", "kl", "lineage", "fleet", "dead-letters"])
    p_audit.add_argument("version", nargs="?", type=int, default=None, help="for lineage: the version")
    _output_options(p_audit)
    _common(p_audit)
    p_audit.set_defaults(func=cmd_audit)

    p_report = sub.add_parser("report", help="an HTML run report with plots")
    p_report.add_argument("--output", type=Path, default=Path("sprawl-report.html"))
    p_report.add_argument("--fresh", action="store_true", help="archive what is in the log first")
    _common(p_report)
    p_report.set_defaults(func=cmd_report)

    p_archiver = sub.add_parser("archiver", help="run the archiver (every event to Parquet on S3)")
    _common(p_archiver)
    p_archiver.set_defaults(func=cmd_archiver)

    p_sampler = sub.add_parser("sampler", help="run a sampler island (SPRAWL_ISLAND__VIEW=bf16|fp8_e4m3, ...)")
    _common(p_sampler)
    p_sampler.set_defaults(func=cmd_sampler)

    p_sidecar = sub.add_parser("sidecar", help="version-aware HTTP sidecar (OpenAI-compatible) for one engine")
    _common(p_sidecar)
    p_sidecar.set_defaults(func=cmd_sidecar)

    p_trainer = sub.add_parser("trainer", help="run the trainer (SPRAWL_TRAINER__MODEL_DIR=...)")
    _common(p_trainer)
    p_trainer.set_defaults(func=cmd_trainer)

    p_rewards = sub.add_parser("rewards", help="run the reward worker (verifiers in bubblewrap sandboxes)")
    _common(p_rewards)
    p_rewards.set_defaults(func=cmd_rewards)

    p_bench = sub.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    p_bench.add_argument("name", choices=["log", "delta", "sync", "trainer", "sandbox", "audit"])
    p_bench.add_argument("--quick", action="store_true", help="fewer iterations")
    p_bench.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p_bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SprawlError as exc:
        print(f"sprawl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
