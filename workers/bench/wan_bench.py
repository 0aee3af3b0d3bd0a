"""`sprawl bench sync --wan`: a version's trip from the trainer's cluster to islands on other networks, over
real links: a network lab (`infra/netns.py`) whose hub runs the stack and the trainer side
(`workers/bench/wan_hub.py`, a process inside the hub namespace), and islands in namespaces of their own
behind tbf-shaped links of 1000 and 100 Mbit/s, each joined by its own sampler token over TLS.

Per link, the patch path (one keyframe, then patches) and the keyframe path (every version a keyframe):
- `patch_p50_s`, `keyframe_p50_s`: median of (island serves the version - its event was appended);
- `propagation_vs_wire`: append -> every island of the link serving, over the patch's bytes / link rate
  (median over patch versions; goal <= 2.0: the link, not the software, is the cost).
Then the same patch run on the 1000 Mbit/s link against an open stack (no TLS, no identities), whose
ratio is `tls_overhead` (goal <= 1.1); `verify_s` is the median cost of an island's trust checks for one
version (signature and digests, see wan_hub.py); `verified` holds when every island's served root hash was
the signed one for every version. tbf has no propagation delay (this kernel has no netem): the links are
bandwidth only, so a real long-haul link adds its round trips to every figure here.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.netns import Island, NetworkLab, lab_unavailable
from pipeline.errors import SprawlError
from workers.bench.island_proc import JOIN_TOKEN_VARIABLE
from workers.bench.sync_bench import IslandProcess, wait_all

LINKS_MBIT = (1000.0, 100.0)
TLS_LINK_MBIT = 1000.0
"""The faster link: where the software's own costs, TLS included, weigh the most against the wire."""
ANSWER_TIMEOUT_S = 900.0
"""A hang guard on every answer of the hub (stack start, model build, a keyframe over a slow link)."""


