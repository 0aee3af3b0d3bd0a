import os
import time

import pytest
from pydantic import SecretStr

from infra.s3_identities import Role, add_token_identity, revoke_token_identity
from pipeline.blobstore import LocalBlobStore, S3BlobStore, capped, checksum_of
from pipeline.blobstore.s3 import BlobPermissionRefused
from pipeline.config import LocalBlobSettings
from pipeline.errors import (
    BlobAccessDenied,
    BlobIntegrityError,
    BlobNotFound,
    BlobTooLarge,
    BucketNotFound,
    TransientError,
)
from tests.servers import HANG_GUARD_S

pytestmark = pytest.mark.integration


@pytest.fixture
def blobs(settings) -> S3BlobStore:
    return S3BlobStore(settings.blobs)


def test_content_addressed_put_round_trips_and_verifies(blobs, settings):
    data = os.urandom(100_000)
    ref = blobs.put_bytes(data, prefix=f"t/{settings.run_id}")
    assert ref.checksum == checksum_of(data)
    assert ref.uri.endswith(ref.checksum)
    assert blobs.get_bytes(ref.uri) == data
    assert blobs.get_bytes(ref.uri, expected=ref.checksum) == data
    assert blobs.exists(ref.uri)


def test_put_at_key_with_xxh3(blobs, settings, tmp_path):
    data = b"x" * 1000
    ref = blobs.put_bytes(data, key=f"t/{settings.run_id}/named", algorithm="xxh3_128")
    assert ref.algorithm == "xxh3_128" and len(ref.checksum) == 32
    out = blobs.get_to_file(ref.uri, tmp_path / "named")
    assert (tmp_path / "named").read_bytes() == data
    assert out.checksum == ref.checksum


def test_multipart_upload_above_threshold(settings, tmp_path):
    store = S3BlobStore(
        settings.blobs.model_copy(
            update={"multipart_threshold_bytes": 5 * 1024 * 1024, "multipart_chunk_bytes": 5 * 1024 * 1024}
        )
    )
    data = os.urandom(12 * 1024 * 1024 + 17)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    ref = store.put_file(path, key=f"t/{settings.run_id}/big")
    head = store.client.head_object(Bucket=store.bucket, Key=f"t/{settings.run_id}/big")
    assert "-" in head["ETag"], "a multipart upload has a composite ETag"
    assert store.get_bytes(ref.uri) == data


