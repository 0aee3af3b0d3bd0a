"""The Kubernetes manifests (infra/deploy/kubernetes): every overlay, exported with a stack's security
(`sprawl stack export-kubernetes`), renders with kustomize and passes the Kubernetes API's schemas,
KEDA's ScaledObject schema, the CLI and the topology (infra/deploy/kubernetes_check.py); an overlay
rendered without the stack's account fails; and each check fails on a manifest that breaks it.

The prompt driver's Deployment runs `sprawl prompts`, which workers/cli.py registers (with
ROLE_OF_COMMAND["prompts"] = "trainer"): until then the command checks name it as unknown."""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import pytest

from infra.deploy import kubernetes_check as kc
from infra.deploy.kubernetes_export import export_kubernetes
from pipeline.topology import PROMPTS, ConsumerRole, consumer_for

OVERLAYS = {path.name: path for path in kc.overlays()}


@functools.cache
def _rendered(name: str) -> tuple:
    return tuple(kc.render(OVERLAYS[name]))


def rendered(name: str) -> list[dict]:
    """The repository's overlay as it is (no stack's account): a fresh copy each time, tests mutate it."""
    return copy.deepcopy(list(_rendered(name)))


@functools.cache
def _exported(name: str) -> tuple:
    """The overlay exported with the security of a stack folder of its own (made offline: no server
    is needed to issue; tests/test_deploy_export.py exports from a running one)."""
    import atexit
    import shutil
    import tempfile

    from infra.pki import ensure_ca
    from infra.stack_security import StackSecurity

    root = Path(tempfile.mkdtemp(prefix=f"sprawl-k8s-{name}-"))
    atexit.register(shutil.rmtree, root, True)  # keys: not left behind in /tmp
    stack_dir = root / "state" / "stack"
    StackSecurity(stack_dir)
    ensure_ca(stack_dir / "tls")
    export = export_kubernetes(stack_dir, root / "export", run_id="demo", overlay=name)
    return export.account, tuple(kc.render(export.directory))


def exported(name: str) -> list[dict]:
    return copy.deepcopy(list(_exported(name)[1]))


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict], kind: str, name: str) -> dict:
    return find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def test_the_repository_has_both_overlays():
    assert set(OVERLAYS) == {"cpu-demo", "gpu"}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_overlay_exported_with_a_stack_passes_every_check(overlay):
    assert kc.check(exported(overlay)) == []


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_an_overlay_without_the_stack_s_account_fails_on_that_alone(overlay):
    """The base's placeholder is no account: applied without an export, KEDA would find no stream."""
    problems = kc.check(rendered(overlay))
    assert len(problems) == 2
    for problem, name in zip(problems, ("sampler-bf16", "sampler-fp8-e4m3"), strict=True):
        assert problem.startswith(f"ScaledObject/{name}: account 'set-by-sprawl-stack-export-kubernetes' is not")
        assert "sprawl stack export-kubernetes" in problem


def _set_account(docs: list[dict], account: str) -> None:
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            doc["spec"]["triggers"][0]["metadata"]["account"] = account


def test_g_is_refused_under_operator_auth_and_allowed_only_without_accounts():
    docs = exported("gpu")
    _set_account(docs, "$G")
    assert "account '$G' is not an account's public key, and nats.conf includes the stack's auth.conf" in _problems(
        docs
    )
    conf = find(docs, "ConfigMap", "nats-config")["data"]
    conf["nats.conf"] = conf["nats.conf"].replace("include ./auth/auth.conf", "")
    assert "account" not in _problems(docs)
    _set_account(docs, "ACCOUNT")
    assert "account 'ACCOUNT' is neither $G nor an account's public key" in _problems(docs)


def test_an_account_that_is_not_the_run_account_of_the_exported_auth_conf_is_refused():
    account, docs = _exported("gpu")[0], exported("gpu")
    other = "A" + "B" * 55  # a well-formed key of no account this auth.conf knows
    _set_account(docs, other)
    assert f"account {other} is not the run account of the nats-auth Secret's auth.conf" in _problems(docs)
    (system,) = re.findall(r"system_account: (A[A-Z2-7]{55})", _auth_conf(docs))
    assert system != account
    _set_account(docs, system)  # the system account holds no stream of the run
    assert f"account {system} is not the run account" in _problems(docs)


