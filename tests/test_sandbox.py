"""Hostile programs are contained (reward 0, a precise error class) and the sandbox stays healthy."""

import os
import subprocess
from pathlib import Path

import pytest

from pipeline import sandbox as sandbox_module
from pipeline.sandbox import BwrapSandboxPool, SandboxSettings, SandboxUnavailable, modal_sandbox_request
from schemas import PromptGroup
from workers.bench.hostile_programs import SECRET_ENV, SECRET_FILE, catalogue, code_answer, open_listener
from workers.rewards.verifiers import CodeTests

TESTS = "def test_adds():\n    assert add(2, 3) == 5\n\ndef test_negative():\n    assert add(-2, 1) == -1\n"
GROUP = PromptGroup(
    run_id="r",
    group_id="g",
    task="code",
    prompt="write add",
    prompt_token_ids=[1],
    n_samples=1,
    metadata={"tests": TESTS},
)
FAST = SandboxSettings(pool_size=2, wall_timeout_s=4, cpu_seconds=2, max_processes=24)


@pytest.fixture
async def pool():
    p = BwrapSandboxPool(FAST)
    await p.start()
    yield p
    await p.close()


def _sandbox_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "uid=,stat=,args="], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if line.split()[0].isdigit()
        and FAST.uid_base <= int(line.split()[0]) < FAST.uid_base + 100
        and not line.split()[1].startswith("Z")
    ]


async def test_a_correct_answer_passes_and_a_wrong_one_names_the_test(pool):
    good = await CodeTests().verify(code_answer("def add(a, b):\n    return a + b"), GROUP, pool)
    assert good.value == 1.0 and good.error_class is None and good.sandbox_id.startswith("bwrap-")
    bad = await CodeTests().verify(code_answer("def add(a, b):\n    return abs(a + b)"), GROUP, pool)
    assert bad.value == 0.0 and bad.error_class == "test_failed"
    assert bad.details["failed_test"] == "test_negative"
    missing = await CodeTests().verify(code_answer("print('no function here')"), GROUP, pool)
    assert missing.format_error and missing.value == 0.0


async def test_hostile_catalogue_is_contained(pool, monkeypatch):
    Path(SECRET_FILE).write_text("top secret")
    monkeypatch.setenv(SECRET_ENV, "also secret")
    listener = open_listener()
    try:
        cases = catalogue(listener.getsockname()[1])
        for name, (code, classes) in cases.items():
            verdict = await CodeTests().verify(code_answer(code), GROUP, pool)
            assert verdict.value == 0.0, name
            assert verdict.error_class in classes, (name, verdict.error_class, verdict.details)
            assert "top secret" not in str(verdict.details) and "also secret" not in str(verdict.details), name
            healthy = await CodeTests().verify(code_answer("def add(a, b):\n    return a + b"), GROUP, pool)
            assert healthy.value == 1.0, f"sandbox unhealthy after {name}"
    finally:
        listener.close()
        os.unlink(SECRET_FILE)
    assert os.path.exists("/usr/lib/sprawl-owned") is False
    await pool.close()  # the warm sandboxes waiting for programs go too; nothing else may be left
    assert _sandbox_processes() == [], "a sandboxed process outlived its run"


async def test_environment_is_clean_and_root_is_absent(pool, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "also secret")
    result = await pool.run("import os\nprint(sorted(os.environ))\nprint(os.listdir('/'))\nprint(os.getcwd())")
    assert result.error_class is None
    assert SECRET_ENV not in result.stdout and "also secret" not in result.stdout
    assert "'root'" not in result.stdout.splitlines()[1] and "'etc'" not in result.stdout.splitlines()[1]
    assert result.stdout.splitlines()[2] == "/work"


def test_missing_bubblewrap_is_a_clear_error_never_a_fallback(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        BwrapSandboxPool(SandboxSettings())


def test_modal_requests_carry_the_same_limits():
    request = modal_sandbox_request(SandboxSettings(wall_timeout_s=7, memory_mb=256), "print(1)")
    assert request["block_network"] is True and request["timeout"] == 7 and request["memory"] == 256
    assert request["args"][-1] == "print(1)"
