"""`sprawl`: the one console script.

Every command's flags are derived from its models by pydantic-settings: the settings of the worker
or tool it runs (`SprawlSettings` and its subclasses: `--nats.url`, `--trainer.learning-rate`, ...,
each with its docstring as help and its default shown) and the command's own options (a
`CommandOptions` model: `sprawl up --quick`, `sprawl sql --format`). Only the chosen command's
models are imported, and none of them imports torch: a command checks its configuration before
anything heavy loads. Precedence: flags > `SPRAWL_...` variables > `--config FILE` > defaults.

Errors a user can meet print as one line on stderr with a non-zero exit: a `SprawlError` with its
hint, a usage mistake, or one line per invalid setting naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import CliPositionalArg, CliSettingsSource, SettingsError

from pipeline.config import CommandOptions, SprawlSettings, load_settings, validation_lines
from pipeline.errors import SprawlError
from workers.bench import BENCHES

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


class UsageError(SprawlError):
    """The command line itself is wrong (an unknown flag, a missing argument)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message, hint=f"see `{self.prog} --help`")


# ---------------------------------------------------------------- the commands' own options


class OutputOptions(CommandOptions):
    format: Literal["table", "csv", "json", "parquet"] = "table"
    """How rows are printed (`parquet` needs --output)."""
    json_output: bool = Field(False, validation_alias="json")
    """Same as --format json."""
    output: Path | None = None
    """Write to this file instead of stdout."""
    fresh: bool = False
    """Archive what is in the log first."""

    @model_validator(mode="after")
    def _one_format(self) -> OutputOptions:
        if self.json_output and self.format not in ("table", "json"):
            raise ValueError(f"--json and --format {self.format} disagree: give one of them")
        if self.format == "parquet" and self.output is None:
            raise ValueError("--format parquet needs --output FILE")
        return self

    @property
    def chosen_format(self) -> str:
        return "json" if self.json_output else self.format


class SqlOptions(OutputOptions):
    query: CliPositionalArg[str]
    """DuckDB SQL; the archive's views are named after the events (versions, trajectories, ...)."""


class AuditOptions(OutputOptions):
    name: CliPositionalArg[Literal["staleness", "kl", "lineage", "fleet", "dead-letters"]]
    """Which audit: staleness, kl, lineage VERSION, fleet or dead-letters."""
    version: CliPositionalArg[int | None] = Field(None, ge=0)
    """For `lineage`: the policy version whose inputs to list."""


class ReportOptions(CommandOptions):
    output: Path | None = None
    """Folder the page (`report.html`) goes to; default: the run's folder, `<state_dir>/runs/<run_id>/`."""
    fresh: bool = False
    """Archive what is in the log first."""


class StackOptions(CommandOptions):
    action: CliPositionalArg[Literal["up", "down", "status", "export-kubernetes"]]
    """`up` (start the local stack in the background), `down` (stop it), `status` (where it runs) or
    `export-kubernetes DIR` (the stack's CA, accounts and run credentials as a kustomize overlay)."""
    directory: CliPositionalArg[Path | None] = None
    """For `export-kubernetes`: the folder to write (new or empty; it holds credentials)."""
    namespace: str | None = None
    """For `export-kubernetes`: the namespace (default: the overlay's: gpu -> sprawl, cpu-demo -> sprawl-demo)."""
    overlay: Literal["gpu", "cpu-demo"] = "gpu"
    """For `export-kubernetes`: the repository overlay the export builds on."""
    nats_cluster: int | None = None
    """For `up`: the log as this many JetStream servers (3: streams survive losing one); the same as
    `--stack.nats-cluster`."""


class TokenOptions(CommandOptions):
    action: CliPositionalArg[Literal["create", "list", "revoke"]]
    """`create` (print a new join token), `list` (tokens issued by this stack) or `revoke ID`."""
    token_id: CliPositionalArg[str | None] = None
    """For `revoke`: the token's id (`sprawl token list`)."""
    role: Literal["sampler", "rewards", "archiver", "auditor"] = "sampler"
    """The role the token's worker runs as."""
    ttl: str | None = Field(None, pattern=r"^\d+(\.\d+)?[smhd]?$")
    """How long the token is valid: seconds, or with a unit (`90m`, `12h`, `7d`); none: until revoked."""
    nats_url: str | None = None
    """The log's URL(s) as the worker reaches them (default: the stack's, 127.0.0.1: this machine only)."""
    s3_endpoint: str | None = None
    """The S3 endpoint as the worker reaches it (default: the stack's)."""

    @property
    def ttl_s(self) -> float | None:
        if self.ttl is None:
            return None
        unit = self.ttl[-1] if self.ttl[-1].isalpha() else "s"
        return float(self.ttl.rstrip("smhd")) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


