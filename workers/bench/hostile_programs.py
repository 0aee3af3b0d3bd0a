"""The hostile-program catalogue (tests and `sprawl bench sandbox`): each is submitted as a code answer
whose hidden test it cannot pass."""

from __future__ import annotations

import socket

from schemas import IslandIdentity, Trajectory, VersionSpan

SECRET_FILE = "/root/.sprawl-sandbox-test-secret"
SECRET_ENV = "SPRAWL_SANDBOX_TEST_SECRET"

WALL_CLOCK_CASES = frozenset({"sleep_past_timeout"})
"""Cases that only end when the wall clock kills them: run them with a short `wall_timeout_s`, and every
other case with one far above its CPU limit, so that on a loaded machine (where a CPU second takes
many seconds of wall clock) each still ends the way it is meant to."""


def catalogue(listener_port: int, secret_file: str = SECRET_FILE) -> dict[str, tuple[str, set[str]]]:
    """name -> (answer code, acceptable error classes). `secret_file`: a host file the sandbox must not
    read (one per run when several run at once)."""
    return {
        "fork_bomb": ("import os\nwhile True:\n    os.fork()\ndef add(a, b): return a + b", {"process_limit"}),
        "memory_hog": ("x = bytearray(10 ** 10)\ndef add(a, b): return a + b", {"memory"}),
        "cpu_spin": ("while True:\n    pass\ndef add(a, b): return a + b", {"cpu"}),
        "sleep_past_timeout": ("import time\ntime.sleep(600)\ndef add(a, b): return a + b", {"timeout"}),
        "loopback_connection": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {listener_port}), timeout=2)\n"
            "def add(a, b): return a + b",
            {"network"},
        ),
        "write_outside_workdir": (
            "open('/usr/lib/sprawl-owned', 'w').write('x')\ndef add(a, b): return a + b",
            {"permission"},
        ),
        "read_root_and_env": (
            f"import os\nprint(sorted(os.environ))\nprint(open({secret_file!r}).read())\ndef add(a, b): return a + b",
            {"permission"},
        ),
        "multi_gb_output": (
            "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\ndef add(a, b): return a + b",
            {"output_limit"},
        ),
        "kill_parent": (
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\n"
            "def add(a, b): return a + b",
            {"crash", "killed"},
        ),
        "daemon_outlives_run": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
            "def add(a, b): return a - b  # and a wrong answer",
            {"test_failed"},
        ),
    }


def open_listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def code_answer(code: str, run_id: str = "r") -> Trajectory:
    """A trajectory whose answer is `code` in a python block, as the code verifier receives it."""
    return Trajectory(
        run_id=run_id,
        trajectory_id="t",
        group_id="g",
        sample_index=0,
        task="code",
        prompt_token_ids=[1],
        output_token_ids=[2],
        logprobs=[-1.0],
        finish_reason="stop",
        version_spans=[VersionSpan(version=0, start=0, end=1)],
        island=IslandIdentity(island_id="i", accelerator="cpu", view="bf16", engine="torch"),
        text=f"```python\n{code}\n```",
    )
