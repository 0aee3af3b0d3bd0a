"""`sprawl stack export-kubernetes` (infra/deploy/kubernetes_export.py) from the session's running secure
stack: the overlay it writes renders and passes every check of infra/deploy/kubernetes_check.py, its
certificate is the stack CA's for the in-cluster names with client auth (a real mutual-TLS handshake),
its account is the stack's, its credentials work on the stack, its secrets are owner-only; and what
cannot make an export is refused."""

from __future__ import annotations

import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from infra.deploy import kubernetes_check as kc
from infra.deploy.kubernetes_export import ExportError, export_kubernetes
from infra.stack_security import StackSecurity
from pipeline.eventlog import EventLog
from pipeline.topology import PROMPTS
from workers.prompts.settings import PromptsSettings

NAMESPACE = "rl-exp"
NODE = f"nats-1.nats-headless.{NAMESPACE}.svc.cluster.local"


@pytest.fixture
def exported(settings, tmp_path: Path):
    stack_dir = settings.state_dir / "stack"
    # Its own signing key: the session's state folder must not gain the one `sprawl up` would make
    # (every worker started there would then pin it).
    key = tmp_path / "signing-key.pem"
    from pipeline.version_signing import ensure_signing_key

    ensure_signing_key(key)
    out = tmp_path / "k8s"
    export = export_kubernetes(
        stack_dir, out, run_id=settings.run_id, namespace=NAMESPACE, overlay="cpu-demo", signing_key_file=key
    )
    return export, stack_dir, key


def local_config(directory: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (directory / "local-config.env").read_text().splitlines())


def test_the_export_renders_and_passes_every_check(exported, settings):
    export, stack_dir, _ = exported
    docs = kc.render(export.directory)
    assert kc.check(docs) == []
    assert kc.run_id_of(docs) == settings.run_id
    account = StackSecurity(stack_dir).authority.account
    assert export.account == account == local_config(export.directory)["natsAccount"]
    for scaled in (d for d in docs if d["kind"] == "ScaledObject"):
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["metadata"]["account"] == account
        assert trigger["metadata"]["consumer"] == f"{settings.run_id}-samplers"
    assert {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]} == {NAMESPACE}
    # Every Secret the workloads mount is generated, except those the cloud issues (join tokens, bucket keys).
    defined = {kc._HASH_SUFFIX.sub("", d["metadata"]["name"]) for d in docs if d["kind"] == "Secret"}
    assert defined == {"nats-tls", "nats-auth", "sprawl-admin", "sprawl-trainer"}
    referenced = {kc._HASH_SUFFIX.sub("", name) for name in kc.secrets_referenced(docs)}
    assert referenced - defined == {
        "sprawl-trainer-s3",
        "sprawl-join-sampler",
        "sprawl-join-rewards",
        "sprawl-join-archiver",
    }
    # The local-config values never reach the cluster.
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("sprawl-stack")]


def test_the_certificate_is_the_stack_ca_s_for_the_nodes_with_client_auth(exported):
    export, _, _ = exported
    tls = export.directory / "nats-tls"
    cert = x509.load_pem_x509_certificate((tls / "tls.crt").read_bytes())
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    # A route's handshake, by OpenSSL: a node dials NODE; each end presents the certificate and
    # verifies the other's against the CA (hostname on the dialling side, client auth on the other).
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx in (server_ctx, client_ctx):
        ctx.load_cert_chain(tls / "tls.crt", tls / "tls.key")
        ctx.load_verify_locations(tls / "ca.crt")
        ctx.verify_mode = ssl.CERT_REQUIRED
    a, b = socket.socketpair()
    peer: dict = {}

    def serve() -> None:
        with server_ctx.wrap_socket(a, server_side=True) as s:
            peer["client"] = s.getpeercert()
            s.sendall(b"ok")

    thread = threading.Thread(target=serve)
    thread.start()
    with client_ctx.wrap_socket(b, server_hostname=NODE) as c:
        assert c.recv(2) == b"ok"
    thread.join()
    assert peer["client"]  # the server saw and verified the client's certificate

    # A name the certificate does not hold is refused.
    a, b = socket.socketpair()

    def refuse() -> None:
        with pytest.raises((ssl.SSLError, OSError)):
            server_ctx.wrap_socket(a, server_side=True)
        a.close()

    thread = threading.Thread(target=refuse)
    thread.start()
    with pytest.raises(ssl.SSLCertVerificationError):
        client_ctx.wrap_socket(b, server_hostname="nats-1.nats-headless.other-namespace.svc.cluster.local")
    b.close()
    thread.join()


