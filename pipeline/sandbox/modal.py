"""The `modal` backend: Modal Sandboxes, when the `modal` package is installed and configured."""

from __future__ import annotations

import time

from pipeline.sandbox import SandboxResult, SandboxSettings, SandboxUnavailable


def modal_sandbox_request(settings: SandboxSettings, program: str) -> dict:
    """How a program maps onto `modal.Sandbox.create(...)`: the same limits, no network, one exec."""
    return {
        "args": ["python", "-I", "-S", "-c", program],
        "timeout": int(settings.wall_timeout_s),
        "cpu": 1.0,
        "memory": settings.memory_mb,
        "block_network": True,
        "workdir": "/work",
    }


class ModalSandboxRunner:
    def __init__(self, settings: SandboxSettings):
        try:
            import modal  # noqa: F401
        except ImportError as exc:
            raise SandboxUnavailable(
                "the modal sandbox backend needs the `modal` package", hint="pip install modal, then `modal token new`"
            ) from exc
        self.settings = settings

    async def start(self) -> None:
        return None

    async def run(self, program: str) -> SandboxResult:
        import modal

        request = modal_sandbox_request(self.settings, program)
        started = time.perf_counter()
        app = modal.App.lookup("sprawl-sandbox", create_if_missing=True)
        sandbox = await modal.Sandbox.create.aio(*request.pop("args"), app=app, **request)
        await sandbox.wait.aio()
        stdout = (await sandbox.stdout.read.aio())[: self.settings.max_output_bytes]
        stderr = (await sandbox.stderr.read.aio())[: self.settings.max_output_bytes]
        return SandboxResult(
            sandbox_id=f"modal-{sandbox.object_id}",
            exit_code=sandbox.returncode,
            signal=None,
            stdout=stdout,
            stderr=stderr,
            duration_s=time.perf_counter() - started,
            timed_out=sandbox.returncode is None,
            output_truncated=False,
        )

    async def close(self) -> None:
        return None