class CheckOptions(CommandOptions):
    name: CliPositionalArg[Literal["permissions"]]
    """`permissions`: every role's forbidden and allowed actions on the running stack's log and bucket."""
    json_output: bool = Field(False, validation_alias="json")
    """Print one JSON object as the last line."""


class InfraOptions(CommandOptions):
    action: CliPositionalArg[Literal["apply"]]
    """`apply`: declare the run's streams and consumers (idempotent)."""


class BenchOptions(CommandOptions):
    name: CliPositionalArg[Literal[tuple(BENCHES)]] = Field(description=f"The benchmark: {', '.join(BENCHES)}.")  # type: ignore[valid-type]
    quick: bool = False
    """Fewer iterations."""
    json_output: bool = Field(False, validation_alias="json")
    """Print one JSON object as the last line."""
    wan: bool = False
    """`sync` only: islands in network namespaces of their own, joined by tokens over tbf-shaped links."""


# ---------------------------------------------------------------- the registry of commands


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[Any, Any], int]
    """(options, settings) -> exit code."""
    settings: str | None = None
    """`module:Class` of the settings it runs with (imported only when the command runs)."""
    options: str | type[CommandOptions] | None = None
    """Its own flags: a model, or `module:Class` of one."""
    remembers_run: bool = False
    """Without a run named anywhere, use the run `sprawl up` last ran under the same state folder."""


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _cli_source(model: type, parser: argparse.ArgumentParser, *, toggles: bool = False) -> CliSettingsSource:
    """Add `model`'s fields to `parser` as flags: nested sections as `--section.field`, kebab-case,
    docstrings as help, defaults shown, booleans as `--flag/--no-flag` (with `toggles`, only the one
    that changes the default: `--quick`, `--no-live`)."""
    return CliSettingsSource(
        model,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags="toggle" if toggles else "dual",
        cli_avoid_json=True,
        cli_hide_none_type=True,
        cli_shortcuts={"run-id": "run"},
        cli_exit_on_error=False,
    )


# ---------------------------------------------------------------- what each command does


def cmd_stack(options: StackOptions, settings) -> int:
    from infra import stack

    if options.nats_cluster is not None:
        section = type(settings.stack).model_validate(
            {**settings.stack.model_dump(), "nats_cluster": options.nats_cluster}
        )
        settings = settings.model_copy(update={"stack": section})
    if options.action == "export-kubernetes":
        return _export_kubernetes(options, settings)
    if options.action == "up":
        st = stack.up(settings)
        if st.secure:
            from infra.join_token import revoke_expired

            revoke_expired(settings, st)
        _print_stack(st)
    elif options.action == "down":
        stopped = stack.down(settings)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    else:
        st = stack.status(settings)
        if st is None:
            dead = stack.dead_servers(settings)
            if dead:
                names = ", ".join(f"{s.name} (pid {s.pid})" for s in dead)
                print(f"stack is half-dead: {names} not running; `sprawl stack up` restarts only that")
            else:
                print("stack is not running")
            return 1
        _print_stack(st)
    return 0


def _export_kubernetes(options: StackOptions, settings) -> int:
    from infra.deploy.kubernetes_export import export_kubernetes

    if options.directory is None:
        raise UsageError("export-kubernetes needs the folder to write", hint="sprawl stack export-kubernetes DIR")
    done = export_kubernetes(
        settings.state_dir / "stack",
        options.directory,
        run_id=settings.run_id,
        namespace=options.namespace,
        overlay=options.overlay,
        signing_key_file=settings.trust.signing_key_file,
    )
    print(
        f"wrote {done.directory}: overlay {done.overlay}, namespace {done.namespace}, run {done.run_id}, "
        f"account {done.account}"
    )
    print(f"  kubectl apply -k {done.directory}")
    return 0


