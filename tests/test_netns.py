"""The network lab (infra/netns.py) with real namespaces, veth pairs and tbf: who reaches whom, the shaping,
and that nothing is left behind. Skips, with the reason, where namespaces cannot be made (not root)."""

from __future__ import annotations

import errno
import json
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from infra import netns
from infra.netns import Island, NetworkLab, NetworkLabError

HANG_GUARD_S = 60.0
"""Only against a hang: every wait below ends on an event long before this."""

SERVER = textwrap.dedent(
    """
    import socket, sys, threading

    def serve(conn):
        with conn, conn.makefile("rb") as reader:
            verb, size = reader.readline().split()
            size = int(size)
            if verb == b"get":  # the client downloads `size` bytes
                chunk = bytes(65536)
                while size > 0:
                    conn.sendall(chunk[:size])
                    size -= min(size, len(chunk))
            else:  # the client uploads `size` bytes; answer once all arrived
                while size > 0:
                    size -= len(reader.read1(min(size, 65536)) or sys.exit("upload cut short"))
                conn.sendall(b"ok\\n")

    server = socket.create_server((sys.argv[1], 0))
    print("listening", server.getsockname()[1], flush=True)
    while True:
        threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
    """
)

CLIENT = textwrap.dedent(
    """
    import json, socket, sys, time

    host, port, verb, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    try:
        conn = socket.create_connection((host, port), timeout=10)
    except OSError as exc:
        print(json.dumps({"error": exc.errno, "text": str(exc)}))
        sys.exit()
    started = time.monotonic()
    conn.sendall(f"{verb} {size}\\n".encode())
    if verb == "put":
        conn.sendall(bytes(size))
        assert conn.recv(3) == b"ok\\n"
    else:
        received = 0
        while received < size:
            received += len(conn.recv(65536) or sys.exit("download cut short"))
    print(json.dumps({"seconds": time.monotonic() - started}))
    """
)

SIGTERM_IGNORER = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
SIGTERM_IGNORER += "while True: time.sleep(1)\n"


@pytest.fixture
def lab() -> Iterator[NetworkLab]:
    reason = netns.lab_unavailable()
    if reason:
        pytest.skip(f"no network lab here: {reason}")
    with NetworkLab(stop_grace_s=0.5) as lab:
        yield lab


