"""The fault suite's harness: a small real run under fire, and the invariants checked after each fault.

- `fleet.py`: a private stack and the run's workers as `sprawl` processes under `up`'s supervisor,
  plus a prompt driver that records every append it got an ack for.
- `faults.py`: the faults (SIGKILL of each worker type, nats-server killed and restarted from its
  store, a nats outage, SeaweedFS stopped, a corrupted patch blob), each returning when it ended.
- `ledger.py`: what the log, the archive and the lineage blobs hold, read independently of the workers.
- `invariants.py`: lost and duplicated events, archive vs log, islands' served bits, recovery time.
- `bad_events.py`: each bad-event class published as a hostile client would, and where it ended.
- `matrix.py`: one fault (or the bad events) on a fresh run, measured; `sprawl bench faults` and
  `tests/faults/` both run it.
"""