def _print_stack(st) -> None:
    restarted = any(action.startswith("restarted") for action in st.actions)
    word = "already running" if st.already_running else ("repaired" if restarted else "up")
    print(f"stack {word} (state: {st.state_dir})")
    for action in st.actions:
        print(f"  {action}")
    for name, url in st.endpoints().items():
        print(f"  {name:<13} {url}")
    print(f"  {'buckets':<13} {', '.join(st.buckets)}")
    if st.secure:
        print(f"  {'security':<13} TLS (CA {st.ca_file}), an identity per role; `sprawl token create` for islands")
    else:
        print(f"  {'security':<13} NONE: no TLS, no identities (stack.secure = false)")
    for server in st.servers:
        print(f"  {server.name:<13} pid {server.pid}, log {server.log_file}")


def cmd_token(options: TokenOptions, settings) -> int:
    """Join tokens of the local secure stack: create, list, revoke."""
    import time

    from infra import join_token, stack
    from workers.up.orchestrate import run_trust

    if (running := stack.status(settings)) is not None and running.secure:
        join_token.revoke_expired(settings, running)
    if options.action == "list":
        for token_id, entry in join_token.list_tokens(settings).items():
            state = "revoked" if entry["revoked_at"] else "active"
            if state == "active" and entry["expires_at"] and entry["expires_at"] <= time.time():
                state = "expired"
            print(f"{token_id}  {entry['role']:<9} run {entry['run_id']}  {state}")
        return 0
    if options.action == "revoke":
        if not options.token_id:
            raise UsageError("`sprawl token revoke` needs the token's ID", hint="`sprawl token list` shows them")
        # A half-dead stack too: the live servers must drop the token now, not after a repair.
        partial = stack.partly_running(settings)
        if partial is None:
            raise SprawlError("the stack is not running here", hint="`sprawl stack up` (or `sprawl up`) first")
        for line in join_token.revoke_token(settings, partial, options.token_id):
            print(line)
        return 0
    st = stack.status(settings)
    if st is None:
        raise SprawlError("the stack is not running here", hint="`sprawl stack up` (or `sprawl up`) first")
    public_key = run_trust(settings).verifier.version_public_key
    if public_key is None:
        raise SprawlError(
            "this run publishes unsigned versions: a token would give islands nothing to verify against",
            hint="unset SPRAWL_TRUST__ALLOW_UNSIGNED_VERSIONS so the trainer signs",
        )
    issued = join_token.create_token(
        settings,
        st,
        options.role,
        ttl_s=options.ttl_s,
        nats_urls=options.nats_url.split(",") if options.nats_url else None,
        s3_endpoint=options.s3_endpoint,
        version_public_key=public_key,
    )
    print(issued.text)
    print(f"token {issued.token.token_id}: role {options.role}, run {settings.run_id}", file=sys.stderr)
    return 0


def cmd_check(options: CheckOptions, settings) -> int:
    """`sprawl check permissions`: the permission matrix against the running secure stack. Exit 1 when
    any attempt went otherwise than the roles say (each one is printed)."""
    from infra import stack
    from infra.permission_check import check_stack_permissions

    st = stack.status(settings)
    if st is None:
        raise SprawlError("the stack is not running here", hint="`sprawl stack up` (or `sprawl up`) first")
    counts, surprises = check_stack_permissions(settings, st)
    for surprise in surprises:
        print(f"UNEXPECTED: {json.dumps(surprise)}", file=sys.stderr)
    if options.json_output:
        print(json.dumps(counts))
    else:
        for key, value in counts.items():
            print(f"{key:<22} {value}")
    return 1 if surprises else 0


def cmd_infra(options: InfraOptions, settings) -> int:
    async def apply() -> list[str]:
        from infra.streams import apply
        from pipeline.eventlog import connect_nats

        nc = await connect_nats(settings.nats, name="sprawl-infra-apply")
        try:
            report = await apply(
                nc.jetstream(), settings.streams, settings.run_id, log=settings.log, nats=settings.nats
            )
        finally:
            await nc.close()
        return (
            [f"created {x}" for x in report.created]
            + [f"updated {x}" for x in report.updated]
            + [f"unchanged {x}" for x in report.unchanged]
        )

    for line in asyncio.run(apply()):
        print(line)
    return 0


def cmd_up(options, settings) -> int:
    """The stack, the whole fleet, a real short RL run on a mixed-precision fleet, and its summary."""
    from workers.up.orchestrate import run_up

    result = run_up(options, settings)
    if options.json_output:
        print(json.dumps(result.summary))
    return result.exit_code  # 128 + the signal that stopped it (130 for Ctrl-C, 143 for SIGTERM), else 0


_CELL_CHARS = 2000
"""A table cell is cut past this many characters (`--format json` or `csv` for whole values)."""


