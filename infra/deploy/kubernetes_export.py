"""A secure stack's security, exported as a kustomize overlay: `sprawl stack export-kubernetes DIR`.

The cluster's log must trust the same operator as the stack, and its workers must hold identities
of the stack's run account, or nothing the stack issues (join tokens for islands elsewhere) works
there. This writes DIR, a kustomize overlay over one of the repository's overlays (`gpu`,
`cpu-demo`), holding:

- `nats-tls/`: a certificate for the log's in-cluster names (`nats-0.nats-headless`,
  `*.nats-headless.<ns>.svc.cluster.local`, ...) signed by the stack's CA, for server and client use:
  the routes between the nodes are mutual TLS, each node presenting it to the others;
- `nats-auth/auth.conf`: the operator and the accounts, revocations included, as the stack serves them;
- `sprawl-admin/`, `sprawl-trainer/`: NATS credentials of those roles in the run, freshly issued
  (their own keys: revoking them leaves the stack's own identities alone), and the trainer's
  version-signing key (the one `sprawl up` uses in the same state folder, so islands pinned by join
  tokens accept the cluster trainer's versions);
- `local-config.env`: the run account's public key (KEDA's `account`), the run id, and the names
  derived from it; applied to the manifests by the kustomization's replacements, never to the cluster;
- `kustomization.yaml`: the secretGenerators and replacements, and the namespace.

Secrets are written owner-only (and DIR gets a `.gitignore` of everything): the folder is the
cluster's key ring, to be applied with `kubectl apply -k DIR`, never committed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from infra.deploy.kubernetes_check import OVERLAYS_DIR
from infra.nats_permissions import inbox_prefix
from infra.pki import SERVER_AND_CLIENT, ensure_server_certificate, write_private
from infra.roles import Role
from infra.stack_security import LOCAL_HOSTS, StackSecurity
from pipeline.errors import SprawlError
from pipeline.topology import ConsumerRole, consumer_for, token

NATS_NODES = 3
"""The StatefulSet's replicas (base/nats.yaml); the certificate names each node."""
CLUSTER_DOMAIN = "cluster.local"
LOCAL_CONFIG = "local-config.env"
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class ExportError(SprawlError):
    """The stack folder, the overlay or the destination cannot make an export."""


@dataclass(frozen=True)
class KubernetesExport:
    directory: Path
    overlay: str
    namespace: str
    run_id: str
    account: str
    """The run account's public key: KEDA's `account`."""
    users: dict[str, str] = field(default_factory=dict)
    """Role -> the public key of the NATS user issued for it (what to revoke: `NatsAuthority.revoke`)."""


def in_cluster_names(namespace: str) -> list[str]:
    """Every name a client or a node reaches the log by: the `nats` Service, each node of the headless
    Service (short, namespaced and fully qualified), and this machine for `kubectl port-forward`."""
    names = [*LOCAL_HOSTS]
    suffixes = ["", f".{namespace}", f".{namespace}.svc", f".{namespace}.svc.{CLUSTER_DOMAIN}"]
    for suffix in suffixes:
        names.append(f"nats{suffix}")
    for suffix in suffixes:
        names += [f"nats-{node}.nats-headless{suffix}" for node in range(NATS_NODES)]
        names.append(f"*.nats-headless{suffix}")
    return names


def overlay_namespace(overlay: str) -> str:
    """The namespace the repository's overlay deploys to (its kustomization's `namespace`)."""
    kustomization = yaml.safe_load((OVERLAYS_DIR / overlay / "kustomization.yaml").read_text())
    return str(kustomization.get("namespace") or "default")


def _check_overlay(overlay: str) -> None:
    if "/" in overlay or not (OVERLAYS_DIR / overlay / "kustomization.yaml").is_file():
        names = sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())
        raise ExportError(f"no overlay {overlay!r} in {OVERLAYS_DIR}", hint=f"choose one of {', '.join(names)}")


def _check_inputs(stack_directory: Path, namespace: str, run_id: str) -> None:
    # Made on first use by NatsAuthority and ensure_ca: a folder without them is not a secure stack's, and
    # exporting it would invent an operator no running log trusts.
    for needed in ("auth/nkeys.json", "tls/ca.pem", "tls/ca-key.pem"):
        if not (stack_directory / needed).is_file():
            raise ExportError(
                f"{stack_directory} is not a secure stack's folder (no {needed})",
                hint="give <state_dir>/stack of a stack started with `sprawl stack up` (stack.secure = true)",
            )
    # A DNS-1123 label: the namespace becomes part of certificate names and of every object's metadata.
    if not _NAMESPACE.fullmatch(namespace):
        raise ExportError(f"namespace {namespace!r} is no Kubernetes namespace name", hint="lowercase a-z, 0-9, '-'")
    try:
        token(run_id, "run_id")
    except ValueError as exc:
        raise ExportError(str(exc), hint="a run id is one subject token: letters, digits, '-', '_'") from exc


