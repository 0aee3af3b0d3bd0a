"""`sprawl`: the one console script. Subcommands parse their config before importing anything heavy."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
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


def _settings(cls, args: argparse.Namespace):
    """Load a worker's settings and set up its logs (before anything heavy is imported)."""
    from pipeline.config import load_settings
    from pipeline.logs import configure_logging

    settings = load_settings(cls, args.config, **_overrides(args))
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
    """Bring the stack up (or reuse it), declare the run's streams, stay up until Ctrl-C."""
    from infra import stack

    settings = _stack_settings(args)
    st = stack.up(settings)
    _print_stack(st)
    applied = asyncio.run(_apply_infra(settings))
    print(
        f"infra: {sum(1 for a in applied if not a.startswith('unchanged'))} declared/updated, "
        f"{sum(1 for a in applied if a.startswith('unchanged'))} unchanged (run {settings.run_id})"
    )
    if args.detach:
        return 0
    print(
        "stack is up; Ctrl-C stops it"
        if not st.already_running
        else "Ctrl-C exits (the stack was already running and stays up)"
    )
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    while not stop:
        signal.pause() if hasattr(signal, "pause") else None
    if not st.already_running:
        print("stopping: " + ", ".join(stack.down(settings)))
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    """Run one SQL statement in DuckDB with S3 access configured like every worker's."""
    from rich.console import Console
    from rich.table import Table

    from pipeline.config import SprawlSettings
    from pipeline.sql import open_duckdb

    settings = _settings(SprawlSettings, args)
    con = open_duckdb(settings)
    result = con.execute(args.query)
    columns = [d[0] for d in result.description or []]
    rows = result.fetchall()
    if args.json:
        print(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str))
        return 0
    table = Table(*columns)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    Console().print(table)
    return 0


def cmd_sampler(args: argparse.Namespace) -> int:
    """A sampler island: engine + version follower + prompt consumer."""
    from workers.sampler import SamplerSettings

    settings = _settings(SamplerSettings, args)
    from workers.sampler import run_sampler

    asyncio.run(run_sampler(settings))
    return 0


def cmd_sidecar(args: argparse.Namespace) -> int:
    """The version-aware HTTP sidecar in front of one engine."""
    from workers.sidecar import SidecarSettings

    settings = _settings(SidecarSettings, args)
    from workers.sidecar import run_sidecar

    asyncio.run(run_sidecar(settings))
    return 0


def cmd_trainer(args: argparse.Namespace) -> int:
    """The trainer: corrected GRPO updates, versions out, recovery by replay."""
    from workers.trainer import TrainerSettings

    settings = _settings(TrainerSettings, args)
    from workers.trainer import run_trainer

    asyncio.run(run_trainer(settings))
    return 0


def cmd_rewards(args: argparse.Namespace) -> int:
    """The reward worker: verifiers, sandboxed."""
    from workers.rewards import RewardSettings

    settings = _settings(RewardSettings, args)
    from workers.rewards import run_rewards

    asyncio.run(run_rewards(settings))
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

    p_up = sub.add_parser("up", help="stack up, streams declared, stays up until Ctrl-C")
    p_up.add_argument("--detach", action="store_true", help="return once the stack is up")
    _common(p_up)
    p_up.set_defaults(func=cmd_up)

    p_infra = sub.add_parser("infra", help="declare streams and consumers")
    p_infra.add_argument("action", choices=["apply"])
    _common(p_infra)
    p_infra.set_defaults(func=cmd_infra)

    p_sql = sub.add_parser("sql", help="DuckDB SQL with the run's S3 configured")
    p_sql.add_argument("query")
    p_sql.add_argument("--json", action="store_true", help="print rows as one JSON array")
    _common(p_sql)
    p_sql.set_defaults(func=cmd_sql)

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
    p_bench.add_argument("name", choices=["log", "delta", "sync", "trainer", "sandbox"])
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