def _emit(relation, fmt: str, output: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from pipeline.sql import printable

    columns = list(relation.columns)
    if fmt == "parquet":
        assert output is not None  # OutputOptions refuses parquet without --output
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
        table = Table()
        for column in columns:
            table.add_column(Text(printable(str(column).encode(), _CELL_CHARS)))
        for row in rows:
            # Cells hold what others wrote (a program's stderr, a refused payload): escaped, so no byte
            # in them drives the terminal, and plain Text, so no `[...]` in them is taken as markup.
            table.add_row(*(Text(printable(str(v).encode(), _CELL_CHARS)) for v in row))
        Console(width=200).print(table)
        return
    if output is not None:
        output.write_text(text)
    else:
        print(text)


def _archive(settings, fresh: bool):
    from pipeline.audit import open_archive

    if fresh:
        from workers.archiver import drain_once

        asyncio.run(drain_once(settings))  # an unreachable log fails after nats.connect_attempts
    return open_archive(settings)


def cmd_sql(options: SqlOptions, settings) -> int:
    """DuckDB SQL over the run's archive (views named after the events), or plain DuckDB if there is none."""
    from pipeline.audit import VIEWS, ArchiveMissing, query
    from pipeline.errors import LogUnavailable
    from pipeline.sql import open_duckdb, user_query_errors

    try:
        con, views = _archive(settings, options.fresh)
    except LogUnavailable:  # --fresh asked for what is in the log: an answer without it would mislead
        raise
    except (ArchiveMissing, SprawlError) as exc:  # no archive (or no S3): plain DuckDB still answers
        if any(re.search(rf"\b{name}\b", options.query.lower()) for name in VIEWS):
            raise
        print(f"sprawl: note: {exc}", file=sys.stderr)
        con, views = open_duckdb(settings), []
    with user_query_errors(views):  # DuckDB executes lazily: the fetch in _emit can fail too
        _emit(query(con, views, options.query), options.chosen_format, options.output)
    return 0


def cmd_audit(options: AuditOptions, settings) -> int:
    """The canned audits."""
    from pipeline.audit import AUDITS, lineage_sql, query

    if options.name == "lineage" and options.version is None:
        raise UsageError("`sprawl audit lineage` needs a VERSION", hint="e.g. `sprawl audit lineage 3`")
    if options.name != "lineage" and options.version is not None:
        raise UsageError(f"`sprawl audit {options.name}` takes no VERSION", hint="only `lineage` does")
    con, views = _archive(settings, options.fresh)
    sql = lineage_sql(con, views, options.version) if options.name == "lineage" else AUDITS[options.name]
    _emit(query(con, views, sql), options.chosen_format, options.output)
    return 0


def cmd_report(options: ReportOptions, settings) -> int:
    from workers.up.report import run_folder, write_run_report

    con, views = _archive(settings, options.fresh)
    output_dir = options.output if options.output is not None else run_folder(settings.state_dir, settings.run_id)
    path = write_run_report(con, views, settings.run_id, output_dir)
    print(f"report written to {path}")
    return 0


def cmd_archiver(options, settings) -> int:
    from workers.archiver import run_archiver

    asyncio.run(run_archiver(settings))
    return 0


def cmd_sampler(options, settings) -> int:
    from workers.sampler.worker import run_sampler

    asyncio.run(run_sampler(settings))
    return 0


def cmd_sidecar(options, settings) -> int:
    from workers.sampler.sidecar import run_sidecar

    asyncio.run(run_sidecar(settings))
    return 0


def cmd_trainer(options, settings) -> int:
    from workers.trainer.distributed import launched_by_torchrun

    if settings.trainer.ranks > 1 and not launched_by_torchrun():
        from workers.trainer.launch import launch_ranks

        return launch_ranks(settings, sys.argv[1:])
    from workers.trainer.loop import run_trainer

    asyncio.run(run_trainer(settings))
    return 0


def cmd_prompts(options, settings) -> int:
    from workers.prompts.driver import run_prompts

    asyncio.run(run_prompts(settings))
    return 0


def cmd_rewards(options, settings) -> int:
    from workers.rewards.worker import run_rewards

    asyncio.run(run_rewards(settings))
    return 0


def cmd_experiment(options, settings) -> int:
    from workers.experiment.stability import cmd_experiment as run_experiment

    return run_experiment(options, settings)


def cmd_bench(options: BenchOptions, settings) -> int:
    from workers.bench import run_bench

    return run_bench(options.name, quick=options.quick, as_json=options.json_output, wan=options.wan)


ARCHIVE = "workers.archiver:ArchiverSettings"

COMMANDS: dict[str, Command] = {
    "stack": Command("the local nats-server + SeaweedFS stack", cmd_stack, "infra.stack:StackSettings", StackOptions),
    "up": Command(
        "the stack, the fleet and a real short RL run, live, with a summary",
        cmd_up,
        "workers.up.options:UpSettings",
        "workers.up.options:UpOptions",
    ),
    "infra": Command("declare streams and consumers", cmd_infra, "pipeline.config:SprawlSettings", InfraOptions),
    "check": Command("checks of a running stack: permissions", cmd_check, "infra.stack:StackSettings", CheckOptions),
    "token": Command(
        "join tokens for workers elsewhere: create, list, revoke",
        cmd_token,
        "infra.stack:StackSettings",
        TokenOptions,
        True,
    ),
    "sql": Command(
        "DuckDB SQL over the run's archive (views: versions, trajectories, ...)", cmd_sql, ARCHIVE, SqlOptions, True
    ),
    "audit": Command(
        "canned audits: staleness, kl, lineage VERSION, fleet, dead-letters", cmd_audit, ARCHIVE, AuditOptions, True
    ),
    "report": Command("an HTML run report with plots", cmd_report, ARCHIVE, ReportOptions, True),
    "archiver": Command("run the archiver (every event to Parquet on S3)", cmd_archiver, ARCHIVE),
    "sampler": Command("run a sampler island", cmd_sampler, "workers.sampler.settings:SamplerSettings"),
    "sidecar": Command(
        "version-aware HTTP sidecar (OpenAI-compatible) for one engine",
        cmd_sidecar,
        "workers.sampler.settings:SidecarSettings",
    ),
    "trainer": Command("run the trainer", cmd_trainer, "workers.trainer.settings:TrainerSettings"),
    "prompts": Command(
        "publish the task's prompt groups ahead of the trainer",
        cmd_prompts,
        "workers.prompts.settings:PromptsSettings",
    ),
    "rewards": Command(
        "run the reward worker (verifiers, sandboxed)", cmd_rewards, "workers.rewards.worker:RewardSettings"
    ),
    "bench": Command("benchmarks (ratios against a baseline measured in the same run)", cmd_bench, None, BenchOptions),
    "experiment": Command(
        "experiments made of real runs: `stability` (which corrections keep a mixed fleet from collapsing)",
        cmd_experiment,
        "workers.experiment.stability:StabilitySettings",
        "workers.experiment.stability:ExperimentOptions",
    ),
}


# ---------------------------------------------------------------- parsing


@dataclass
class Invocation:
    name: str
    command: Command
    options: Any
    settings: Any


def parser_for(name: str | None) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The `sprawl` parser with every command listed and `name`'s flags derived from its models.
    Returns the parser and the CLI sources of `name` (`options`, `settings`)."""
    parser = _Parser(prog="sprawl", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sources: dict[str, Any] = {}
    for command_name, command in COMMANDS.items():
        p = sub.add_parser(
            command_name,
            help=command.help,
            description=command.help,
            allow_abbrev=False,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if command_name != name:
            continue
        if command.options is not None:
            model = _import(command.options) if isinstance(command.options, str) else command.options
            sources["options"] = (model, _cli_source(model, p, toggles=True))
        if command.settings is not None:
            p.add_argument(
                "--config",
                type=Path,
                default=None,
                metavar="FILE",
                help="TOML settings file (else SPRAWL_CONFIG); flags and SPRAWL_... variables take precedence",
            )
            model = _import(command.settings)
            sources["settings"] = (model, _cli_source(model, p))
    return parser, sources


def _task_shorthand(argv: list[str]) -> list[str]:
    """`sprawl up --task NAME` as `--task.name NAME`. `--task` itself belongs to the `[task]` section
    (its JSON form, `--task '{...}'`), which keeps that meaning; a value that is not JSON is a name."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--task" and i + 1 < len(argv) and not argv[i + 1].lstrip().startswith("{"):
            out.append("--task.name")
        elif arg.startswith("--task=") and not arg.removeprefix("--task=").lstrip().startswith("{"):
            out.append("--task.name=" + arg.removeprefix("--task="))
        else:
            out.append(arg)
    return out


def parse(argv: list[str]) -> Invocation:
    """Parse and validate a command line: the command, its options and its settings."""
    name = argv[0] if argv and argv[0] in COMMANDS else None
    if name == "up":
        argv = _task_shorthand(argv)
    parser, sources = parser_for(name)
    try:
        namespace = parser.parse_args(argv)
    except UsageError as exc:  # argparse reports unknown flags at the top level: point at the command's help
        if name is None:
            raise
        raise UsageError(exc.message, hint=f"see `sprawl {name} --help`") from None
    command = COMMANDS[namespace.command]
    options = settings = None
    if "options" in sources:
        model, source = sources["options"]
        options = model(_cli_settings_source=source(parsed_args=namespace))
    if "settings" in sources:
        model, source = sources["settings"]

        def reload(**overrides: object) -> Any:  # flags still win over what the overrides set
            return load_settings(model, namespace.config, cli_source=source(parsed_args=namespace), **overrides)

        settings = reload()
        if command.remembers_run and "run_id" not in settings.model_fields_set:
            remembered = last_up_run(settings)
            if remembered is not None:
                settings = reload(run_id=remembered)
        settings = _identity(namespace.command, settings, reload)
    return Invocation(namespace.command, command, options, settings)


ROLE_OF_COMMAND = {
    "trainer": "trainer",
    # The trainer role may publish prompt groups (infra/roles.py); a driver needs nothing more.
    "prompts": "trainer",
    "sampler": "sampler",
    "sidecar": "sampler",
    "rewards": "rewards",
    "archiver": "archiver",
    # `--fresh` archives what is in the log first: the archiver's grants.
    "sql": "archiver",
    "audit": "archiver",
    "report": "archiver",
}
"""The identity a command connects with (the stack's own commands are the admin's)."""


def _identity(command: str, settings: Any, reload: Callable[..., Any]) -> Any:
    """Who a worker is on the log and the blob store, and which version key it trusts:
    - with a join token (`--join`), what the token says (it must be for this command's role);
    - else, on the machine of a secure local stack and with no credentials configured, the command's
      role on that stack, and the version key of `sprawl up` in the same state folder;
    - else the settings as given."""
    if not isinstance(settings, SprawlSettings):
        return settings
    role = ROLE_OF_COMMAND.get(command, "admin")
    if settings.join is not None:
        from infra.join_token import JoinTokenError, decode, join_settings

        text = settings.join.get_secret_value()
        if text.startswith("@"):  # a file: a token on the command line is visible to every user in `ps`
            text = Path(text[1:]).expanduser().read_text()
        token = decode(text)
        if token.role != role:
            raise JoinTokenError(
                f"this token is for the {token.role} role; `sprawl {command}` runs as {role}",
                hint=f"create one with `sprawl token create --role {role}`",
            )
        return reload(**join_settings(text, settings.state_dir))
    pointed_elsewhere = "url" in settings.nats.model_fields_set
    if settings.nats.creds_file is None and settings.nats.user is None and not pointed_elsewhere:
        from infra import stack

        settings = stack.with_role(settings, role)
    if role != "admin" and settings.trust.version_public_key is None and settings.trust.signing_key_file is None:
        from workers.up.orchestrate import run_trust, signing_key_path

        # The key `sprawl up` made in this state folder, as `up` hands it out (never made here).
        if signing_key_path(settings.state_dir).exists() and not settings.trust.allow_unsigned_versions:
            trust = run_trust(settings)
            settings = settings.model_copy(update={"trust": trust.signer if role == "trainer" else trust.verifier})
    return settings


def last_up_run(settings: SprawlSettings) -> str | None:
    """The run `sprawl up` last ran under this state folder: so that `just sql` right after `just up`
    queries that run."""
    marker = settings.state_dir / "current_run"
    return (marker.read_text().strip() or None) if marker.is_file() else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        invocation = parse(argv)
        if isinstance(invocation.settings, SprawlSettings):
            from pipeline.logs import configure_logging

            s = invocation.settings
            configure_logging(s.run_id, s.log_format, s.log_level)
        return invocation.command.run(invocation.options, invocation.settings)
    except ValidationError as exc:
        for line in validation_lines(exc):
            print(f"sprawl: error: {line}", file=sys.stderr)
        return EXIT_ERROR
    except SettingsError as exc:  # a flag's value pydantic-settings could not read
        print(f"sprawl: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_ERROR
    except SprawlError as exc:
        print(f"sprawl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as exc:  # no traceback: one line, and the code a shell gives a Ctrl-C'd process
        print("sprawl: stopped", file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
