"""Helpers for version-chain tests: a publisher over a tiny model, what each version must be, and
blobs corrupted in the store the way a bad disk or a stray hand would.

Versions are signed as in production: the helpers' publisher signs with `TEST_SIGNING_KEY`, islands
and materializers pin its public key (`TEST_TRUST`), and trainers get it from `signed_trust()`."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.bits import checksum, dtype_name, root_hash, to_bits
from pipeline.blobstore import S3BlobStore
from pipeline.chain_publish import ChainPublisher
from pipeline.config import ChainSettings, MaterializeSettings, TrustSettings
from pipeline.eventlog import EventLog
from pipeline.materialize import Materializer
from pipeline.version_signing import VersionTrust, generate_signing_key, public_key_text, save_signing_key
from pipeline.views import get_view

TEST_SIGNING_KEY = generate_signing_key()
"""The trainer's key in tests (one per test process)."""
TEST_TRUST = VersionTrust(TEST_SIGNING_KEY.public_key())
"""What a test island pins: versions signed by `TEST_SIGNING_KEY`."""


@functools.cache
def signed_trust() -> TrustSettings:
    """Trust settings naming the test key: a trainer signs with it, an island pins its public half."""
    directory = Path(tempfile.mkdtemp(prefix="sprawl-test-key-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    save_signing_key(TEST_SIGNING_KEY, directory / "version-signing.pem")
    return TrustSettings(
        signing_key_file=directory / "version-signing.pem", version_public_key=public_key_text(TEST_SIGNING_KEY)
    )


def expected_root(state_dict: dict[str, torch.Tensor], view: str) -> str:
    tensors = get_view(view).compute(state_dict)
    return root_hash([(n, dtype_name(t.dtype), tuple(t.shape), checksum(to_bits(t))) for n, t in tensors.items()])


def corrupt_object(blobs: S3BlobStore, uri: str) -> bytes:
    """Flip one byte of a stored object in place (its metadata kept, so only the sha256 of its bytes
    can tell); returns the original bytes, for a test that re-publishes them."""
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    head = blobs.client.head_object(Bucket=bucket, Key=key)
    original = blobs.client.get_object(Bucket=bucket, Key=key)["Body"].read()
    body = bytearray(original)
    body[len(body) // 2] ^= 0xFF
    blobs.client.put_object(Bucket=bucket, Key=key, Body=bytes(body), Metadata=head["Metadata"])
    return original


def enlarge_object(blobs: S3BlobStore, uri: str) -> bytes:
    """Replace a stored object with itself followed by 4 MiB of zeros (its metadata kept): a swapped blob
    far larger than its pointer says. Returns the original bytes."""
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    head = blobs.client.head_object(Bucket=bucket, Key=key)
    original = blobs.client.get_object(Bucket=bucket, Key=key)["Body"].read()
    blobs.client.put_object(Bucket=bucket, Key=key, Body=original + bytes(4 << 20), Metadata=head["Metadata"])
    return original


def republish_object(blobs: S3BlobStore, uri: str, data: bytes) -> None:
    """Write an object's right bytes back under its key, as an operator repairing the store would."""
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    head = blobs.client.head_object(Bucket=bucket, Key=key)
    blobs.client.put_object(Bucket=bucket, Key=key, Body=data, Metadata=head["Metadata"])


def patch_key(target: int, base: int) -> Callable[[str], bool]:
    """Matches the keys of the patch (or skip patch) base -> target of the first shard, whatever the view
    (one corrupted shard is enough to make the whole patch unusable)."""
    return lambda key: f"/v{target:08d}-" in key and f"/patch-from-v{base}/model-00001-of-" in key


class CorruptingBlobStore(S3BlobStore):
    """An S3 store that corrupts chosen blobs right after they are written and verified, before the
    publisher appends the event naming them: a follower never gets a chance to see them intact."""

    def __init__(self, settings, corrupt: Callable[[str], bool], tamper=corrupt_object):
        super().__init__(settings)
        self.corrupt, self.tamper = corrupt, tamper
        self.corrupted: dict[str, bytes] = {}
        """uri -> the original bytes, for each blob corrupted."""

    def put_bytes(self, data: bytes, key: str | None = None, **kw):
        ref = super().put_bytes(data, key, **kw)
        if key is not None and self.corrupt(key):
            self.corrupted[ref.uri] = self.tamper(self, ref.uri)
        return ref


def publisher(
    event_log: EventLog, settings, model, *, blobs: S3BlobStore | None = None, signing_key=TEST_SIGNING_KEY, **chain
) -> ChainPublisher:
    """A publisher that signs with `signing_key` (None: unsigned)."""
    return ChainPublisher(
        event_log,
        blobs or S3BlobStore(settings.blobs),
        run_id=settings.run_id,
        model_config=model.config.to_dict(),
        settings=ChainSettings(**chain),
        extra_files={"generation_config.json": b"{}"},
        signing_key=signing_key,
    )


def materializer(
    event_log: EventLog, settings, cache_dir, view: str = "bf16", trust: VersionTrust | None = TEST_TRUST, **kw
) -> Materializer:
    return Materializer(
        event_log,
        S3BlobStore(settings.blobs),
        run_id=settings.run_id,
        view=view,
        settings=MaterializeSettings(cache_dir=cache_dir, **kw),
        trust=trust,
    )


def reference_island(event_log, settings, section):
    """An island on the reference engine that pins the test key (`TEST_TRUST`), for `settings`' run."""
    from pipeline.blobstore import S3BlobStore
    from workers.sampler.engines.reference import ReferenceEngine
    from workers.sampler.island import Island

    return Island(
        event_log,
        S3BlobStore(settings.blobs),
        ReferenceEngine(),
        run_id=settings.run_id,
        settings=section,
        trust=TEST_TRUST,
    )
