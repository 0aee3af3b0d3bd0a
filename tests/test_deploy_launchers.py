"""The launchers under infra/deploy: the SkyPilot task validated against SkyPilot's own schema
(vendored: infra/deploy/skypilot/task.schema.json), and the Modal app imported, its plan
unit-tested and its function run locally (no SkyPilot install, no Modal account: nothing is launched)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
import typing
from pathlib import Path

import jsonschema
import pytest
import yaml

from infra.deploy.kubernetes_check import names_a_field
from workers.cli import COMMANDS, parser_for
from workers.sampler.settings import SamplerSettings, ViewName

ROOT = Path(__file__).resolve().parents[1]
SKYPILOT = ROOT / "infra" / "deploy" / "skypilot"
README_INSTALL = "pip install torch==2.13.0"


def _parses(argv: list[str]) -> None:
    """`sprawl ARGV` is a real command with flags it has (raises otherwise)."""
    assert argv[0] in COMMANDS, f"`sprawl {argv[0]}` is not a sprawl command"
    parser, _ = parser_for(argv[0])
    parser.parse_args(argv)


# ---------------------------------------------------------------- SkyPilot


def _skypilot_validator(schema: dict) -> jsonschema.protocols.Validator:
    """Draft 7 with SkyPilot's two keywords of its own, as sky/utils/validator.py defines them."""

    def case_insensitive_enum(validator, enums, instance, schema):
        if instance.lower() not in [e.lower() for e in enums]:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

    def case_sensitive_enum(validator, enums, instance, schema):
        if instance not in enums:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

    cls = jsonschema.validators.extend(
        jsonschema.Draft7Validator,
        validators={"case_insensitive_enum": case_insensitive_enum, "case_sensitive_enum": case_sensitive_enum},
    )
    return cls(schema)


def skypilot_errors(task: dict) -> list[str]:
    """What `sky launch` would refuse in a task YAML (SkyPilot drops top-level nulls first)."""
    schemas = json.loads((SKYPILOT / "task.schema.json").read_text())
    task = {k: v for k, v in task.items() if v is not None}
    errors = [e.message for e in _skypilot_validator(schemas["task"]).iter_errors(task)]
    if isinstance(task.get("resources"), dict):
        errors += [
            f"resources: {e.message}" for e in _skypilot_validator(schemas["resources"]).iter_errors(task["resources"])
        ]
    return errors


def island_task() -> dict:
    return yaml.safe_load((SKYPILOT / "island.yaml").read_text())


def test_the_island_task_is_valid_for_skypilot():
    schemas = json.loads((SKYPILOT / "task.schema.json").read_text())
    assert schemas["skypilot_version"] == "0.14.1"
    assert skypilot_errors(island_task()) == []


def test_the_island_runs_on_any_of_three_gpus_with_the_token_as_a_secret():
    task = island_task()
    assert task["resources"]["accelerators"] == {"H100": 1, "A100": 1, "L4": 1}
    assert task["secrets"] == {"SPRAWL_JOIN": None}  # given at launch, never stored in the file
    assert "SPRAWL_JOIN" not in task["run"] and "--join" not in task["run"]  # never on a command line
    assert README_INSTALL in task["setup"] and README_INSTALL in (ROOT / "README.md").read_text()


def test_the_island_s_command_line_and_variables_are_sprawl_s():
    task = island_task()
    (line,) = [ln for ln in task["run"].splitlines() if ln.strip().startswith("exec sprawl ")]
    argv = shlex.split(line)[2:]
    _parses(argv)
    assert argv == ["sampler", "--island.device", "cuda"]
    for variable in [*task["envs"], *task["secrets"]]:
        assert names_a_field(SamplerSettings, variable), variable
    assert task["envs"]["SPRAWL_ISLAND__VIEW"] in typing.get_args(ViewName)


def test_skypilot_s_schema_refuses_what_sky_launch_would():
    task = island_task()
    task["resource"] = task.pop("resources")  # a misspelt field
    task["num_nodes"] = "two"
    errors = "\n".join(skypilot_errors(task))
    assert "'resource'" in errors and "'two' is not of type 'integer'" in errors
    task = island_task()
    task["resources"]["disk_size"] = "big"
    task["resources"]["acelerators"] = "H100:1"
    errors = "\n".join(skypilot_errors(task))
    assert errors.count("resources: ") >= 2 and "acelerators" in errors


# ---------------------------------------------------------------- Modal


@pytest.fixture(scope="module")
def islands():
    """infra/deploy/modal/islands.py imported as `modal run` imports it (a file, not a package)."""
    path = ROOT / "infra" / "deploy" / "modal" / "islands.py"
    spec = importlib.util.spec_from_file_location("sprawl_modal_islands", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_the_modal_app_defines_a_gpu_island_function_with_the_join_secret(islands):
    assert islands.app.name == "sprawl-islands"
    spec = islands.island._spec_  # modal 1.6.4's record of the decorator's arguments
    assert spec.gpus == ["H100", "A100-80GB", "L4"]
    assert [repr(s) for s in spec.secrets] == ["modal.Secret.from_name('sprawl-join')"]
    assert spec.ephemeral_disk == 256 * 1024
    assert islands.TORCH in README_INSTALL


def test_the_modal_views_are_the_sampler_s(islands):
    assert typing.get_args(ViewName) == islands.VIEWS
    for view in islands.VIEWS:
        command = islands.island_command(view)
        assert command[0] == "sprawl"
        _parses(command[1:])
    for variable in islands.island_env():
        assert names_a_field(SamplerSettings, variable), variable


def test_the_island_plan(islands):
    default = islands.island_plan(["bf16", "fp8_e4m3"], 1)
    assert [(p.view, p.gpu) for p in default] == [
        ("bf16", ["H100", "A100-80GB", "L4"]),
        ("fp8_e4m3", ["H100", "A100-80GB", "L4"]),
    ]
    spread = islands.island_plan(["fp8_e4m3"], 3, ["H100", "L4"])
    assert [p.gpu for p in spread] == ["H100", "L4", "H100"]
    with pytest.raises(ValueError, match="unknown view 'fp16'"):
        islands.island_plan(["bf16", "fp16"], 1)
    with pytest.raises(ValueError, match="unknown GPU type"):
        islands.island_plan(["bf16"], 1, ["V100"])
    with pytest.raises(ValueError, match="per_view must be at least 1"):
        islands.island_plan(["bf16"], 0)


def test_the_island_function_runs_sprawl_sampler_and_fails_loudly(islands, monkeypatch, tmp_path):
    """The function body, run here: the real `sprawl sampler` with a damaged token stops at once, and
    the function raises instead of returning as if the island had served."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPRAWL_JOIN", "sprawl-join.v1.not-a-token")
    monkeypatch.setenv("SPRAWL_STATE_DIR", str(tmp_path / "state"))
    with pytest.raises(RuntimeError, match="sprawl sampler exited with 2"):
        islands.island.local("bf16")
