"""The workers' own settings sections refuse bad values at start, one line naming the field.

The island, the sampler and the sidecar (`workers.sampler.settings`), the archiver, the reward worker,
the sandbox and the local stack: every fixed choice is a `Literal` or checked against its registry,
numbers have bounds, and rules across fields are validators. Each bad value below must fail alone,
naming its field; each known-good value (defaults, and what tests, benches and `sprawl up` use) must
pass.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import get_args

import pytest
from pydantic import BaseModel, ValidationError

from infra.stack import StackSection, StackSettings
from pipeline.config import MIB, validation_lines
from pipeline.sandbox import SANDBOX_BACKENDS, SandboxSettings
from pipeline.topology import ARCHIVER_MAX_ACK_PENDING, token
from workers.archiver import ArchiverSettings, ArchiveSection
from workers.rewards.verifiers import VERIFIERS
from workers.rewards.worker import RewardSettings
from workers.sampler.engines.factory import ENGINES
from workers.sampler.settings import (
    HTTP_ENGINES,
    HTTPSection,
    IslandSection,
    SamplerSettings,
    SidecarSettings,
    ViewName,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("SPRAWL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


BAD: list[tuple[type[BaseModel], dict, str]] = [
    # the island
    (IslandSection, {"view": "fp9"}, "view"),
    (IslandSection, {"view": "BF16"}, "view"),
    (IslandSection, {"engine": "tgi"}, "engine"),
    (IslandSection, {"engine": "vllm"}, "engine_url"),
    (IslandSection, {"engine": "sglang", "engine_url": "127.0.0.1:30000"}, "engine_url"),
    (IslandSection, {"engine_url": "ftp://127.0.0.1:8000"}, "engine_url"),
    (IslandSection, {"engine": "vllm", "engine_url": "http://127.0.0.1:99999"}, "engine_url"),
    (IslandSection, {"device": "gpu"}, "device"),
    (IslandSection, {"device": "cuda:"}, "device"),
    (IslandSection, {"device": "cuda:one"}, "device"),
    (IslandSection, {"compute_dtype": "fp8"}, "compute_dtype"),
    (IslandSection, {"top_logprobs": 0}, "top_logprobs"),
    (IslandSection, {"poll_interval_s": 0}, "poll_interval_s"),
    (IslandSection, {"poll_interval_s": -1.0}, "poll_interval_s"),
    (IslandSection, {"island_id": "host.example.com-bf16"}, "island_id"),
    (IslandSection, {"island_id": "*"}, "island_id"),
    (IslandSection, {"group": "fp8 fleet"}, "group"),
    # the sampler and the sidecar
    (SamplerSettings, {"max_staleness": -1}, "max_staleness"),
    (SamplerSettings, {"stop_token_ids": [2, -1]}, "stop_token_ids.1"),
    (SamplerSettings, {"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
    (SamplerSettings, {"island": {"view": "fp9"}}, "island.view"),
    (HTTPSection, {"port": -1}, "port"),
    (HTTPSection, {"port": 65536}, "port"),
    (HTTPSection, {"host": ""}, "host"),
    (SidecarSettings, {"http": {"port": 70000}}, "http.port"),
    # the archiver
    (ArchiveSection, {"flush_events": 0}, "flush_events"),
    (ArchiveSection, {"flush_interval_s": 0}, "flush_interval_s"),
    (ArchiveSection, {"fetch_batch": 0}, "fetch_batch"),
    (ArchiveSection, {"fetch_batch": ARCHIVER_MAX_ACK_PENDING + 1}, "fetch_batch"),
    (ArchiverSettings, {"archive": {"fetch_batch": 0}}, "archive.fetch_batch"),
    # the reward worker
    (RewardSettings, {"concurrency": 0}, "concurrency"),
    (RewardSettings, {"routes": {"arith": "regex"}}, "routes"),
    (RewardSettings, {"prompt_wait_s": 0}, "prompt_wait_s"),
    (RewardSettings, {"sandbox": {"backend": "docker"}}, "sandbox.backend"),
    # the sandbox
    (SandboxSettings, {"backend": "docker"}, "backend"),
    *(
        (SandboxSettings, {name: 0}, name)
        for name in (
            "cpu_seconds",
            "memory_mb",
            "max_processes",
            "max_file_mb",
            "max_open_files",
            "max_output_bytes",
            "tmpfs_mb",
            "uid_span",
        )
    ),
    (SandboxSettings, {"wall_timeout_s": 0}, "wall_timeout_s"),
    (SandboxSettings, {"pool_size": -1}, "pool_size"),
    (SandboxSettings, {"pool_size": 2049}, "uid_span"),  # 2 * 2049 uids, 4096 to lease from
    (SandboxSettings, {"pool_size": 4, "uid_span": 7}, "uid_span"),
    (SandboxSettings, {"uid_base": 999}, "uid_base"),
    (SandboxSettings, {"uid_base": 2**32 - 4096}, "uid_span"),  # its last uid would be (uid_t)-1
    (SandboxSettings, {"uid_base": 2**32}, "uid_base"),
    (SandboxSettings, {"python": "python3"}, "python"),
    (SandboxSettings, {"bwrap": ""}, "bwrap"),
    # the local stack
    (StackSection, {"nats_port": -1}, "nats_port"),
    (StackSection, {"nats_port": 65536}, "nats_port"),
    (StackSection, {"nats_monitor_port": 70000}, "nats_monitor_port"),
    (StackSection, {"nats_monitor_port": 4222}, "nats_monitor_port"),  # the client port's
    (StackSection, {"s3_port": 8222}, "s3_port"),  # the monitor's
    (StackSection, {"nats_port": 8333}, "s3_port"),  # the default S3 port is the later field
    (StackSection, {"seaweed_port_base": 65535 - 10006}, "seaweed_port_base"),  # admin gRPC past 65535
    (StackSection, {"seaweed_port_base": 4215}, "seaweed_port_base"),  # its block holds 4222
    (StackSection, {"seaweed_port_base": 8214, "s3_port": 0}, "seaweed_port_base"),  # S3 at base + 8 = 8222
    (StackSection, {"seaweed_port_base": 8330}, "seaweed_port_base"),  # its block holds s3_port 8333
    (StackSection, {"buckets": []}, "buckets"),
    (StackSection, {"buckets": ["sprawl", "Not_A_Bucket"]}, "buckets.1"),
    (StackSection, {"buckets": ["ab"]}, "buckets.0"),
    (StackSection, {"start_timeout_s": 0}, "start_timeout_s"),
    (StackSection, {"seaweed_start_attempts": 0}, "seaweed_start_attempts"),
    (StackSection, {"nats_max_payload_bytes": 1024}, "nats_max_payload_bytes"),
    (StackSection, {"nats_max_payload_bytes": 65 * MIB}, "nats_max_payload_bytes"),
    (StackSettings, {"stack": {"nats_port": 8222}}, "stack.nats_monitor_port"),
]


@pytest.mark.parametrize(
    ("model", "values", "field"), BAD, ids=[f"{m.__name__}-{f}-{i}" for i, (m, _, f) in enumerate(BAD)]
)
def test_a_bad_value_is_refused_in_one_line_naming_its_field(model, values, field):
    with pytest.raises(ValidationError) as refused:
        model(**values)
    lines = validation_lines(refused.value)
    assert len(lines) == 1 and lines[0].startswith(f"{field}: "), lines


GOOD: list[tuple[type[BaseModel], dict]] = [
    (IslandSection, {}),
    (IslandSection, {"view": "fp8_e4m3", "island_id": "island1-fp8", "group": "fp8", "region": "eu-west"}),
    (IslandSection, {"island_id": "Island-0", "group": "bf16_fleet"}),  # subject tokens are lowercased
    (IslandSection, {"engine": "vllm", "engine_url": "http://127.0.0.1:8000"}),
    (IslandSection, {"engine": "sglang", "engine_url": "https://gpu-box.internal:30000/"}),
    (IslandSection, {"device": "cuda", "compute_dtype": "float16"}),
    (IslandSection, {"device": "cuda:1", "compute_dtype": "float32"}),
    (IslandSection, {"top_logprobs": 1, "poll_interval_s": 0.05}),
    (IslandSection, {"top_logprobs": 4096}),  # `sprawl up` asks for the whole vocabulary
    (SamplerSettings, {}),
    (SamplerSettings, {"max_staleness": 0, "stop_token_ids": [0, 2], "heartbeat_interval_s": 0.5}),
    (HTTPSection, {}),
    (HTTPSection, {"port": 0}),
    (HTTPSection, {"host": "0.0.0.0", "port": 65535}),
    (SidecarSettings, {}),
    (ArchiveSection, {}),
    (ArchiveSection, {"flush_events": 1, "flush_interval_s": 0.1, "fetch_batch": 1}),
    (ArchiveSection, {"fetch_batch": ARCHIVER_MAX_ACK_PENDING}),
    (ArchiveSection, {"flush_events": 50_000}),  # `sprawl bench audit`: flushes by time
    (ArchiverSettings, {}),
    (RewardSettings, {}),
    (RewardSettings, {"routes": {"arith": "exact", "code": "code_tests", "odd key.with dots": "format"}}),
    (RewardSettings, {"concurrency": 1, "prompt_wait_s": 0.5}),
    (SandboxSettings, {}),
    (SandboxSettings, {"pool_size": 2, "wall_timeout_s": 120, "cpu_seconds": 1, "max_processes": 24}),
    (SandboxSettings, {"cpu_seconds": 1, "wall_timeout_s": 0.5}),
    (SandboxSettings, {"pool_size": 0}),  # cold sandboxes only (`sprawl bench sandbox`)
    (SandboxSettings, {"pool_size": 2048}),  # 4096 uids: the whole default span
    (SandboxSettings, {"uid_base": 1000, "uid_span": 2, "pool_size": 1}),
    (SandboxSettings, {"uid_base": 2**32 - 1 - 4096}),  # the last uid is 2**32 - 2
    *((SandboxSettings, {"backend": name}) for name in SANDBOX_BACKENDS),
    (SandboxSettings, {"backend": "none", "python": "/opt/python/bin/python3"}),
    (StackSection, {}),
    (StackSection, {"nats_port": 0, "nats_monitor_port": 0, "s3_port": 0, "seaweed_port_base": 0}),
    (StackSection, {"nats_port": 0, "nats_monitor_port": 0}),  # tests/test_errors.py
    (StackSection, {"nats_port": 22010, "nats_monitor_port": 22011, "s3_port": 22012, "seaweed_port_base": 10000}),
    (StackSection, {"seaweed_port_base": 65535 - 10007}),
    (StackSection, {"seaweed_port_base": 8214}),  # base + 8 would be 8222, but S3 has its own port
    (StackSection, {"buckets": ["sprawl", "archive.v2", "abc"]}),
    (StackSection, {"nats_max_payload_bytes": 256 * 1024}),
    (StackSection, {"nats_max_payload_bytes": 64 * MIB}),
    (StackSection, {"start_timeout_s": 180.0, "seaweed_start_attempts": 1}),
    (StackSettings, {}),
]


@pytest.mark.parametrize(("model", "values"), GOOD, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(GOOD)])
def test_defaults_and_the_values_in_use_pass(model, values):
    model(**values)


def test_the_test_stacks_settings_pass(tmp_path):
    from tests.servers import auto_stack_settings, stack_settings

    auto_stack_settings(tmp_path)
    stack_settings(tmp_path)


def test_unknown_verifiers_are_named_with_the_known_ones():
    with pytest.raises(ValidationError) as refused:
        RewardSettings(routes={"arith": "exact", "a": "regex", "b": "llm_judge"})
    (line,) = validation_lines(refused.value)
    assert line == f"routes: unknown verifiers 'llm_judge', 'regex': route tasks to {', '.join(sorted(VERIFIERS))}"


def test_the_choices_follow_their_registries():
    from pipeline.views import VIEWS  # imports torch: the settings spell the names out instead

    assert sorted(get_args(ViewName)) == sorted(VIEWS)
    assert set(HTTP_ENGINES) <= set(ENGINES)
    for engine in ENGINES:
        url = {"engine_url": "http://127.0.0.1:8000"} if engine in HTTP_ENGINES else {}
        assert IslandSection(engine=engine, **url).engine == engine


def test_the_settings_keep_their_old_homes():
    from workers.sampler import island, settings, sidecar, worker

    assert island.IslandSection is worker.IslandSection is sidecar.IslandSection is settings.IslandSection
    assert worker.SamplerSettings is settings.SamplerSettings
    assert sidecar.SidecarSettings is settings.SidecarSettings and sidecar.HTTPSection is settings.HTTPSection


def test_the_default_island_id_is_a_subject_token(monkeypatch):
    from workers.sampler.island import default_island_id

    monkeypatch.setattr(socket, "gethostname", lambda: "Node1.Example.COM")
    assert default_island_id("fp8_e4m3") == "node1-example-com-fp8_e4m3"
    assert token(default_island_id("bf16"), "island_id") == "node1-example-com-bf16"


def test_the_settings_module_does_not_import_torch():
    code = "import sys, workers.sampler.settings; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *argv], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_bad_flag_is_one_line_and_exit_2():
    result = _cli("sampler", "--island.view", "fp9")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "sprawl: error: island.view: Input should be 'bf16', 'fp8_e4m3' or 'mxfp4' (got 'fp9')\n"
    result = _cli("sidecar", "--http.port", "70000", "--island.engine", "vllm")
    assert result.returncode == 2 and result.stdout == ""
    assert sorted(result.stderr.splitlines()) == [
        "sprawl: error: http.port: Input should be less than or equal to 65535 (got '70000')",
        "sprawl: error: island.engine_url: the vllm engine needs the URL of its HTTP server (http://host:port)"
        " (got '')",
    ]


@pytest.mark.parametrize("command", ["sampler", "sidecar"])
def test_sampler_and_sidecar_refuse_bad_settings_before_importing_torch(command):
    code = (
        "import sys\nfrom workers.cli import main\n"
        f"code = main([{command!r}, '--island.device', 'gpu'])\n"
        "assert code == 2, code\nassert 'torch' not in sys.modules, 'torch imported before the settings were checked'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