def _env() -> dict[str, str]:
    """Ours without `SPRAWL_...`, able to import this checkout, on one thread per process (two cores)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPRAWL_")}
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class _HubProcess:
    """`workers.bench.wan_hub` inside the hub namespace: one JSON command in, one JSON answer out."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr: Path):
        self.proc, self.stderr = proc, stderr

    @classmethod
    async def start(cls, lab: NetworkLab, *, secure: bool, quick: bool, tmp: Path) -> tuple[_HubProcess, dict]:
        addrs = ",".join(island.hub_addr for island in lab.islands.values())
        argv = [sys.executable, "-m", "workers.bench.wan_hub", "--hub-addrs", addrs]
        argv += [*(["--quick"] if quick else []), *([] if secure else ["--insecure"])]
        stderr = tmp / f"hub-{'secure' if secure else 'open'}.log"
        with stderr.open("w") as err:
            proc = await asyncio.create_subprocess_exec(
                *lab.argv_in(lab.hub, argv), env=_env(), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err,
            )  # fmt: skip
        hub = cls(proc, stderr)
        return hub, await hub._answer()

    async def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._answer()

    async def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), ANSWER_TIMEOUT_S)
            if not line:
                tail = self.stderr.read_text()[-3000:]
                raise SprawlError(f"the hub's benchmark process ended without an answer: {tail}")
            if line.startswith(b"{"):
                return json.loads(line)

    async def stop(self) -> None:
        """End of input: the hub stops its stack and exits."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 120)
        except TimeoutError:
            self.proc.terminate()
            await self.proc.wait()


@dataclass
class _Link:
    rate_mbit: float
    islands: list[Island]


async def _start_islands(lab: NetworkLab, link: _Link, joins: list[dict], run_id: str, tmp: Path):
    processes = []
    for island, join in zip(link.islands, joins, strict=True):
        home = tmp / run_id / island.name
        env = _env() | {
            "SPRAWL_STATE_DIR": str(home / "state"),
            "SPRAWL_ISLAND__ISLAND_ID": island.name,
            "SPRAWL_ISLAND__POLL_INTERVAL_S": "5",
            "SPRAWL_ISLAND__MATERIALIZE__CACHE_DIR": str(home / "cache"),
        }
        env |= {JOIN_TOKEN_VARIABLE: join["token"]} if "token" in join else join
        argv = lab.argv_in(island, [sys.executable, "-m", "workers.bench.island_proc"])
        home.mkdir(parents=True, exist_ok=True)
        with (home / "island.log").open("w") as log:
            proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=log)
        processes.append(IslandProcess(proc, home / "island.log"))
    for island in processes:
        await island.wait_ready(ANSWER_TIMEOUT_S)
    return processes


async def _one_run(
    lab: NetworkLab, hub: _HubProcess, link: _Link, path: str, versions: int, tmp: Path, label: str
) -> dict[str, Any]:
    run_id = f"wan-{label}-{int(link.rate_mbit)}-{path}"
    hub_addrs = [island.hub_addr for island in link.islands]
    v0 = await hub.ask({"op": "run", "run_id": run_id, "path": path, "hub_addrs": hub_addrs})
    islands = await _start_islands(lab, link, v0.pop("joins"), run_id, tmp)
    latencies, all_serving, over_wire, verify_s, sizes = [], [], [], [], []
    try:
        await wait_all(islands, 0, timeout_s=ANSWER_TIMEOUT_S)
        verified = all(i.commits[0]["root_hash"] == v0["root_hash"] for i in islands)
        for version in range(1, versions + 1):
            published = await hub.ask({"op": "publish", "version": version})
            await wait_all(islands, version, timeout_s=ANSWER_TIMEOUT_S)
            served = [i.commits[version] for i in islands]
            verified &= all(record["root_hash"] == published["root_hash"] for record in served)
            latencies += [record["committed_at"] - published["appended"] for record in served]
            everyone = max(record["committed_at"] for record in served) - published["appended"]
            wire_s = published["bytes"] * 8 / (link.rate_mbit * 1e6)
            all_serving.append(everyone)
            over_wire.append(everyone / wire_s)
            verify_s.append((await hub.ask({"op": "verify"}))["verify_s"])
            sizes.append(published["bytes"])
    finally:
        for island in islands:
            await island.stop()
        await hub.ask({"op": "end"})
    return {
        "stack": label,
        "link_mbit": int(link.rate_mbit),
        "path": path,
        "islands": len(islands),
        "p50_s": statistics.median(latencies),
        "all_serving_p50_s": statistics.median(all_serving),
        "bytes_per_version": int(statistics.median(sizes)),
        "propagation_vs_wire": statistics.median(over_wire),
        "verify_s": statistics.median(verify_s),
        "verified": verified,
    }


def _summary(rows: list[dict], quick: bool, versions: int, per_link: int) -> dict[str, Any]:
    def row(stack: str, link: int, path: str) -> dict:
        return next(r for r in rows if r["stack"] == stack and r["link_mbit"] == link and r["path"] == path)

    links = {}
    for rate in LINKS_MBIT:
        patch, keyframe = row("tls", int(rate), "patch"), row("tls", int(rate), "keyframe")
        links[str(int(rate))] = {
            "patch_p50_s": round(patch["p50_s"], 4),
            "keyframe_p50_s": round(keyframe["p50_s"], 4),
            "patch_vs_keyframe": round(patch["p50_s"] / keyframe["p50_s"], 4),
            "propagation_vs_wire": round(patch["propagation_vs_wire"], 3),
            "patch_bytes": patch["bytes_per_version"],
            "keyframe_bytes": keyframe["bytes_per_version"],
            "patch_wire_s": round(patch["bytes_per_version"] * 8 / (rate * 1e6), 5),
        }
    secure, open_ = row("tls", int(TLS_LINK_MBIT), "patch"), row("open", int(TLS_LINK_MBIT), "patch")
    return {
        "quick": quick,
        "versions_per_run": versions,
        "islands_per_link": per_link,
        "links": links,
        "tls_overhead": round(secure["p50_s"] / open_["p50_s"], 4),
        "tls_link_mbit": int(TLS_LINK_MBIT),
        "verify_s": round(statistics.median(r["verify_s"] for r in rows), 5),
        "verified": all(r["verified"] for r in rows),
    }


async def _measure(lab: NetworkLab, quick: bool, tmp: Path) -> tuple[list[dict], dict]:
    per_link = 1 if quick else 2
    versions = 3 if quick else 6
    links = [_Link(rate, [lab.add_island(f"l{int(rate)}-{i}", rate) for i in range(per_link)]) for rate in LINKS_MBIT]
    rows = []
    for secure in (True, False):
        hub, _ready = await _HubProcess.start(lab, secure=secure, quick=quick, tmp=tmp)
        try:
            for link in links:
                if not secure and link.rate_mbit != TLS_LINK_MBIT:
                    continue  # the open stack only for the TLS comparison
                for path in ("patch", "keyframe") if secure else ("patch",):
                    rows.append(await _one_run(lab, hub, link, path, versions, tmp, "tls" if secure else "open"))
        finally:
            await hub.stop()
    table = [
        {**r, **{k: f"{r[k]:.4f}" for k in ("p50_s", "all_serving_p50_s", "propagation_vs_wire", "verify_s")}}
        for r in rows
    ]
    return table, _summary(rows, quick, versions, per_link)


def bench_sync_wan(quick: bool) -> tuple[list[dict], dict]:
    reason = lab_unavailable()
    if reason:
        raise SprawlError(f"`sprawl bench sync --wan` needs a network lab: {reason}", hint="run it as root")
    with tempfile.TemporaryDirectory(prefix="sprawl-wan-") as tmp, NetworkLab() as lab:
        return asyncio.run(_measure(lab, quick, Path(tmp)))