def _auth_conf(docs: list[dict]) -> str:
    import base64

    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("nats-auth-")]
    return base64.b64decode(secret["data"]["auth.conf"]).decode()


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_overlay_holds_the_whole_deployment(overlay):
    docs = rendered(overlay)
    nats = find(docs, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    assert [t["metadata"]["name"] for t in nats["spec"]["volumeClaimTemplates"]] == ["data"]
    assert find(docs, "Service", "nats-headless")["spec"]["clusterIP"] == "None"
    conf = find(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    for node in range(3):
        assert f"nats-route://nats-{node}.nats-headless:6222" in conf
    assert "verify: true" in conf and "store_dir: /data/jetstream" in conf

    assert container(docs, "Job", "sprawl-infra-apply")["args"] == ["infra", "apply"]
    assert kc.run_config(docs)["SPRAWL_STREAMS__REPLICAS"] == "3"
    trainer = find(docs, "StatefulSet", "trainer")
    assert trainer["spec"]["replicas"] == 1 and container(docs, "StatefulSet", "trainer")["args"] == ["trainer"]
    assert container(docs, "Deployment", "rewards")["securityContext"]["privileged"] is True
    assert container(docs, "Deployment", "archiver")["args"] == ["archiver"]
    prompts = find(docs, "Deployment", "prompts")
    assert prompts["spec"]["replicas"] == 1 and prompts["spec"]["strategy"] == {"type": "Recreate"}
    assert container(docs, "Deployment", "prompts")["args"] == ["prompts"]
    (creds,) = [v for v in prompts["spec"]["template"]["spec"]["volumes"] if v["name"] == "trainer-creds"]
    # The trainer's NATS identity, not its signing key.
    assert creds["secret"]["items"] == [{"key": "user.creds", "path": "user.creds"}]
    for view in ("bf16", "fp8_e4m3"):
        name = f"sampler-{view.replace('_', '-')}"
        sampler = container(docs, "Deployment", name)
        assert sampler["args"][:3] == ["sampler", "--island.view", view]
        assert {
            "name": "SPRAWL_JOIN",
            "valueFrom": {"secretKeyRef": {"name": "sprawl-join-sampler", "key": "token"}},
        } in sampler["env"]
        assert find(docs, "ScaledObject", name)["spec"]["scaleTargetRef"]["name"] == name


def test_the_gpu_overlay_gives_every_island_a_gpu_and_the_cpu_demo_none():
    for name in ("sampler-bf16", "sampler-fp8-e4m3"):
        gpu = container(rendered("gpu"), "Deployment", name)
        assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert gpu["args"][-2:] == ["--island.device", "cuda"]
        cpu = container(rendered("cpu-demo"), "Deployment", name)
        assert "nvidia.com/gpu" not in json.dumps(cpu) and "cuda" not in cpu["args"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_keda_scales_on_the_run_s_samplers_consumer_as_the_topology_names_it(overlay):
    docs = rendered(overlay)
    run = kc.run_id_of(docs)
    for doc in (d for d in docs if d["kind"] == "ScaledObject"):
        (trigger,) = doc["spec"]["triggers"]
        assert trigger["type"] == "nats-jetstream"
        assert trigger["metadata"]["stream"] == PROMPTS.name
        assert trigger["metadata"]["consumer"] == consumer_for(run, ConsumerRole.SAMPLERS).name


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_secrets_the_manifests_expect_are_the_documented_ones(overlay):
    assert kc.secrets_referenced(rendered(overlay)) == {
        "nats-tls",
        "nats-auth",
        "sprawl-admin",
        "sprawl-trainer",
        "sprawl-trainer-s3",
        "sprawl-join-sampler",
        "sprawl-join-rewards",
        "sprawl-join-archiver",
    }
    # No Secret is defined in the manifests: they hold credentials, made by the admin.
    assert not [d for d in rendered(overlay) if d["kind"] == "Secret"]


def test_the_vendored_keda_schema_says_where_it_came_from():
    schema = json.loads(kc.KEDA_SCHEMA.read_text())
    assert "cloudcoil-models-keda 2.16.1.0" in schema["$comment"]
    assert (kc.KEDA_SCHEMA.parent / "generate_keda_schema.py").is_file()
    assert schema["properties"]["kind"] == {"type": "string", "const": "ScaledObject"}


# ---------------------------------------------------------------- each check fails when it should


def _problems(docs: list[dict]) -> str:
    """What the CLI and topology checks say (the schema checks have tests of their own below)."""
    return "\n".join(kc.command_errors(docs) + kc.topology_errors(docs))


def test_a_consumer_or_stream_that_drifted_from_the_topology_is_named():
    docs = rendered("gpu")
    trigger = find(docs, "ScaledObject", "sampler-bf16")["spec"]["triggers"][0]["metadata"]
    trigger["consumer"] = "demo-sampler"
    trigger["stream"] = "PROMPT"
    problems = _problems(docs)
    assert "consumer 'demo-sampler'; run 'demo''s samplers consumer is 'demo-samplers'" in problems
    assert "stream 'PROMPT'; the prompts stream is 'PROMPTS'" in problems


def test_a_run_renamed_in_one_place_only_is_caught():
    docs = rendered("gpu")
    kc.run_config(docs)["SPRAWL_RUN_ID"] = "exp-7"
    problems = _problems(docs)
    assert "run 'exp-7''s samplers consumer is 'exp-7-samplers'" in problems
    assert (
        "SPRAWL_NATS__INBOX_PREFIX '_INBOX_trainer_demo'; `sprawl trainer` in run 'exp-7' has '_INBOX_trainer_exp-7'"
        in problems
    )


def test_a_command_or_flag_the_cli_lacks_is_named():
    docs = rendered("cpu-demo")
    container(docs, "Deployment", "archiver")["args"] = ["archive"]
    container(docs, "Deployment", "sampler-bf16")["args"] = ["sampler", "--island.veiw", "bf16"]
    problems = _problems(docs)
    assert "`sprawl archive` is not a sprawl command" in problems
    assert "--island.veiw" in problems


def test_a_variable_that_names_no_setting_or_a_bad_value_is_named():
    docs = rendered("cpu-demo")
    container(docs, "Deployment", "sampler-bf16")["env"].append({"name": "SPRAWL_ISLAND__VEIW", "value": "bf16"})
    container(docs, "Deployment", "rewards")["env"].append({"name": "SPRAWL_SANDBOX__MEMORY_MB", "value": "0"})
    kc.run_config(docs)["SPRAWL_STREAMS__REPLICAS"] = "4"
    problems = _problems(docs)
    assert "SPRAWL_ISLAND__VEIW is no setting of `sprawl sampler` (SamplerSettings)" in problems
    assert "sandbox.memory_mb: Input should be greater than or equal to 1" in problems
    assert "streams have 4 replicas but StatefulSet/nats runs 3 servers" in problems


def test_a_view_the_trainer_does_not_publish_is_named():
    docs = rendered("gpu")
    trainer_env = container(docs, "StatefulSet", "trainer")["env"]
    (views,) = [e for e in trainer_env if e["name"] == "SPRAWL_CHAIN__VIEWS"]
    views["value"] = '["bf16"]'
    assert "serves view 'fp8_e4m3', which the trainer does not publish (['bf16'])" in _problems(docs)


def test_a_sampler_without_a_scaledobject_and_a_scaledobject_of_nothing_are_named():
    docs = rendered("gpu")
    find(docs, "ScaledObject", "sampler-fp8-e4m3")["spec"]["scaleTargetRef"]["name"] = "sampler-fp8"
    problems = _problems(docs)
    assert "scales Deployment/sampler-fp8, which the manifests do not define" in problems
    assert "Deployment/sampler-fp8-e4m3: a sampler workload without a ScaledObject" in problems


def test_an_unknown_or_mistyped_kubernetes_field_fails_the_api_schema():
    docs = rendered("gpu")
    find(docs, "Deployment", "archiver")["spec"]["replica"] = 2
    container(docs, "StatefulSet", "nats")["ports"][0]["containerPort"] = "4222"
    problems = kc.schema_errors(docs)
    assert any("Deployment/archiver: Kubernetes 1.29 schema" in p and "replica" in p for p in problems)
    assert any(
        "StatefulSet/nats: Kubernetes 1.37 schema: spec/template/spec/containers/0/ports/0/containerPort" in p
        for p in problems
    )


def test_a_scaledobject_keda_would_refuse_fails_the_vendored_schema():
    docs = rendered("gpu")
    scaled = find(docs, "ScaledObject", "sampler-bf16")
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 8  # KEDA's metadata values are strings
    scaled["spec"]["minReplicas"] = 1  # not a ScaledObject field (minReplicaCount is)
    del find(docs, "ScaledObject", "sampler-fp8-e4m3")["spec"]["triggers"]
    problems = "\n".join(kc.schema_errors(docs))
    assert (
        "ScaledObject/sampler-bf16: KEDA schema: spec/triggers/0/metadata/lagThreshold: 8 is not of type 'string'"
        in problems
    )
    assert "'minReplicas' was unexpected" in problems
    assert "ScaledObject/sampler-fp8-e4m3: KEDA schema: spec: 'triggers' is a required property" in problems


def test_a_prompt_driver_that_could_race_or_holds_another_role_s_credentials_is_named():
    docs = exported("cpu-demo")
    prompts = find(docs, "Deployment", "prompts")
    prompts["spec"]["replicas"] = 2
    volumes = prompts["spec"]["template"]["spec"]["volumes"]
    (admin_secret,) = [
        v["secret"]["secretName"] for v in container_volumes(docs, "Job", "sprawl-infra-apply") if v["name"] == "admin"
    ]
    for volume in volumes:
        if volume["name"] == "trainer-creds":
            volume["secret"]["secretName"] = admin_secret
    problems = _problems(docs)
    assert "Deployment/prompts: the prompt driver must be 1 replica with the Recreate strategy" in problems
    assert "`sprawl prompts` runs as trainer but its credentials come from Secret sprawl-admin" in problems


def container_volumes(docs: list[dict], kind: str, name: str) -> list[dict]:
    return find(docs, kind, name)["spec"]["template"]["spec"]["volumes"]


def test_an_overlay_kustomize_cannot_render_is_an_error(tmp_path: Path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(kc.RenderError, match="kustomize could not render"):
        kc.render(tmp_path)
