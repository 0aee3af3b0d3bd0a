"""Islands anywhere, across real network boundaries on one machine: the cluster side (`sprawl up
--no-local-islands`: a secure stack, trainer, rewards, archiver, prompt driver) runs in the hub namespace of
a network lab; islands run in namespaces of their own behind tbf-shaped 100 Mbit/s links and join with
nothing but a token (`sprawl token create` in the hub, `sprawl sampler --join TOKEN` on the island).

What is checked: the run completes; every island's served version re-hashes, file by file, to the root
hash in the version event, and that event's signature verifies against the key the token pinned; an
island that joins mid-run starts from the nearest keyframe, not from a chain out of v0; a revoked token's
island is cut off and cannot come back.

The islands' view of the run is what they write on their side: their version cache and their JSON logs.
The log itself is reachable only from inside the hub, so the version events are read there, by this module
run as a helper process (`python -m tests.test_islands_anywhere STATE_DIR VERSION...`, admin credentials of
the hub's stack), and checked here.

Needs root (namespaces); skips with the reason elsewhere. About a minute on two cores (seven small versions:
the demo task at its smallest), so it runs in the default suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra import netns
from infra.netns import Island, NetworkLab

HANG_GUARD_S = 900.0
"""Only against a hang (tests/servers.py's bound): every wait below ends on an event long before it."""

LINK_MBIT = 100.0
KEYFRAME_EVERY = 3
"""Small, so that an island joining after a few versions has a keyframe other than v0 to start from."""

SMALL_RUN = {
    # The demo task at its smallest: a short warm-up, small updates, a short prompt window.
    "SPRAWL_TASK__DIGITS": "1",
    "SPRAWL_TASK__WARMUP_STEPS": "30",
    "SPRAWL_TASK__WARMUP_BATCH": "16",
    "SPRAWL_TRAINER__GROUPS_PER_BATCH": "2",
    "SPRAWL_TRAINER__GROUP_SIZE": "4",
    "SPRAWL_PROMPTS__GROUPS_AHEAD": "2",
    "SPRAWL_CHAIN__KEYFRAME_EVERY": str(KEYFRAME_EVERY),
}


@pytest.fixture
def lab() -> Iterator[NetworkLab]:
    reason = netns.lab_unavailable()
    if reason:
        pytest.skip(f"no network lab here: {reason}")
    with NetworkLab(stop_grace_s=2.0) as lab:
        yield lab


def _clean_env() -> dict[str, str]:
    """Ours without `SPRAWL_...`: each process below is configured by its own flags and variables only."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait_for(condition: Callable[[], object], what: str, *alive: subprocess.Popen) -> object:
    """Until `condition()` is truthy (returned); a process in `alive` exiting first fails the test."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not (result := condition()):
        for process in alive:
            assert process.poll() is None, f"{what}: {process.args[4:7]} exited {process.returncode} first"
        assert time.monotonic() < deadline, f"{what}: not within the hang guard ({HANG_GUARD_S:g}s)"
        time.sleep(0.2)
    return result


@dataclass
class Hub:
    """`sprawl up --no-local-islands` in the hub namespace, and what the hub's `sprawl` commands need."""

    lab: NetworkLab
    state_dir: Path
    up: subprocess.Popen
    up_stderr: Path

    def sprawl(self, *args: str) -> subprocess.CompletedProcess:
        """`sprawl ARGS` inside the hub, on the hub's state folder (its stack, its run, its keys)."""
        argv = self.lab.argv_in(self.lab.hub, [sys.executable, "-m", "workers.cli", *args])
        argv += ["--state-dir", str(self.state_dir)]
        return subprocess.run(argv, env=_clean_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)

    def stack_ports(self) -> tuple[int, int]:
        """(NATS port, S3 port) of the stack `up` started; islands use the hub's address with them."""
        recorded = json.loads((self.state_dir / "stack" / "stack.json").read_text())
        return int(recorded["nats_url"].rsplit(":", 1)[1]), int(recorded["s3_endpoint"].rsplit(":", 1)[1])

    def token(self, island: Island) -> tuple[str, str]:
        """(token text, token id) for a sampler on `island`, pointed at the hub's end of its link."""
        nats_port, s3_port = self.stack_ports()
        created = self.sprawl(
            "token", "create", "--role", "sampler", "--ttl", "1h",
            "--nats-url", f"tls://{island.hub_addr}:{nats_port}",
            "--s3-endpoint", f"https://{island.hub_addr}:{s3_port}",
        )  # fmt: skip
        assert created.returncode == 0, created.stderr[-3000:]
        text = created.stdout.strip().splitlines()[-1]
        from infra.join_token import decode

        return text, decode(text).token_id

    def summary(self) -> dict:
        """`up`'s JSON summary, once the run has ended (the stack stays up after it, for the checks)."""
        stdout, _ = self.up.communicate(timeout=HANG_GUARD_S)
        assert self.up.returncode == 0, self.up_stderr.read_text()[-4000:]
        return json.loads(stdout.strip().splitlines()[-1])

    def version_events(self, versions: list[int]) -> dict[int, object]:
        """The run's version events, read inside the hub with the stack's admin credentials."""
        import msgspec

        from schemas import PolicyVersion

        argv = [sys.executable, "-m", "tests.test_islands_anywhere", str(self.state_dir), *map(str, versions)]
        done = subprocess.run(
            self.lab.argv_in(self.lab.hub, argv), env=_clean_env(), capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        assert done.returncode == 0, done.stderr[-3000:]
        events = [msgspec.json.decode(line, type=PolicyVersion) for line in done.stdout.splitlines() if line.strip()]
        return {event.version: event for event in events}


def start_hub(lab: NetworkLab, tmp_path: Path, versions: int) -> Hub:
    state_dir = tmp_path / "hub"
    hub_addrs = [island.hub_addr for island in lab.islands.values()]
    env = _clean_env() | SMALL_RUN
    env |= {
        # Listen on every address of the hub (its end of each island's link), with certificates naming them.
        "SPRAWL_STACK__BIND_HOST": "0.0.0.0",
        "SPRAWL_STACK__ADVERTISE_HOSTS": json.dumps(hub_addrs),
        "SPRAWL_STACK__NATS_PORT": "0",
        "SPRAWL_STACK__NATS_MONITOR_PORT": "0",
        "SPRAWL_STACK__S3_PORT": "0",
        "SPRAWL_STACK__SEAWEED_PORT_BASE": "0",
    }
    options = ["--no-local-islands", "--versions", str(versions), "--fresh", "--json", "--no-live"]
    stderr = tmp_path / "up.stderr"
    argv = [sys.executable, "-m", "workers.cli", "up", *options, "--state-dir", str(state_dir)]
    with stderr.open("w") as err:
        up = lab.spawn_in(lab.hub, argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    hub = Hub(lab, state_dir, up, stderr)
    # Tokens need the stack, the run's id and the trainer's key: `up` makes the key just before its workers.
    needed = [state_dir / "stack" / "stack.json", state_dir / "current_run", state_dir / "keys"]
    _wait_for(lambda: all(p.exists() for p in needed), "the hub's stack, run and key", up)
    _wait_for(lambda: any((state_dir / "keys").iterdir()), "the trainer's version key", up)
    return hub


@dataclass
class JoinedIsland:
    """A `sprawl sampler --join TOKEN` process on an island, and what it leaves on its side."""

    island: Island
    view: str
    token: str
    token_id: str
    process: subprocess.Popen
    argv: list[str]
    env: dict[str, str]
    cache: Path
    log_file: Path
    run_id: str

    def serving(self) -> list[dict]:
        """The island's "serving version" log records so far (version, route), in order."""
        records = []
        for line in self.log_file.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "serving version":
                records.append(record)
        return records

    def cached(self) -> list[Path]:
        """The versions materialized in the island's cache, oldest first."""
        return sorted((self.cache / self.run_id / self.view).glob("v*/sprawl-version.json"))

    def newest_served(self) -> int | None:
        records = self.serving()
        return max(r["version"] for r in records) if records else None


def join(lab: NetworkLab, hub: Hub, island: Island, view: str, tmp_path: Path) -> JoinedIsland:
    from workers.up.demo_task import VOCAB_SIZE

    text, token_id = hub.token(island)
    home = tmp_path / island.name
    home.mkdir()
    # As the README has it: the token in a file (on a command line `ps` would show it), the view a flag.
    token_file = home / "island.token"
    token_file.write_text(text)
    token_file.chmod(0o600)
    env = _clean_env() | {
        "SPRAWL_LOG_FORMAT": "json",
        "SPRAWL_LOG_LEVEL": "INFO",
        "SPRAWL_HEARTBEAT_INTERVAL_S": "2",
        "SPRAWL_ISLAND__ISLAND_ID": f"{island.name}-{view.split('_')[0]}",
        "SPRAWL_ISLAND__TOP_LOGPROBS": str(VOCAB_SIZE),
        "SPRAWL_ISLAND__POLL_INTERVAL_S": "1",
        "SPRAWL_ISLAND__MATERIALIZE__CACHE_DIR": str(home / "cache"),
    }
    argv = [sys.executable, "-m", "workers.cli", "sampler", "--join", f"@{token_file}", "--island.view", view]
    argv += ["--state-dir", str(home / "state")]
    log_file = home / "sampler.log"
    with log_file.open("w") as out:
        process = lab.spawn_in(island, argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    run_id = (hub.state_dir / "current_run").read_text().strip()
    return JoinedIsland(island, view, text, token_id, process, argv, env, home / "cache", log_file, run_id)


def check_served_versions(hub: Hub, islands: list[JoinedIsland], target: int) -> None:
    """Each island serves the run's last version; the folder it serves re-hashes to the signed root hash,
    and the signature verifies against the key the island's token pinned."""
    from infra.join_token import decode
    from pipeline.materialize import verify_directory
    from pipeline.version_signing import load_public_key, verify_version

    for joined in islands:
        _wait_for(lambda j=joined: (j.newest_served() or -1) >= target, f"{joined.island.name} serves v{target}")
    events = hub.version_events(list(range(target + 1)))
    assert sorted(events) == list(range(target + 1))
    for joined in islands:
        served = joined.newest_served()
        folder = joined.cache / joined.run_id / joined.view / f"v{served:08d}"
        event = events[served]
        signed_root = {v.view: v.root_hash for v in event.views}[joined.view]
        assert verify_directory(folder) == signed_root, f"{joined.island.name} serves bits the trainer did not sign"
        pinned = decode(joined.token).version_public_key
        verify_version(event, load_public_key(pinned))  # raises unless the trainer's key signed this manifest


def check_revoked(lab: NetworkLab, hub: Hub, joined: JoinedIsland) -> None:
    """Revoking the island's token cuts it off: nats-server closes the island's connection at once, and
    the same token cannot connect again (a new sampler with it exits non-zero, saying why)."""
    seen = len(joined.log_file.read_text().splitlines())
    revoked = hub.sprawl("token", "revoke", joined.token_id)
    assert revoked.returncode == 0, revoked.stderr[-3000:]
    assert "revoked" in revoked.stdout
    listed = hub.sprawl("token", "list")
    line = next(line for line in listed.stdout.splitlines() if line.startswith(joined.token_id))
    assert line.split()[-1] == "revoked", line

    def cut_off() -> bool:
        """The process exited, or its log says the server closed its connection (nats-py does not reconnect
        a client the server refuses: every later call fails with ConnectionClosedError)."""
        after = joined.log_file.read_text().splitlines()[seen:]
        return joined.process.poll() is not None or any("ConnectionClosedError" in record for record in after)

    _wait_for(cut_off, f"{joined.island.name}'s connection to close after its token was revoked")
    again = subprocess.run(
        lab.argv_in(joined.island, joined.argv),  # the island's own command, again
        env=joined.env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert again.returncode != 0, again.stderr[-3000:]
    assert "authorization" in again.stderr.lower(), again.stderr[-3000:]


def stop_hub(hub: Hub) -> None:
    """The stack `up` left running (for SQL) is stopped by its recorded pids; the lab's close catches the rest."""
    from infra import stack
    from infra.stack import StackSettings

    if hub.up.poll() is None:
        hub.up.terminate()
        hub.up.wait(timeout=HANG_GUARD_S)
    stack.down(StackSettings(state_dir=hub.state_dir))


def test_a_mixed_fleet_joins_from_three_networks_and_a_late_island_starts_from_a_keyframe(
    lab: NetworkLab, tmp_path: Path
) -> None:
    versions = 7
    links = {name: lab.add_island(name, LINK_MBIT) for name in ("bf16", "fp8", "late")}
    hub = start_hub(lab, tmp_path, versions)
    try:
        fleet = [join(lab, hub, links["bf16"], "bf16", tmp_path), join(lab, hub, links["fp8"], "fp8_e4m3", tmp_path)]
        # The third island joins once the chain has a keyframe past v0 and a patch after it.
        _wait_for(lambda: (fleet[0].newest_served() or -1) > KEYFRAME_EVERY, "v4 on the first island", hub.up)
        late = join(lab, hub, links["late"], "bf16", tmp_path)
        summary = hub.summary()
        assert summary["versions"] == versions and summary["dead_letters"] == 0 and summary["interrupted"] is False
        check_served_versions(hub, [*fleet, late], versions)

        first_route = late.serving()[0]["route"]
        start = first_route.split(" -> ")[0]
        kind, version = start.split(":v")
        assert kind == "keyframe" and int(version) > 0 and int(version) % KEYFRAME_EVERY == 0, first_route
        check_revoked(lab, hub, fleet[1])
    finally:
        stop_hub(hub)


# ---------------------------------------------------------------- the helper that reads the log in the hub


async def _print_version_events(state_dir: Path, versions: list[int]) -> None:
    import msgspec

    from infra import stack
    from infra.stack import StackSettings
    from pipeline.eventlog import EventLog
    from pipeline.version_log import fetch_version

    run_id = (state_dir / "current_run").read_text().strip()
    settings = StackSettings(state_dir=state_dir, run_id=run_id)
    running = stack.status(settings)
    assert running is not None, f"no stack runs under {state_dir}"
    event_log = await EventLog.connect(stack.with_endpoints(settings, running), worker="test-islands-anywhere")
    try:
        for version in versions:
            event = await fetch_version(event_log, run_id, version)
            if event is not None:
                print(msgspec.json.encode(event).decode(), flush=True)
    finally:
        await event_log.close()


if __name__ == "__main__":
    asyncio.run(_print_version_events(Path(sys.argv[1]), [int(v) for v in sys.argv[2:]]))