def test_secrets_are_owner_only_and_the_signing_key_is_the_given_one(exported):
    export, _, key = exported
    secret_files = [p for p in export.directory.rglob("*") if p.is_file() and p.parent != export.directory]
    assert {p.relative_to(export.directory).as_posix() for p in secret_files} == {
        "nats-tls/tls.crt",
        "nats-tls/tls.key",
        "nats-tls/ca.crt",
        "nats-auth/auth.conf",
        "sprawl-admin/user.creds",
        "sprawl-trainer/user.creds",
        "sprawl-trainer/signing-key.pem",
    }
    for path in secret_files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(export.directory.stat().st_mode) == 0o700
    assert (export.directory / ".gitignore").read_text().splitlines()[-1] == "*"
    assert (export.directory / "sprawl-trainer" / "signing-key.pem").read_bytes() == key.read_bytes()


async def test_the_exported_credentials_work_on_the_stack(exported, settings, event_log):
    export, _, _ = exported
    for role in ("admin", "trainer"):
        nats = settings.nats.model_copy(
            update={
                "tls_ca_file": export.directory / "nats-tls" / "ca.crt",
                "creds_file": export.directory / f"sprawl-{role}" / "user.creds",
                "inbox_prefix": f"_INBOX_{role}_{settings.run_id}",
                "user": None,
                "password": None,
            }
        )
        own = PromptsSettings(run_id=settings.run_id, state_dir=settings.state_dir, nats=nats)
        log = await EventLog.connect(own, worker=f"exported-{role}")
        try:
            info = await log.js.stream_info(PROMPTS.name)
            assert info.config.name == PROMPTS.name
        finally:
            await log.close()
    assert set(export.users) == {"admin", "trainer"}


def test_what_cannot_make_an_export_is_refused(settings, tmp_path: Path):
    stack_dir = settings.state_dir / "stack"
    with pytest.raises(ExportError, match="not a secure stack's folder"):
        export_kubernetes(tmp_path / "nowhere", tmp_path / "a", run_id="r")
    with pytest.raises(ExportError, match="no overlay 'aws'"):
        export_kubernetes(stack_dir, tmp_path / "b", run_id="r", overlay="aws")
    with pytest.raises(ExportError, match="no Kubernetes namespace name"):
        export_kubernetes(stack_dir, tmp_path / "c", run_id="r", namespace="Sprawl_NS")
    with pytest.raises(ExportError, match="run_id"):
        export_kubernetes(stack_dir, tmp_path / "d", run_id="a.b")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "old.creds").write_text("x")
    with pytest.raises(ExportError, match="is not empty"):
        export_kubernetes(stack_dir, tmp_path / "e", run_id="r")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_default_signing_key_is_up_s_and_the_namespace_the_overlay_s(tmp_path: Path):
    """Against a stack folder of its own (no server needed): the key `sprawl up` keeps in the state folder."""
    from infra.pki import ensure_ca
    from workers.up.orchestrate import signing_key_path

    stack_dir = tmp_path / "state" / "stack"
    StackSecurity(stack_dir)
    ensure_ca(stack_dir / "tls")
    export = export_kubernetes(stack_dir, tmp_path / "out", run_id="demo", overlay="gpu")
    assert export.namespace == "sprawl"
    assert (export.directory / "sprawl-trainer" / "signing-key.pem").read_bytes() == (
        signing_key_path(tmp_path / "state").read_bytes()
    )


def test_every_deploy_file_the_commands_read_is_package_data():
    """`sprawl stack export-kubernetes` and the manifest checks read the manifests beside their modules:
    a wheel install (the image's `pip install .`) must carry every one, or the commands fail there."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package, folder, suffixes in (
        ("infra.deploy", root / "infra" / "deploy", {".yaml", ".json"}),
        ("infra.image", root / "infra" / "image", {".sh"}),
    ):
        covered = {p for pattern in data[package] for p in folder.glob(pattern)}
        wanted = {p for p in folder.rglob("*") if p.suffix in suffixes}
        assert wanted and wanted <= covered, sorted(str(p.relative_to(root)) for p in wanted - covered)
    assert (root / "infra/deploy/modal/islands.py") in {
        p for pattern in data["infra.deploy"] for p in (root / "infra/deploy").glob(pattern)
    }