def test_tampered_blob_is_detected_and_no_partial_file_is_left(blobs, settings, tmp_path):
    ref = blobs.put_bytes(b"the real bytes", key=f"t/{settings.run_id}/tamper")
    # Someone overwrites the object but keeps our metadata (the recorded checksum).
    blobs.client.put_object(
        Bucket=blobs.bucket,
        Key=f"t/{settings.run_id}/tamper",
        Body=b"the fake bytes",
        Metadata={"sprawl-sha256": ref.checksum},
    )
    with pytest.raises(BlobIntegrityError, match="failed verification"):
        blobs.get_bytes(ref.uri)
    with pytest.raises(BlobIntegrityError):
        blobs.get_to_file(ref.uri, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_missing_key_bucket_and_bad_credentials_are_typed(blobs, settings):
    with pytest.raises(BlobNotFound, match="does not exist"):
        blobs.get_bytes(blobs.uri("no/such/key"))
    assert not blobs.exists(blobs.uri("no/such/key"))
    with pytest.raises(BucketNotFound, match="no-such-bucket"):
        S3BlobStore(settings.blobs.model_copy(update={"bucket": "no-such-bucket"})).put_bytes(b"x")
    bad = S3BlobStore(settings.blobs.model_copy(update={"secret_access_key": SecretStr("wrong"), "max_attempts": 1}))
    with pytest.raises(BlobAccessDenied, match="SPRAWL_BLOBS__SECRET_ACCESS_KEY"):
        bad.get_bytes(blobs.uri("anything"))


def test_list_keys_under_a_prefix(blobs, settings):
    for i in range(3):
        blobs.put_bytes(bytes([i]), key=f"t/{settings.run_id}/list/{i}")
    assert blobs.list_keys(f"t/{settings.run_id}/list/") == [f"t/{settings.run_id}/list/{i}" for i in range(3)]


def test_local_backend_verifies_too(tmp_path):
    store = LocalBlobStore(LocalBlobSettings(root=tmp_path / "bucket"))
    ref = store.put_bytes(b"local bytes")
    assert store.get_bytes(ref.uri) == b"local bytes"
    path = tmp_path / "bucket" / ref.uri.split("/bucket/", 1)[1]
    path.write_bytes(b"LOCAL bytes")
    with pytest.raises(BlobIntegrityError):
        store.get_bytes(ref.uri)
    with pytest.raises(BlobNotFound):
        store.get_bytes("nothing/here")


def test_a_refused_operation_names_key_and_operation_and_is_asked_once(blobs, settings):
    """A 403 is the server's answer for this key, not an outage: one request however many attempts the
    settings allow, typed as a refusal (never transient, never "absent"), saying who was refused what."""
    token_id = settings.run_id
    reader = add_token_identity(settings.blobs, Role.SAMPLER, settings.run_id, token_id)
    try:
        store = S3BlobStore(reader.applied_to(settings.blobs).model_copy(update={"max_attempts": 5}))
        _until_accepted(store, store.uri(f"runs/{settings.run_id}/policy/none"))
        requests: list[str] = []
        store.client.meta.events.register("before-send.s3.*", lambda request, **_: requests.append(request.method))
        target = f"runs/{settings.run_id}/policy/v1/blob"  # samplers read version blobs, never write them
        with pytest.raises(BlobAccessDenied) as refused:
            store.put_bytes(b"forged", key=target)
        assert isinstance(refused.value, BlobPermissionRefused) and not isinstance(refused.value, TransientError)
        assert requests == ["PUT"]
        message = str(refused.value)
        assert f"PutObject on {blobs.uri(target)} to access key {reader.access_key_id} (AccessDenied)" in message
        assert "role" in refused.value.hint
        with pytest.raises(BlobPermissionRefused, match="HeadObject"):
            store.exists(blobs.uri(f"claims/{settings.run_id}/traj/x"))  # not one it reads: refused, not "absent"
    finally:
        revoke_token_identity(settings.blobs, token_id)


def _until_accepted(store: S3BlobStore, readable_uri: str) -> None:
    """Poll until a new identity's key is in force (SeaweedFS applies it at once; other servers may lag)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            store.exists(readable_uri)
            return
        except BlobAccessDenied:
            assert time.monotonic() < deadline, "the new key was never accepted"
            time.sleep(0.05)


def test_a_blob_larger_than_its_pointer_says_is_refused_and_leaves_no_file(blobs, settings, tmp_path):
    key = f"t/{settings.run_id}/swapped"
    ref = blobs.put_bytes(b"the real bytes", key=key)
    # Swapped for a far larger object that keeps our metadata: refused by size, before its checksum.
    blobs.client.put_object(
        Bucket=blobs.bucket, Key=key, Body=os.urandom(3 << 20), Metadata={"sprawl-sha256": ref.checksum}
    )
    with pytest.raises(BlobTooLarge, match=f"more than the {ref.bytes} bytes"):
        blobs.get_bytes(ref.uri, expected=ref.checksum, max_bytes=ref.bytes)
    with pytest.raises(BlobTooLarge):
        blobs.get_to_file(ref.uri, tmp_path / "out", expected=ref.checksum, max_bytes=ref.bytes)
    assert list(tmp_path.iterdir()) == []
    blobs.put_bytes(b"the real bytes", key=key)
    assert blobs.get_bytes(ref.uri, max_bytes=ref.bytes) == b"the real bytes"  # exactly the size: read


def test_the_cap_stops_reading_at_the_first_chunk_past_it():
    pulled = []

    def chunks():
        for n in range(1000):
            pulled.append(n)
            yield b"x" * 100

    with pytest.raises(BlobTooLarge):
        b"".join(capped("s3://b/k", chunks(), 250))
    assert pulled == [0, 1, 2]  # not the other 997 chunks
    assert b"".join(capped("s3://b/k", iter([b"ab", b"c"]), None)) == b"abc"
