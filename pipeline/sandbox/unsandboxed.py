"""The `none` backend: the same limits as a sandbox, no isolation. For trusted verifiers only."""

from __future__ import annotations

import uuid

from pipeline.logs import get_logger
from pipeline.sandbox import SandboxResult, SandboxSettings
from pipeline.sandbox.process import RUNNER, ProgramProcess, run_program

log = get_logger(__name__)


class UnsandboxedRunner:
    """Each program in a fresh interpreter under the sandbox rlimits, as this process's user."""

    def __init__(self, settings: SandboxSettings, *, warn: bool = True):
        self.settings = settings
        if warn:  # `sprawl bench sandbox` measures its baseline with it, and says so itself
            log.warning("sandbox backend is `none`: verifier programs run WITHOUT isolation; use only for trusted code")

    async def start(self) -> None:
        return None

    async def run(self, program: str) -> SandboxResult:
        argv = [self.settings.python, "-I", "-S", "-c", RUNNER]
        # A clean environment: even trusted code has no business with the worker's credentials.
        proc = ProgramProcess.start(argv, self.settings, env={"PATH": "/usr/bin"})
        try:
            return await run_program(proc, f"none-{uuid.uuid4().hex[:8]}", program, self.settings)
        finally:
            await proc.finish()

    async def close(self) -> None:
        return None
