"""The log as a 3-node JetStream cluster on loopback (`sprawl stack up --nats-cluster 3`): streams get 3
replicas, and losing the server that leads a stream, or one that follows it, loses no acknowledged
event and applies none twice; the killed server comes back on its ports and catches up. The links
between the nodes admit only the stack's own servers; a revoked token is refused by every node."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl

import pytest

from infra import stack
from infra.server_process import is_nats_node
from infra.stack import StackSection
from infra.stack_security import StackSecurity
from infra.streams import apply
from pipeline.errors import LogIdentityRefused, LogUnavailable, StackError
from pipeline.eventlog import EventLog
from pipeline.topology import STREAMS, consumers_of_run
from tests.servers import HANG_GUARD_S, running_cluster
from workers.bench.failover_bench import kill_stream_server, restart_dead, run_scenario
from workers.cli import main


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("cluster"), "cluster-test") as settings:
        yield settings


async def test_streams_and_consumers_get_three_replicas_on_a_cluster(cluster):
    assert len(cluster.nats.url.split(",")) == 3, "clients get every node's URL"
    event_log = await EventLog.connect(cluster, "replicas")
    try:
        await apply(event_log.js, cluster.streams, "replicas-run")
        for declared in STREAMS:
            info = await event_log.js.stream_info(declared.name)
            assert info.config.num_replicas == 3, declared.name
        for consumer in consumers_of_run("replicas-run"):
            info = await event_log.js.consumer_info(consumer.stream.name, consumer.name)
            assert info.config.num_replicas == 3, consumer.name
    finally:
        await event_log.close()


@pytest.mark.parametrize("which", ["leader", "follower"])
async def test_killing_a_stream_server_loses_nothing_and_applies_nothing_twice(cluster, which):
    outcome = await run_scenario(cluster, kill_stream_server(which), restart_dead, guard_s=HANG_GUARD_S)
    assert outcome.appended >= 60, "appends went on before, during and after the fault"
    assert outcome.lost == 0, outcome.summary()
    assert outcome.applied_twice == 0, outcome.summary()
    assert outcome.stored_twice == 0, outcome.summary()
    assert outcome.applied == outcome.appended, "the consumer resumed and applied every acknowledged event"
    restarted = stack.status(cluster)
    assert restarted is not None and restarted.secure, "the repaired stack is still the secure one"
    assert sum(1 for s in restarted.servers if is_nats_node(s)) == 3


def test_the_links_between_nodes_refuse_a_server_without_the_stack_certificate(cluster):
    running = stack.status(cluster)
    route_port = running.server("nats-2").ports["cluster"]
    context = ssl.create_default_context(cafile=str(StackSecurity(cluster.state_dir.resolve() / "stack").ca_file))
    # A would-be node that trusts the CA but holds no certificate of its own: the node refuses it.
    raw = socket.create_connection(("127.0.0.1", route_port), timeout=HANG_GUARD_S)
    try:
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            _talk_tls(context, raw)
    finally:
        raw.close()


def _talk_tls(context: ssl.SSLContext, raw: socket.socket) -> None:
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"CONNECT {}\r\nPING\r\n")
        if not tls.recv(4096):
            raise ConnectionResetError("closed by the node")


def test_asking_a_running_stack_for_another_size_is_refused_and_not_asking_keeps_its_size(cluster):
    other = cluster.model_copy(update={"stack": StackSection(**{**cluster.stack.model_dump(), "nats_cluster": 1})})
    with pytest.raises(StackError, match="3 nats-server node"):
        stack.up(other)
    unsized = cluster.stack.model_dump()
    unsized.pop("nats_cluster")
    kept = stack.up(cluster.model_copy(update={"stack": StackSection(**unsized)}))
    assert kept.already_running and sum(1 for s in kept.servers if is_nats_node(s)) == 3


async def test_a_token_revoked_while_a_node_is_down_is_refused_by_every_node_even_the_restarted_one(
    cluster, capsys, monkeypatch, tmp_path
):
    from infra.join_token import decode, join_settings
    from pipeline.config import load_settings
    from workers.sampler.settings import SamplerSettings

    monkeypatch.setenv("SPRAWL_STATE_DIR", str(cluster.state_dir))
    monkeypatch.setenv("SPRAWL_RUN_ID", cluster.run_id)
    assert main(["token", "create", "--role", "sampler"]) == 0
    text = capsys.readouterr().out.strip().splitlines()[-1]
    joined = load_settings(SamplerSettings, None, state_dir=tmp_path, **join_settings(text, tmp_path))
    urls = joined.nats.url.split(",")
    assert len(urls) == 3, "the token carries every node's URL"
    down = stack.status(cluster).server("nats-3")
    os.kill(down.pid, signal.SIGKILL)
    # A half-dead cluster still serves: the live nodes must drop the token now, not after a repair.
    assert main(["token", "revoke", decode(text).token_id]) == 0
    assert "2 of 3 nats-server nodes reloaded" in capsys.readouterr().out
    stack.up(cluster)  # nats-3 back, reading the revocation as it starts
    for url in urls:  # each node alone: none of them still takes the user (nor hangs trying)
        one_node = joined.model_copy(update={"nats": joined.nats.model_copy(update={"url": url})})
        with pytest.raises((LogIdentityRefused, LogUnavailable)):
            await asyncio.wait_for(EventLog.connect(one_node, worker="revoked"), HANG_GUARD_S)
