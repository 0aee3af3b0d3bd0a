"""Checks of rendered Kubernetes manifests against the schemas and against the code.

    python -m infra.deploy.kubernetes_check infra/deploy/kubernetes/overlays/gpu [more overlays]

renders each overlay with `kubectl kustomize` (kustomize built into kubectl) and prints one line per
problem, exiting 1 if there is any:
- every object against the Kubernetes API's schemas (`kubernetes-validate`, strict: an unknown field
  is an error, as `kubectl apply`'s field validation makes it), and every ScaledObject against KEDA's
  schema (`kubernetes/schemas/keda-scaledobject.schema.json`, vendored: no download);
- every `sprawl` container's command line against the CLI (a real command, flags it has) and its
  `SPRAWL_...` variables against that command's settings (each names a field; values that validate);
- the names the cluster shares with the code: the KEDA trigger's stream and consumer are the
  run's samplers consumer in pipeline/topology.py, its account is the run account of the log's
  operator auth (a public key, never `$G`, when nats.conf includes the stack's auth.conf; the very
  account that auth.conf preloads when the overlay carries it, as `sprawl stack export-kubernetes`
  writes it), inbox prefixes and credentials are the roles' own, stream replicas fit the NATS
  StatefulSet, islands serve views the trainer publishes, one prompt driver at a time.

tests/test_deploy_kubernetes.py runs these on every overlay in the repository; users run them on
their own overlays.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from pydantic import BaseModel

from pipeline.errors import SprawlError

KUBERNETES_DIR = Path(__file__).with_name("kubernetes")
OVERLAYS_DIR = KUBERNETES_DIR / "overlays"
KEDA_SCHEMA = KUBERNETES_DIR / "schemas" / "keda-scaledobject.schema.json"
KUBERNETES_VERSIONS = ("1.29", "1.37")
"""The oldest minor release still served by the big clouds' managed Kubernetes, and the newest schema
`kubernetes-validate` bundles: the manifests must be valid for both."""
RUN_CONFIG = "sprawl-run"
"""The ConfigMap that holds the run's shared settings (SPRAWL_RUN_ID, ...)."""
SETTINGS_FILE_VARIABLE = "SPRAWL_CONFIG"
"""Read by `load_settings` itself (a TOML file), not a settings field."""
_ACCOUNT_KEY = re.compile(r"^A[A-Z2-7]{55}$")
_HASH_SUFFIX = re.compile(r"-[bcdfghjklmnpqrstvwxz2456789]{10}$")
"""What kustomize appends to a generated ConfigMap's or Secret's name (a hash of its content)."""


class RenderError(SprawlError):
    """An overlay that kustomize cannot render."""


def overlays() -> list[Path]:
    return sorted(p for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())


