"""Errors a user can meet are typed: unknown names say what is registered, and an outage is a
TransientError (retry later), never "not found", "not declared" or a quietly short history.

The outages are real: a private nats-server this test starts and then stops, an S3 endpoint where
nothing listens, and one that accepts connections but never answers. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from infra import stack
from infra.stack import StackSection
from infra.streams import apply
from pipeline.blobstore import BLOB_BACKENDS, S3BlobStore, open_blob_store
from pipeline.config import LocalBlobSettings, LogSettings, S3BlobSettings
from pipeline.consumer import Consumer
from pipeline.errors import (
    AppendFailed,
    BlobStoreUnavailable,
    LogUnavailable,
    Retryable,
    SprawlError,
    TransientError,
    UnknownBlobBackend,
    UnknownView,
)
from pipeline.eventlog import EventLog, connect_nats
from pipeline.replay import replay
from pipeline.subjects import trajectories_filter
from pipeline.views import VIEWS, get_view
from tests.events import trajectory
from tests.servers import START_TIMEOUT_S, TEST_STREAMS, admin_nats, free_port, new_run_id

# ------------------------------------------------------------------ registries


def test_unknown_blob_backend_type_is_a_sprawl_error_naming_it(tmp_path):
    # Before the registry, any settings that were not S3BlobSettings silently opened a local folder.
    settings = LocalBlobSettings.model_construct(type="gcs", root=tmp_path / "blobs")
    with pytest.raises(UnknownBlobBackend, match=r"'gcs'.*registered: local, s3") as info:
        open_blob_store(settings)
    assert isinstance(info.value, SprawlError) and info.value.hint
    assert not (tmp_path / "blobs").exists()


def test_blob_backends_are_chosen_by_type(tmp_path):
    assert sorted(BLOB_BACKENDS) == ["local", "s3"]
    local = open_blob_store(LocalBlobSettings(root=tmp_path / "blobs"))
    assert type(local).__name__ == "LocalBlobStore"
    assert isinstance(open_blob_store(S3BlobSettings()), S3BlobStore)


def test_unknown_view_is_a_sprawl_error_naming_the_registered_ones():
    with pytest.raises(UnknownView, match=r"'int4'.*bf16, fp8_e4m3, mxfp4") as info:
        get_view("int4")
    assert isinstance(info.value, SprawlError) and isinstance(info.value, ValueError)
    assert "pipeline/views/" in info.value.hint
    assert set(VIEWS) == {"bf16", "fp8_e4m3", "mxfp4"}


def test_outages_are_transient_errors():
    assert Retryable is TransientError
    assert issubclass(BlobStoreUnavailable, TransientError)
    assert issubclass(LogUnavailable, TransientError)
    error = TransientError("the verifier pool is full", retry_after_s=2.0)
    assert error.retry_after_s == 2.0 and "retry later" in str(error)


# ------------------------------------------------------------------ an S3 endpoint that does not answer


def test_unreachable_s3_endpoint_is_transient_not_absent():
    store = S3BlobStore(
        S3BlobSettings(endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=1, connect_timeout_s=0.5)
    )
    with pytest.raises(BlobStoreUnavailable):
        store.exists(store.uri("some/key"))  # an outage is never "the blob does not exist"
    with pytest.raises(TransientError):
        store.get_bytes(store.uri("some/key"))


def test_s3_read_timeout_is_transient():
    # A listening socket that never answers: the request goes out, no response comes back.
    with socket.create_server(("127.0.0.1", 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        store = S3BlobStore(S3BlobSettings(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1, read_timeout_s=0.5))
        with pytest.raises(BlobStoreUnavailable, match="ReadTimeoutError"):
            store.get_bytes(store.uri("some/key"))


# ------------------------------------------------------------------ a nats-server that stops


@pytest.fixture
def private_nats(tmp_path):
    """A nats-server of our own (the session one is shared), stopped by pid at the end if still up."""
    section = StackSection(nats_port=0, nats_monitor_port=0, start_timeout_s=START_TIMEOUT_S)
    record = stack.start_nats(tmp_path, section)
    servers = [record]
    try:
        yield admin_nats(tmp_path, record.endpoint, reconnect_wait_s=0.2), lambda: stack.stop_servers(servers)
    finally:
        stack.stop_servers(servers)


@pytest.fixture
async def stoppable_log(private_nats):
    nats_settings, stop_server = private_nats
    run_id = new_run_id()
    nc = await connect_nats(nats_settings, name="test-errors")
    log = EventLog(
        nc, None, LogSettings(publish_timeout_s=1.0, publish_attempts=2, publish_backoff_s=0.05), "test-errors"
    )
    await apply(log.js, TEST_STREAMS, run_id)
    try:
        yield log, run_id, stop_server
    finally:
        await log.close()


@pytest.mark.integration
async def test_replay_that_loses_the_server_raises_retryable_not_a_short_history(stoppable_log):
    log, run_id, stop_server = stoppable_log
    for n in range(3):
        await log.append(trajectory(run_id, f"r-{n}", 2))
    items = aiter(replay(log, "TRAJECTORIES", trajectories_filter(run_id), batch=1))
    first = await anext(items)
    assert first.event.trajectory_id == "r-0"
    stop_server()
    # Before: the fetch timeout ended the replay, and a projection rebuilt from one event of three.
    with pytest.raises(LogUnavailable, match="2 messages still pending") as info:
        await anext(items)
    assert isinstance(info.value, TransientError)


@pytest.mark.integration
async def test_binding_a_consumer_without_a_server_is_retryable_not_undeclared(stoppable_log):
    log, run_id, stop_server = stoppable_log
    stop_server()
    consumer = Consumer(log, "TRAJECTORIES", f"{run_id}-rewards", _noop)
    with pytest.raises(LogUnavailable, match=f"binding consumer '{run_id}-rewards'"):
        await consumer.bind()


@pytest.mark.integration
async def test_append_without_a_server_is_retryable_and_still_an_append_failure(stoppable_log):
    log, run_id, stop_server = stoppable_log
    stop_server()
    with pytest.raises(TransientError, match="same Nats-Msg-Id") as info:
        await asyncio.wait_for(log.append(trajectory(run_id, "lost", 2)), timeout=20)
    assert isinstance(info.value, AppendFailed)  # callers that caught AppendFailed still do


async def _noop(delivery) -> None:
    return None
