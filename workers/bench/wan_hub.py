"""The hub side of `sprawl bench sync --wan`, run inside the network lab's hub namespace (where the stack
must listen, so that islands reach it through their links): a private stack on every address of the hub,
the trainer's signing key, and the version chains the benchmark asks for, published as the trainer does
(`ChainPublisher`, signed, over the trainer's own identity on a secure stack).

Run: `python -m workers.bench.wan_hub --hub-addrs 10.201.1.1,10.201.2.1 [--insecure] [--quick]`. It speaks
JSON lines: one `{"ready": ...}` line once the stack is up, then one answer per command read on stdin:
- `{"op": "run", "run_id", "path": "patch"|"keyframe", "hub_addrs": [...]}`: declares the run's streams,
  publishes v0 and answers with how an island behind each given hub address joins (a sampler token on a
  secure stack; plain endpoints and the public key on an open one) and v0's figures;
- `{"op": "publish", "version": N}`: one more version (an Adam-sized step of every weight);
- `{"op": "verify"}`: `verify_s` of the last version (asked once the islands serve it, so that this work
  does not compete with theirs for the CPU);
- `{"op": "end"}`: the run's publisher closed.
End of input stops the stack. Times are `time.time()` (one clock: the namespaces share the machine).

`verify_s` per version is what an island's trust checks cost for it, measured here on the same bytes: the
Ed25519 signature over the manifest with the tensor digests re-hashed to the signed root
(`verify_version`), plus sha256 over every blob of the version's view (downloaded first, untimed).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from infra import stack
from infra.stack import StackSettings
from pipeline.blobstore import BlobStore, open_blob_store
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings
from pipeline.eventlog import EventLog
from pipeline.logs import configure_logging
from pipeline.version_signing import generate_signing_key, public_key_text, verify_version
from schemas import PolicyVersion
from workers.bench.private_stack import private_stack
from workers.bench.sync_bench import adam_sized_step, moe_state


def _say(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


@dataclass
class _Run:
    run_id: str
    event_log: EventLog
    blobs: BlobStore
    publisher: ChainPublisher
    state: dict[str, torch.Tensor]
    generator: torch.Generator
    last: PolicyVersion | None = None


class Hub:
    def __init__(self, settings: StackSettings, quick: bool):
        self.settings = settings
        self.quick = quick
        self.status = stack.status(settings)
        assert self.status is not None  # private_stack started it
        self.key = generate_signing_key()
        self.public_key = public_key_text(self.key)
        self.run: _Run | None = None

    def _ports(self) -> tuple[int, int]:
        return int(self.status.nats_url.rsplit(":", 1)[1]), int(self.status.s3_endpoint.rsplit(":", 1)[1])

    def _join(self, run_settings: StackSettings, hub_addr: str) -> dict[str, str]:
        """How an island behind `hub_addr` joins: a token (secure), or endpoints and the key to pin."""
        nats_port, s3_port = self._ports()
        if self.status.secure:
            from infra.join_token import create_token

            issued = create_token(
                run_settings,
                self.status,
                "sampler",
                ttl_s=3600,
                nats_urls=[f"tls://{hub_addr}:{nats_port}"],
                s3_endpoint=f"https://{hub_addr}:{s3_port}",
                version_public_key=self.public_key,
            )
            return {"token": issued.text}
        return {
            "SPRAWL_RUN_ID": run_settings.run_id,
            "SPRAWL_NATS__URL": f"nats://{hub_addr}:{nats_port}",
            "SPRAWL_BLOBS__ENDPOINT_URL": f"http://{hub_addr}:{s3_port}",
            "SPRAWL_TRUST__VERSION_PUBLIC_KEY": self.public_key,
        }

    async def start_run(self, admin_log: EventLog, run_id: str, path: str, hub_addrs: list[str]) -> dict[str, Any]:
        from infra.streams import apply

        run_settings = self.settings.model_copy(update={"run_id": run_id})
        await apply(admin_log.js, run_settings.streams, run_id)
        # The trainer's own identity (TLS, its grants) on a secure stack: what a real trainer publishes over.
        trainer = stack.with_endpoints(run_settings, self.status, "trainer") if self.status.secure else run_settings
        event_log = await EventLog.connect(trainer, worker="bench-wan-trainer")
        blobs = open_blob_store(trainer.blobs)
        model_config, state = moe_state(self.quick)
        publisher = ChainPublisher(
            event_log,
            blobs,
            run_id=run_id,
            model_config=model_config,
            # The keyframe path is the baseline: every version downloaded whole, so no keyframe ships a
            # patch from the version before (which followers would take instead).
            settings=ChainSettings(
                views=["bf16"],
                keyframe_every=1 if path == "keyframe" else 1_000_000,
                keyframe_patches=path != "keyframe",
            ),
            signing_key=self.key,
        )
        self.run = _Run(run_id, event_log, blobs, publisher, state, torch.Generator().manual_seed(1))
        joins = [self._join(run_settings, addr) for addr in hub_addrs]
        return {"run": run_id, "joins": joins, **await self.publish(0)}

    async def publish(self, version: int) -> dict[str, Any]:
        run = self.run
        assert run is not None, "publish before run"
        if version > 0:
            adam_sized_step(run.state, run.generator)
        event = await run.publisher.publish(version, run.state)
        appended = time.time()
        run.last = event
        view = event.views[0]
        return {"version": version, "appended": appended, "root_hash": view.root_hash, "bytes": view.bytes}

    async def verify(self) -> dict[str, Any]:
        assert self.run is not None and self.run.last is not None, "verify before publish"
        return {"verify_s": await asyncio.to_thread(self._verify_s, self.run, self.run.last)}

    def _verify_s(self, run: _Run, event: PolicyVersion) -> float:
        payloads = [(blob.sha256, run.blobs.get_bytes(blob.uri)) for blob in event.views[0].blobs]
        started = time.perf_counter()
        verify_version(event, self.key.public_key())
        for expected, data in payloads:
            assert hashlib.sha256(data).hexdigest() == expected
        return time.perf_counter() - started

    async def end_run(self) -> dict[str, Any]:
        run, self.run = self.run, None
        if run is not None:
            run.publisher.close()
            await run.event_log.close()
        return {"ended": run.run_id if run else None}


async def serve(settings: StackSettings, quick: bool) -> None:
    hub = Hub(settings, quick)
    admin_log = await EventLog.connect(settings, worker="bench-wan-hub")
    _say({"ready": True, "secure": hub.status.secure, "public_key": hub.public_key})
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            if command["op"] == "run":
                _say(await hub.start_run(admin_log, command["run_id"], command["path"], command["hub_addrs"]))
            elif command["op"] == "publish":
                _say(await hub.publish(int(command["version"])))
            elif command["op"] == "verify":
                _say(await hub.verify())
            elif command["op"] == "end":
                _say(await hub.end_run())
            else:
                raise ValueError(f"unknown command {command!r}")
    finally:
        await hub.end_run()
        await admin_log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hub-addrs", required=True, help="the hub's address on each island link, comma-separated")
    parser.add_argument("--insecure", action="store_true", help="a stack without TLS and identities")
    parser.add_argument("--quick", action="store_true", help="the small model")
    args = parser.parse_args()
    configure_logging("bench", fmt="json", level="WARNING")
    addrs = args.hub_addrs.split(",")
    with private_stack("wan", secure=not args.insecure, bind_host="0.0.0.0", advertise_hosts=addrs) as settings:
        asyncio.run(serve(settings, args.quick))


if __name__ == "__main__":
    main()