def render(overlay: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize OVERLAY` renders."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RenderError(
            "kubectl is not installed: it renders the kustomize overlays (kustomize is built into it)",
            hint="install kubectl (any release since 1.27), or kustomize and run `kustomize build`",
        )
    done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RenderError(f"kustomize could not render {overlay}: {done.stderr.strip()}", hint="fix the overlay")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _name(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# ---------------------------------------------------------------- schemas


@functools.cache
def _keda_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(KEDA_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(docs: list[dict[str, Any]], versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> list[str]:
    import kubernetes_validate

    errors = []
    for doc in docs:
        if doc.get("apiVersion") == "keda.sh/v1alpha1":
            if doc.get("kind") != "ScaledObject":
                errors.append(f"{_name(doc)}: no schema of this KEDA kind is vendored (ScaledObject only)")
                continue
            for error in _keda_validator().iter_errors(doc):
                where = "/".join(str(p) for p in error.absolute_path)
                errors.append(f"{_name(doc)}: KEDA schema: {where}: {error.message}")
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                errors.append(f"{_name(doc)}: Kubernetes {version} schema: {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError:
                errors.append(f"{_name(doc)}: Kubernetes {version} has no {doc.get('apiVersion')} {doc.get('kind')}")
    return errors


# ---------------------------------------------------------------- containers and their settings


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    spec = doc.get("spec", {})
    if doc.get("kind") in ("Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet"):
        return spec.get("template", {}).get("spec")
    if doc.get("kind") == "Pod":
        return spec
    return None


def sprawl_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of the sprawl image (its repository ends in `sprawl`)."""
    for doc in docs:
        pod = _pod_spec(doc)
        if pod is None:
            continue
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            repository = container.get("image", "").rsplit(":", 1)[0]
            if repository.rsplit("/", 1)[-1] == "sprawl":
                yield doc, container


def _config_maps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}


SECRET_PLACEHOLDER = "secret-from-the-cluster"


def container_env(container: dict[str, Any], config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables the container starts with, as far as the manifests say: ConfigMap values
    resolved, Secrets and pod fields replaced by stand-ins (their values live in the cluster)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env |= config_maps.get(source["configMapRef"]["name"], {})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = config_maps.get(ref["name"], {}).get(ref["key"], "")
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = "pod-0"
        else:
            env[item["name"]] = SECRET_PLACEHOLDER
    return env


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation admits (through Optional, unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def names_a_field(model: type[BaseModel], variable: str) -> bool:
    """Whether `SPRAWL_A__B` names a field of `model` (`a.b`), as pydantic-settings reads it."""

    def resolves(models: list[type[BaseModel]], parts: list[str]) -> bool:
        for candidate in models:
            field = candidate.model_fields.get(parts[0])
            if field is None:
                continue
            if len(parts) == 1 or resolves(_models_in(field.annotation), parts[1:]):
                return True
        return False

    parts = variable.removeprefix("SPRAWL_").lower().split("__")
    return variable.startswith("SPRAWL_") and all(parts) and resolves([model], parts)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Only `env` (plus PATH and HOME) in os.environ for the duration: settings read nothing else."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if k in ("PATH", "HOME")} | env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def command_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Each sprawl container's command line parses and its settings validate with its variables."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from pipeline.config import load_settings, validation_lines
    from workers.cli import COMMANDS, parser_for

    errors = []
    config_maps = _config_maps(docs)
    for doc, container in sprawl_containers(docs):
        where = f"{_name(doc)} container {container.get('name')}"
        if container.get("command"):
            errors.append(f"{where}: sets `command`: the image's entry point is `sprawl`, give `args`")
        args = [str(a) for a in container.get("args", [])]
        if not args or args[0] not in COMMANDS:
            errors.append(f"{where}: `sprawl {' '.join(args)}` is not a sprawl command ({', '.join(COMMANDS)})")
            continue
        parser, sources = parser_for(args[0])
        try:
            namespace = parser.parse_args(args)
        except SprawlError as exc:
            errors.append(f"{where}: `sprawl {' '.join(args)}`: {exc}")
            continue
        env = container_env(container, config_maps)
        if "settings" not in sources:
            continue
        model, source = sources["settings"]
        for variable in sorted(env):
            is_setting = variable.startswith("SPRAWL_") and variable != SETTINGS_FILE_VARIABLE
            if is_setting and not names_a_field(model, variable):
                errors.append(f"{where}: {variable} is no setting of `sprawl {args[0]}` ({model.__name__})")
        try:
            with _environment(env):
                load_settings(model, None, cli_source=source(parsed_args=namespace))
                if "options" in sources:
                    options_model, options_source = sources["options"]
                    options_model(_cli_settings_source=options_source(parsed_args=namespace))
        except ValidationError as exc:
            errors += [f"{where}: {line}" for line in validation_lines(exc)]
        except (SettingsError, SprawlError) as exc:
            errors.append(f"{where}: {exc}")
    return errors


# ---------------------------------------------------------------- names shared with the code


def run_config(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The data of the `sprawl-run` ConfigMap (kustomize appends a hash of its content to the name)."""
    for name, data in _config_maps(docs).items():
        if re.fullmatch(rf"{RUN_CONFIG}(-[a-z0-9]{{10}})?", name):
            return data
    return {}


def run_id_of(docs: list[dict[str, Any]]) -> str:
    run = run_config(docs).get("SPRAWL_RUN_ID")
    if not run:
        raise RenderError(f"no ConfigMap {RUN_CONFIG} with SPRAWL_RUN_ID", hint="the base's configMapGenerator")
    return run


def topology_errors(docs: list[dict[str, Any]]) -> list[str]:
    from infra.nats_permissions import inbox_prefix
    from infra.roles import GRANTS, Role
    from pipeline.topology import PROMPTS, ConsumerRole, Kind, consumer_for
    from workers.cli import ROLE_OF_COMMAND

    errors = []
    run = run_id_of(docs)
    samplers = consumer_for(run, ConsumerRole.SAMPLERS)
    config_maps = _config_maps(docs)
    by_name = {_name(d): d for d in docs}
    commands = {_name(d): [str(a) for a in c.get("args", [])] for d, c in sprawl_containers(docs)}
    conf = by_name.get("ConfigMap/nats-config", {}).get("data", {}).get("nats.conf", "")
    operator_mode = bool(re.search(r"^\s*include\s+\S*auth\.conf", conf, re.MULTILINE))
    accounts = run_accounts(docs)

    # KEDA: every sampler workload is scaled on the run's samplers consumer, and nothing else is.
    scaled = set()
    for doc in docs:
        if doc.get("kind") != "ScaledObject":
            continue
        target = doc["spec"]["scaleTargetRef"]
        kind = target.get("kind", "Deployment")
        workload = by_name.get(f"{kind}/{target['name']}")
        if workload is None:
            errors.append(f"{_name(doc)}: scales {kind}/{target['name']}, which the manifests do not define")
            continue
        scaled.add(_name(workload))
        if commands.get(_name(workload), [""])[0] != "sampler":
            errors.append(f"{_name(doc)}: scales {_name(workload)}, which runs no `sprawl sampler`")
        for trigger in doc["spec"]["triggers"]:
            if trigger["type"] != "nats-jetstream":
                continue
            meta = trigger["metadata"]
            if meta.get("stream") != PROMPTS.name:
                errors.append(f"{_name(doc)}: stream {meta.get('stream')!r}; the prompts stream is {PROMPTS.name!r}")
            if meta.get("consumer") != samplers.name:
                errors.append(
                    f"{_name(doc)}: consumer {meta.get('consumer')!r}; run {run!r}'s samplers consumer is "
                    f"{samplers.name!r} (pipeline/topology.py)"
                )
            errors += _account_errors(doc, meta.get("account", ""), operator_mode, accounts)
            host, _, port = meta.get("natsServerMonitoringEndpoint", "").partition(":")
            service = by_name.get(f"Service/{host.split('.')[0]}")
            if service is None or service["spec"].get("clusterIP") != "None":
                errors.append(f"{_name(doc)}: {host!r} is no headless Service (KEDA asks each node by name)")
            elif not any(str(p.get("port")) == port for p in service["spec"].get("ports", [])):
                errors.append(f"{_name(doc)}: Service {host} has no port {port}")
    for name, args in commands.items():
        if args[:1] == ["sampler"] and name not in scaled:
            errors.append(f"{name}: a sampler workload without a ScaledObject")

    # Identities: a worker's inbox prefix is its role's in this run (its credentials allow no other).
    for doc, container in sprawl_containers(docs):
        env = container_env(container, config_maps)
        args = [str(a) for a in container.get("args", [])]
        if "SPRAWL_NATS__INBOX_PREFIX" in env and args:
            expected = inbox_prefix(ROLE_OF_COMMAND.get(args[0], "admin"), run)
            if env["SPRAWL_NATS__INBOX_PREFIX"] != expected:
                errors.append(
                    f"{_name(doc)}: SPRAWL_NATS__INBOX_PREFIX {env['SPRAWL_NATS__INBOX_PREFIX']!r}; "
                    f"`sprawl {args[0]}` in run {run!r} has {expected!r}"
                )
        creds = env.get("SPRAWL_NATS__CREDS_FILE")
        if creds and args and (source := _mounted_from(doc, container, creds)) is not None:
            role = ROLE_OF_COMMAND.get(args[0], "admin")
            if source != f"sprawl-{role}":
                errors.append(
                    f"{_name(doc)}: `sprawl {args[0]}` runs as {role} but its credentials come from Secret {source}"
                )
        if env.get("SPRAWL_RUN_ID", run) != run:
            errors.append(f"{_name(doc)}: SPRAWL_RUN_ID {env['SPRAWL_RUN_ID']!r}, the run is {run!r}")

    # Prompts: one driver at a time (two would race for the same groups), as a role that may publish them.
    for doc, container in sprawl_containers(docs):
        if [str(a) for a in container.get("args", [])][:1] != ["prompts"]:
            continue
        role = Role(ROLE_OF_COMMAND.get("prompts", "admin"))
        if role is not Role.ADMIN and Kind.PROMPTS not in GRANTS[role].publishes:
            errors.append(f"{_name(doc)}: `sprawl prompts` runs as {role.value}, which may not publish prompts")
        spec = doc.get("spec", {})
        if spec.get("replicas", 1) != 1 or spec.get("strategy", {}).get("type") != "Recreate":
            errors.append(f"{_name(doc)}: the prompt driver must be 1 replica with the Recreate strategy")

    # Replicas: a stream cannot have more replicas than there are servers.
    nats = by_name.get("StatefulSet/nats")
    replicas = int(run_config(docs).get("SPRAWL_STREAMS__REPLICAS", "1"))
    if nats is None:
        errors.append("no StatefulSet/nats: the log is missing")
    elif replicas > nats["spec"]["replicas"]:
        errors.append(f"streams have {replicas} replicas but StatefulSet/nats runs {nats['spec']['replicas']} servers")

    # Views: islands serve views the trainer publishes.
    published: set[str] = set()
    served: dict[str, str] = {}
    for doc, container in sprawl_containers(docs):
        args = [str(a) for a in container.get("args", [])]
        env = container_env(container, config_maps)
        if args[:1] == ["trainer"]:
            published |= set(json.loads(env.get("SPRAWL_CHAIN__VIEWS", '["bf16"]')))
        if args[:1] == ["sampler"]:
            view = args[args.index("--island.view") + 1] if "--island.view" in args else "bf16"
            served[_name(doc)] = view
    for name, view in served.items():
        if view not in published:
            errors.append(f"{name}: serves view {view!r}, which the trainer does not publish ({sorted(published)})")
    return errors


def _secret_files(doc: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode(errors="replace") for k, v in doc.get("data", {}).items()}
    return data | doc.get("stringData", {})


def run_accounts(docs: list[dict[str, Any]]) -> set[str] | None:
    """The accounts (not the system account) that the `nats-auth` Secret's auth.conf preloads, when the
    overlay carries that Secret (an export does); None when the Secret lives only in the cluster."""
    for doc in docs:
        if doc.get("kind") == "Secret" and _HASH_SUFFIX.sub("", doc["metadata"]["name"]) == "nats-auth":
            conf = _secret_files(doc).get("auth.conf", "")
            system = re.search(r"^system_account:\s*(\S+)", conf, re.MULTILINE)
            preloaded = set(re.findall(r"^\s+(A[A-Z2-7]{55}):", conf, re.MULTILINE))
            return preloaded - {system.group(1) if system else ""}
    return None


def _account_errors(doc: dict[str, Any], account: str, operator_mode: bool, accounts: set[str] | None) -> list[str]:
    """KEDA's `account` names where the run's streams live: with operator auth, the run account."""
    if not operator_mode:
        if account == "$G" or _ACCOUNT_KEY.fullmatch(account):
            return []
        return [f"{_name(doc)}: account {account!r} is neither $G nor an account's public key"]
    if not _ACCOUNT_KEY.fullmatch(account):
        return [
            f"{_name(doc)}: account {account!r} is not an account's public key, and nats.conf includes the "
            "stack's auth.conf (operator mode: the run's streams live in its run account, KEDA would find "
            "none elsewhere); deploy through `sprawl stack export-kubernetes`, which sets it"
        ]
    if accounts is not None and account not in accounts:
        return [f"{_name(doc)}: account {account} is not the run account of the nats-auth Secret's auth.conf"]
    return []


def _mounted_from(doc: dict[str, Any], container: dict[str, Any], path: str) -> str | None:
    """The Secret a file in the container comes from (through a volume mount), if any."""
    volumes = {v["name"]: v for v in (_pod_spec(doc) or {}).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            name = volumes.get(mount["name"], {}).get("secret", {}).get("secretName")
            return None if name is None else _HASH_SUFFIX.sub("", name)
    return None


def secrets_referenced(docs: list[dict[str, Any]]) -> set[str]:
    """Every Secret the manifests expect to exist (none is defined in them: they hold credentials)."""
    names = set()
    for doc in docs:
        pod = _pod_spec(doc)
        if pod is None:
            continue
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                names.add(volume["secret"]["secretName"])
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            for item in container.get("env", []):
                if "secretKeyRef" in item.get("valueFrom", {}):
                    names.add(item["valueFrom"]["secretKeyRef"]["name"])
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    names.add(source["secretRef"]["name"])
    return names


def check(docs: list[dict[str, Any]]) -> list[str]:
    return schema_errors(docs) + command_errors(docs) + topology_errors(docs)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or overlays()
    failed = False
    for overlay in paths:
        try:
            problems = check(render(overlay))
        except SprawlError as exc:
            problems = [str(exc)]
        for problem in problems:
            print(f"{overlay}: {problem}")
        print(f"{overlay}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
