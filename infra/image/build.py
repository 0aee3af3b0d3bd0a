"""`just image`: build the Containerfile with podman or docker, whichever is installed.

pip's own settings on this machine travel with the build without entering the Containerfile or a
layer: `PIP_CONFIG_FILE` (a private index or mirror) and `PIP_CERT` (a CA bundle, for a
TLS-intercepting proxy) as build secrets, and the first local folder in `PIP_FIND_LINKS` (wheels on
disk, such as an offline torch) as the `wheels` build context. Everything after the options goes to
the engine's `build` unchanged:

    python -m infra.image.build --tag localhost/sprawl:dev --build-arg BASE=localhost/sprawl-base:bookworm
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from pipeline.errors import SprawlError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TAG = "localhost/sprawl:dev"
ENGINES = ("podman", "docker")

CAP_SYS_RESOURCE = 24
"""Linux capability number: raising a hard rlimit needs it."""

CONTAINER_NOFILE = 65536
CONTAINER_NPROC = 4096
"""Limits for `run` where podman's own defaults cannot be granted (below): far above what one sprawl
worker opens or starts, and below what such a machine allows."""


class ImageError(SprawlError):
    """The image cannot be built or run here: no engine, or an engine that cannot start containers."""


def find_engine(preferred: str | None = None) -> str:
    """The path of `preferred`, or of the first of podman and docker that is installed."""
    names = (preferred,) if preferred else ENGINES
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise ImageError(
        f"no container engine: {' or '.join(names)} is not installed",
        hint="apt-get install podman (Debian's package), or install docker with BuildKit",
    )


def _is_podman(engine: str) -> bool:
    return Path(engine).name.startswith("podman")


def _mount_types(mountinfo: str) -> dict[str, str]:
    """Mount point -> filesystem type, from /proc/self/mountinfo's text (the last mount wins)."""
    types = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        types[fields[4]] = after[0] if after else ""
    return types


def hybrid_cgroups(mountinfo: str) -> bool:
    """cgroup v1 controllers at /sys/fs/cgroup and a v2 hierarchy beside them (systemd's "hybrid")."""
    types = _mount_types(mountinfo)
    return types.get("/sys/fs/cgroup") != "cgroup2" and types.get("/sys/fs/cgroup/unified") == "cgroup2"


@functools.cache
def _podman_runtime(engine: str) -> str:
    done = subprocess.run(
        [engine, "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True, text=True, timeout=120
    )
    return done.stdout.strip()


def runtime_args(engine: str) -> list[str]:
    """`--runtime runc` where podman's runtime is crun on a hybrid cgroup layout: crun 1.8 (Debian
    bookworm's) refuses to start any container there ("cgroups in hybrid mode not supported"); runc
    runs on it. Global options: they go before podman's subcommand."""
    if not _is_podman(engine) or not hybrid_cgroups(Path("/proc/self/mountinfo").read_text()):
        return []
    if _podman_runtime(engine) != "crun":
        return []
    if shutil.which("runc") is None:
        raise ImageError(
            "podman's runtime crun cannot start containers on this machine's hybrid cgroup layout",
            hint="apt-get install runc (podman then runs with --runtime runc)",
        )
    return ["--runtime", "runc"]


def _has_capability(number: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> number & 1)
    return False


def run_limit_args(engine: str) -> list[str]:
    """`--ulimit`s for `run` where podman's rootful defaults (1048576 open files) exceed what this
    process may grant: without CAP_SYS_RESOURCE, no hard rlimit can be raised and the runtime's
    setrlimit fails with EPERM before the container starts."""
    if not _is_podman(engine) or _has_capability(CAP_SYS_RESOURCE):
        return []
    import resource

    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], CONTAINER_NOFILE)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={CONTAINER_NPROC}:{CONTAINER_NPROC}"]


def _local_wheel_folder(find_links: str) -> Path | None:
    """The first entry of PIP_FIND_LINKS (space-separated) that is a folder on this machine."""
    for entry in find_links.split():
        path = Path(entry.removeprefix("file://"))
        if path.is_dir():
            return path
    return None


def pip_inputs(environ: Mapping[str, str]) -> list[str]:
    """Build options passing pip's settings from `environ` (see the module's docstring)."""
    args = []
    for variable, secret in (("PIP_CONFIG_FILE", "pip.conf"), ("PIP_CERT", "ca.crt")):
        source = environ.get(variable, "")
        if source and Path(source).is_file():
            args += ["--secret", f"id={secret},src={source}"]
    wheels = _local_wheel_folder(environ.get("PIP_FIND_LINKS", ""))
    if wheels is not None:
        args += ["--build-context", f"wheels={wheels}"]
    return args


def build_argv(
    engine: str,
    *,
    tag: str = DEFAULT_TAG,
    context: Path = REPO_ROOT,
    extra: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    environ = os.environ if environ is None else environ
    return [
        engine,
        *runtime_args(engine),
        "build",
        "--file", str(context / "Containerfile"),
        "--tag", tag,
        *pip_inputs(environ),
        *extra,
        str(context),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="just image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"the image's name (default {DEFAULT_TAG})")
    parser.add_argument("--engine", choices=ENGINES, help="podman or docker (default: the first installed)")
    parser.add_argument("--dry-run", action="store_true", help="print the engine's command, run nothing")
    options, extra = parser.parse_known_args(argv)
    try:
        command = build_argv(find_engine(options.engine), tag=options.tag, extra=extra)
    except ImageError as error:
        print(f"image: {error}", file=sys.stderr)
        return 2
    print("+ " + " ".join(command), file=sys.stderr)
    if options.dry_run:
        return 0
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