def _kustomization(export: KubernetesExport, resource: str) -> dict:
    def env_target(kind: str, name: str, container: str) -> dict:
        path = f"spec.template.spec.containers.[name={container}].env.[name=SPRAWL_NATS__INBOX_PREFIX].value"
        return {"select": {"kind": kind, "name": name}, "fieldPaths": [path]}

    def scaled(path: str) -> dict:
        return {"select": {"kind": "ScaledObject"}, "fieldPaths": [path]}

    def source(key: str) -> dict:
        return {"kind": "ConfigMap", "name": "sprawl-stack", "fieldPath": f"data.{key}"}

    trigger = "spec.triggers.[type=nats-jetstream].metadata"
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": export.namespace,
        "resources": [resource],
        "secretGenerator": [
            {
                "name": "nats-tls",
                "type": "kubernetes.io/tls",
                "files": ["tls.crt=nats-tls/tls.crt", "tls.key=nats-tls/tls.key", "ca.crt=nats-tls/ca.crt"],
            },
            {"name": "nats-auth", "files": ["auth.conf=nats-auth/auth.conf"]},
            {"name": "sprawl-admin", "files": ["user.creds=sprawl-admin/user.creds"]},
            {
                "name": "sprawl-trainer",
                "files": ["user.creds=sprawl-trainer/user.creds", "signing-key.pem=sprawl-trainer/signing-key.pem"],
            },
        ],
        "configMapGenerator": [
            {"name": "sprawl-run", "behavior": "merge", "literals": [f"SPRAWL_RUN_ID={export.run_id}"]},
            # Values for the replacements below only: local-config keeps kustomize from emitting it.
            {
                "name": "sprawl-stack",
                "envs": [LOCAL_CONFIG],
                "options": {"annotations": {"config.kubernetes.io/local-config": "true"}},
            },
        ],
        "replacements": [
            {"source": source("natsAccount"), "targets": [scaled(f"{trigger}.account")]},
            {"source": source("samplersConsumer"), "targets": [scaled(f"{trigger}.consumer")]},
            {"source": source("adminInboxPrefix"), "targets": [env_target("Job", "sprawl-infra-apply", "apply")]},
            {
                "source": source("trainerInboxPrefix"),
                "targets": [
                    env_target("StatefulSet", "trainer", "trainer"),
                    env_target("Deployment", "prompts", "prompts"),
                ],
            },
        ],
    }


def export_kubernetes(
    stack_directory: Path,
    directory: Path,
    *,
    run_id: str,
    namespace: str | None = None,
    overlay: str = "gpu",
    signing_key_file: Path | None = None,
) -> KubernetesExport:
    """Write the overlay for `overlay` in `namespace` (default: the overlay's own) for run `run_id` of the
    secure stack in `stack_directory` (`<state_dir>/stack`) to `directory`, which must be empty or absent.
    `signing_key_file`: the trainer's version-signing key (default: the one `sprawl up` keeps in the state
    folder, made if missing, as `up` makes it)."""
    from pipeline.version_signing import ensure_signing_key
    from workers.up.orchestrate import signing_key_path

    stack_directory, directory = Path(stack_directory).resolve(), Path(directory).resolve()
    _check_overlay(overlay)
    namespace = namespace if namespace is not None else overlay_namespace(overlay)
    _check_inputs(stack_directory, namespace, run_id)
    if directory.exists() and any(directory.iterdir()):
        raise ExportError(
            f"{directory} is not empty", hint="export into a new folder (a stale key ring must not be mixed in)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    (directory / ".gitignore").write_text("# Credentials of a Kubernetes deployment: never commit them.\n*\n")

    security = StackSecurity(stack_directory)
    # Kept in the stack's TLS folder under its own name per namespace, reissued only when stale.
    cert = ensure_server_certificate(
        security.tls_dir, f"nats-kubernetes-{namespace}", in_cluster_names(namespace), SERVER_AND_CLIENT
    )
    (directory / "nats-tls").mkdir(mode=0o700)
    write_private(directory / "nats-tls" / "tls.crt", cert.cert_file.read_bytes())
    write_private(directory / "nats-tls" / "tls.key", cert.key_file.read_bytes())
    write_private(directory / "nats-tls" / "ca.crt", cert.ca_file.read_bytes())
    write_private(directory / "nats-auth" / "auth.conf", security.write_auth_conf().read_bytes())

    users = {}
    for role in (Role.ADMIN, Role.TRAINER):
        creds = security.issue(role, run_id, run_id)  # identity = run: the inbox prefix the manifests name
        creds.write(directory / f"sprawl-{role.value}" / "user.creds")
        users[role.value] = creds.public_key
    if signing_key_file is None:
        signing_key_file = signing_key_path(stack_directory.parent)
        ensure_signing_key(signing_key_file)
    key_file = Path(signing_key_file)
    write_private(directory / "sprawl-trainer" / "signing-key.pem", key_file.read_bytes())
    for folder in ("nats-auth", "sprawl-admin", "sprawl-trainer"):
        os.chmod(directory / folder, 0o700)

    export = KubernetesExport(directory, overlay, namespace, run_id, security.authority.account, users)
    local = {
        "natsAccount": export.account,
        "runId": run_id,
        "samplersConsumer": consumer_for(run_id, ConsumerRole.SAMPLERS).name,
        "adminInboxPrefix": inbox_prefix(Role.ADMIN, run_id),
        "trainerInboxPrefix": inbox_prefix(Role.TRAINER, run_id),
    }
    (directory / LOCAL_CONFIG).write_text("".join(f"{k}={v}\n" for k, v in local.items()))
    resource = os.path.relpath(OVERLAYS_DIR / overlay, directory)
    header = [
        f"# Written by `sprawl stack export-kubernetes` from {stack_directory}: overlay {overlay}, run {run_id},",
        f"# namespace {namespace}. Apply with `kubectl apply -k {directory}`. NATS users issued (revocable):",
        *(f"#   {role}: {key}" for role, key in users.items()),
    ]
    body = yaml.safe_dump(_kustomization(export, resource), sort_keys=False, width=120)
    (directory / "kustomization.yaml").write_text("\n".join(header) + "\n" + body)
    return export