def read_line(process: subprocess.Popen[str]) -> str:
    """The process's next stdout line, waiting for it as an event (with a hang guard, never a sleep)."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(HANG_GUARD_S):
            raise AssertionError(f"no line from {process.args} within {HANG_GUARD_S}s")
    return process.stdout.readline()


def start_server(lab: NetworkLab, bind: str = "0.0.0.0") -> int:
    """The test server in the hub; returns its port once it listens."""
    server = lab.spawn_in(lab.hub, [sys.executable, "-c", SERVER, bind], stdout=subprocess.PIPE, text=True)
    verb, port = read_line(server).split()
    assert verb == "listening"
    return int(port)


def client(lab: NetworkLab, island: Island, host: str, port: int, verb: str = "get", size: int = 1) -> dict:
    """Run the test client inside `island`: {"seconds": ...} after the transfer, or {"error": errno}."""
    argv = lab.argv_in(island, [sys.executable, "-c", CLIENT, host, str(port), verb, str(size)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    return json.loads(done.stdout)


def root_tbf(lab: NetworkLab, namespace: str, dev: str) -> dict | None:
    """The root qdisc of `dev` if it is tbf, else None (`tc -j` reports rate in bytes per second)."""
    shown = subprocess.run(
        ["tc", "-n", namespace, "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True
    )
    roots = [qdisc for qdisc in json.loads(shown.stdout) if qdisc.get("root")]
    return roots[0] if roots and roots[0]["kind"] == "tbf" else None


def test_an_island_reaches_the_hub_through_its_own_link_only(lab: NetworkLab) -> None:
    first = lab.add_island("first", None)
    second = lab.add_island("second", None)
    port = start_server(lab)

    assert "seconds" in client(lab, first, first.hub_addr, port)
    assert "seconds" in client(lab, second, second.hub_addr, port)
    # Neither the other island nor the hub's end of the other island's link: no route, refused at once.
    for address in (first.address, first.hub_addr):
        assert client(lab, second, address, port).get("error") == errno.ENETUNREACH, f"second reached {address}"

    # The root namespace holds none of the lab's addresses and no route that is the lab's own (a connect
    # from here is not tried: with a default route out of the machine it would send packets elsewhere).
    root_links = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, check=True).stdout)
    root_ips = {info["local"] for link in root_links for info in link.get("addr_info", [])}
    assert not root_ips & {first.address, first.hub_addr, second.address, second.hub_addr}
    routes = json.loads(subprocess.run(["ip", "-j", "route"], capture_output=True, check=True).stdout)
    assert not [r for r in routes if r.get("dst", "").startswith("10.201.")], routes


def test_tbf_shapes_both_ends_and_set_rate_changes_a_live_link(lab: NetworkLab) -> None:
    island = lab.add_island("shaped", 20)
    ends = [(lab.hub, island.hub_veth), (island.namespace, island.veth)]
    for namespace, dev in ends:
        tbf = root_tbf(lab, namespace, dev)
        assert tbf is not None, f"no tbf on {dev} in {namespace}"
        assert tbf["options"]["rate"] == 20_000_000 / 8
        assert tbf["options"]["burst"] >= netns.BURST_FLOOR_BYTES - 1  # tc reports it rounded to its ticks

    lab.set_rate(island, 100)
    assert [root_tbf(lab, *end)["options"]["rate"] for end in ends] == [100_000_000 / 8] * 2
    assert island.rate_mbit == 100

    lab.set_rate("shaped", None)
    assert [root_tbf(lab, *end) for end in ends] == [None, None]
    lab.set_rate("shaped", 5)
    assert [root_tbf(lab, *end)["options"]["rate"] for end in ends] == [5_000_000 / 8] * 2


def test_a_shaped_link_is_capped_and_slower_than_an_unshaped_one(lab: NetworkLab) -> None:
    rate_mbit, size = 20.0, 4_000_000
    shaped = lab.add_island("shaped", rate_mbit)
    unshaped = lab.add_island("unshaped", None)
    port = start_server(lab)

    seconds = {
        (island.name, verb): client(lab, island, island.hub_addr, port, verb, size)["seconds"]
        for island in (shaped, unshaped)
        for verb in ("get", "put")
    }
    mbit_per_s = {key: size * 8 / 1e6 / value for key, value in seconds.items()}
    print(f"transfer of {size} bytes, Mbit/s: {mbit_per_s}")
    for verb in ("get", "put"):  # downloads and uploads are both shaped
        # A ratio against the same run's baseline: load slows both, so no absolute deadline.
        assert mbit_per_s[("shaped", verb)] < mbit_per_s[("unshaped", verb)] / 2, mbit_per_s
        # An upper bound only (load can make a transfer slower, never faster): the cap holds, give or
        # take the bucket's initial burst and timer slack.
        assert mbit_per_s[("shaped", verb)] < rate_mbit * 1.25, mbit_per_s


def namespaces_of(lab: NetworkLab) -> set[str]:
    return {name for name in netns.list_namespaces() if name.startswith(f"{lab.lab_id}-")}


def test_close_stops_every_process_and_deletes_every_namespace(lab: NetworkLab) -> None:
    island = lab.add_island("island", 50)
    # One spawned through the lab and ignoring SIGTERM; one started behind the lab's back, found by namespace.
    stubborn = lab.spawn_in(island, [sys.executable, "-c", SIGTERM_IGNORER], stdout=subprocess.PIPE, text=True)
    assert read_line(stubborn).strip() == "ready"
    stranger_argv = lab.argv_in(lab.hub, [sys.executable, "-c", SIGTERM_IGNORER])
    stranger = subprocess.Popen(stranger_argv, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(stranger).strip() == "ready"
        assert namespaces_of(lab) == {lab.hub, island.namespace}

        lab.close()

        assert namespaces_of(lab) == set()
        assert stubborn.returncode == -signal.SIGKILL  # reaped by close()
        assert stranger.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
        lab.close()  # idempotent
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()


def test_sweep_stale_deletes_the_lab_of_a_killed_creator(lab: NetworkLab) -> None:
    creator_script = textwrap.dedent(
        """
        import sys, time
        from infra.netns import NetworkLab

        lab = NetworkLab().start()
        island = lab.add_island("island", 10)
        sleeper = lab.spawn_in(lab.hub, [sys.executable, "-c", "import time; time.sleep(600)"])
        print(lab.hub, island.namespace, sleeper.pid, flush=True)
        time.sleep(600)
        """
    )
    creator = subprocess.Popen([sys.executable, "-c", creator_script], stdout=subprocess.PIPE, text=True)
    try:
        hub, island_namespace, sleeper_pid = read_line(creator).split()
        # Checked while the creator lives: once it is dead, a lab started by a concurrent test run may sweep first.
        assert {hub, island_namespace} <= set(netns.list_namespaces())
        assert int(sleeper_pid) in netns.namespace_pids(hub)
    finally:
        creator.kill()  # SIGKILL: no close(), the lab stays behind
        creator.wait()

    netns.sweep_stale()

    assert not {hub, island_namespace} & set(netns.list_namespaces())
    assert netns._pid_gone(int(sleeper_pid))
    assert lab.hub in netns.list_namespaces(), "a live creator's lab is never swept"


def test_a_failing_command_raises_with_its_stderr_and_leaves_nothing_half_made(
    lab: NetworkLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    island = lab.add_island("island", 10)
    subprocess.run(["ip", "netns", "delete", island.namespace], check=True)  # pulled from under the lab
    with pytest.raises(NetworkLabError) as failed:
        lab.set_rate(island, 20)
    assert failed.value.command[0] == "tc"
    assert failed.value.stderr and failed.value.stderr in str(failed.value)

    # A tc failure halfway through add_island removes that island's namespace (and with it its link).
    monkeypatch.setattr(netns, "burst_bytes", lambda rate_mbit: 0)
    with pytest.raises(NetworkLabError, match="burst"):
        lab.add_island("broken", 10)
    assert "broken" not in lab.islands
    assert f"{lab.lab_id}-broken" not in netns.list_namespaces()
    # isl0 goes with the deleted island, isl1 with "broken": the kernel tears a namespace down in the
    # background after `ip netns delete`, so wait for it (the hang guard only bounds the wait).
    deadline = time.monotonic() + HANG_GUARD_S
    while (links := hub_links(lab)) != {"lo"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert links == {"lo"}


def hub_links(lab: NetworkLab) -> set[str]:
    shown = subprocess.run(["ip", "-n", lab.hub, "-j", "link"], capture_output=True, check=True).stdout
    return {link["ifname"] for link in json.loads(shown)}
