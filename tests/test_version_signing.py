"""Signed policy versions: the manifest, the signature, and islands that refuse what the trainer's
key did not sign (or a blob that differs from its signed digest) while they keep serving."""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import time

import msgspec
import pytest
import torch
from cryptography.hazmat.primitives import serialization

from pipeline.audit import AUDITS, open_archive, query
from pipeline.bits import root_hash
from pipeline.config import MaterializeSettings, TrustSettings
from pipeline.materialize import verify_directory
from pipeline.replay import replay
from pipeline.topology import DEADLETTER
from pipeline.version_signing import (
    KeyUnreadable,
    TrustNotConfigured,
    VersionSignatureInvalid,
    ensure_signing_key,
    generate_signing_key,
    island_trust,
    key_id,
    load_public_key,
    public_key_text,
    sign_version,
    signed_bytes,
    trainer_signing_key,
    verify_version,
)
from schemas import BlobPointer, DeadLetter, PolicyVersion, SkipPatch, TensorDigest, ViewVersion, decode_event
from schemas.version_manifest import SIGNED_PREFIX
from tests.chain_helpers import TEST_TRUST, CorruptingBlobStore, expected_root, patch_key, publisher, reference_island
from tests.servers import HANG_GUARD_S
from tests.tiny_models import adam_like_step, tiny_moe
from workers.archiver import ArchiverSettings, ArchiveSection, drain_once
from workers.sampler.island import Island, IslandSection
from workers.sampler.settings import RouteRetrySection
from workers.sampler.sidecar import Sidecar

KEY = generate_signing_key()
OTHER = generate_signing_key()


def _blob(n: int, name: str = "model.safetensors") -> BlobPointer:
    return BlobPointer(uri=f"s3://b/runs/r/policy/v{n}/{name}", sha256=f"{n:064x}", bytes=100 + n, name=name)


def _event(version: int = 3) -> PolicyVersion:
    tensors = [
        TensorDigest(name="w", dtype="bfloat16", shape=[2, 2], xxh3="a" * 32, changed=1),
        TensorDigest(name="b", dtype="bfloat16", shape=[2], xxh3="b" * 32, changed=0),
    ]
    root = root_hash([(t.name, t.dtype, tuple(t.shape), t.xxh3) for t in tensors])
    view = ViewVersion(
        view="bf16",
        kind="patch",
        base_version=version - 1,
        blobs=[_blob(1)],
        tensors=tensors,
        root_hash=root,
        bytes=101,
        changed_elements=1,
        total_elements=6,
        skip_patches=[SkipPatch(base_version=version - 2, blobs=[_blob(2)], bytes=102, changed_elements=2)],
    )
    return PolicyVersion(
        run_id="r",
        version=version,
        parent_version=version - 1,
        trainer_step=version,
        views=[view],
        lineage_uri="s3://b/runs/r/lineage/v00000003.json",
        lineage_sha256="c" * 64,
    )


def _refusal(event: PolicyVersion, key=KEY) -> str:
    with pytest.raises(VersionSignatureInvalid) as refused:
        verify_version(event, key.public_key())
    return refused.value.reason


def _view(event: PolicyVersion, **changes) -> PolicyVersion:
    return msgspec.structs.replace(event, views=[msgspec.structs.replace(event.views[0], **changes)])


# ---------------------------------------------------------------- sign and verify


def test_a_signed_version_verifies_and_survives_the_log_encoding():
    signed = sign_version(_event(), KEY)
    verify_version(signed, KEY.public_key())
    from schemas import encode_event

    verify_version(decode_event(encode_event(signed)), KEY.public_key())  # what an island reads back
    assert signed.signature is not None and signed.signature.key_id == key_id(KEY) and len(key_id(KEY)) == 16
    assert len(signed.signature.signature) == 64


def test_the_signed_bytes_are_the_documented_prefix_and_compact_manifest():
    data = signed_bytes(_event())
    assert data.startswith(SIGNED_PREFIX) and SIGNED_PREFIX == b"sprawl.version-manifest.v1\n"
    body = data[len(SIGNED_PREFIX) :]
    assert body.startswith(b'{"format":"sprawl.version-manifest.v1","run_id":"r","version":3,"parent_version":2,')
    assert b" " not in body and b'"tensors"' not in body  # bound through the root hash, not listed
    assert b'"skip_patches":[{"base_version":1,"blobs":[{"uri":"s3://b/runs/r/policy/v2/' in body


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda e: _view(e, root_hash="0" * 32), id="root-hash"),
        pytest.param(lambda e: _view(e, blobs=[msgspec.structs.replace(_blob(1), sha256="f" * 64)]), id="blob-sha256"),
        pytest.param(lambda e: _view(e, blobs=[msgspec.structs.replace(_blob(1), uri="s3://evil/x")]), id="blob-uri"),
        pytest.param(lambda e: _view(e, blobs=[msgspec.structs.replace(_blob(1), bytes=1)]), id="blob-bytes"),
        pytest.param(
            lambda e: _view(e, skip_patches=[SkipPatch(base_version=1, blobs=[_blob(9)], bytes=1, changed_elements=1)]),
            id="skip-patch-blob",
        ),
        pytest.param(lambda e: msgspec.structs.replace(e, lineage_sha256="d" * 64), id="lineage-digest"),
        pytest.param(lambda e: msgspec.structs.replace(e, lineage_uri="s3://b/other.json"), id="lineage-uri"),
        pytest.param(lambda e: msgspec.structs.replace(e, version=4), id="version-number"),
        pytest.param(lambda e: msgspec.structs.replace(e, run_id="another-run"), id="run-id"),
        pytest.param(lambda e: msgspec.structs.replace(e, parent_version=0), id="parent-version"),
        pytest.param(lambda e: _view(e, kind="keyframe", base_version=None), id="view-kind"),
    ],
)
def test_any_tampered_manifest_field_fails_the_signature(tamper):
    forged = tamper(sign_version(_event(), KEY))
    assert _refusal(forged) == "signature does not match the manifest"


def test_tensor_digests_are_bound_through_the_root_hash():
    signed = sign_version(_event(), KEY)
    tensors = list(signed.views[0].tensors)
    tensors[0] = msgspec.structs.replace(tensors[0], xxh3="e" * 32)
    reason = _refusal(_view(signed, tensors=tensors))
    assert "tensor digests hash to" in reason and "the signed root is" in reason


def test_a_version_signed_by_another_key_names_both_keys():
    reason = _refusal(sign_version(_event(), OTHER))
    assert reason == f"signed by key {key_id(OTHER)}, pinned {key_id(KEY)}"


def test_another_key_claiming_the_pinned_key_id_fails_the_signature():
    forged = sign_version(_event(), OTHER)
    assert forged.signature is not None
    forged = msgspec.structs.replace(forged, signature=msgspec.structs.replace(forged.signature, key_id=key_id(KEY)))
    assert _refusal(forged) == "signature does not match the manifest"


def test_an_unsigned_version_is_refused_when_a_key_is_pinned():
    assert _refusal(_event()) == "unsigned"
    with pytest.raises(VersionSignatureInvalid, match="policy version 3 refused: unsigned"):
        TEST_TRUST.check(_event())


# ---------------------------------------------------------------- keys and settings


def test_public_keys_load_from_pem_and_from_base64_raw_bytes():
    raw = KEY.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    signed = sign_version(_event(), KEY)
    for text in (public_key_text(KEY), base64.b64encode(raw).decode()):
        verify_version(signed, load_public_key(text))
    for bad in ("not a key", base64.b64encode(b"short").decode(), public_key_text(KEY)[:40]):
        with pytest.raises(KeyUnreadable):
            load_public_key(bad)


def test_ensure_signing_key_creates_a_private_key_once(tmp_path):
    path = tmp_path / "keys" / "version-signing.pem"
    public = ensure_signing_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert public.startswith("-----BEGIN PUBLIC KEY-----")
    assert ensure_signing_key(path) == public  # never replaced: islands pinned to it keep working
    key = trainer_signing_key(TrustSettings(signing_key_file=path))
    assert key is not None and public_key_text(key) == public


def test_workers_without_a_key_refuse_to_start_unless_told_to_go_unsigned(tmp_path):
    with pytest.raises(TrustNotConfigured, match="SPRAWL_TRUST__VERSION_PUBLIC_KEY"):
        island_trust(TrustSettings())
    with pytest.raises(TrustNotConfigured, match="SPRAWL_TRUST__SIGNING_KEY_FILE"):
        trainer_signing_key(TrustSettings())
    assert island_trust(TrustSettings(allow_unsigned_versions=True)).public_key is None
    assert trainer_signing_key(TrustSettings(allow_unsigned_versions=True)) is None
    # A pinned key wins over the opt-out: every version must then be signed by it.
    pinned = island_trust(TrustSettings(version_public_key=public_key_text(KEY), allow_unsigned_versions=True))
    assert pinned.key_id == key_id(KEY)
    with pytest.raises(KeyUnreadable):
        trainer_signing_key(TrustSettings(signing_key_file=tmp_path / "absent.pem"))


def test_the_trainer_refuses_to_start_without_a_key():
    from workers.trainer.loop import Trainer
    from workers.trainer.settings import TrainerSettings

    with pytest.raises(TrustNotConfigured, match="SPRAWL_TRUST__SIGNING_KEY_FILE"):
        Trainer(TrainerSettings(run_id="r", trust=TrustSettings()), None, None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- islands refuse, and keep serving


class _Chain:
    """A tiny model's chain, signed with the test key, over a store that may corrupt chosen blobs."""

    def __init__(self, event_log, settings, corrupt=lambda key: False, **chain):
        self.model = tiny_moe(seed=7)
        self.state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.blobs = CorruptingBlobStore(settings.blobs, corrupt)
        self.event_log, self.settings = event_log, settings
        self.pub = publisher(event_log, settings, self.model, blobs=self.blobs, keyframe_every=100, **chain)
        self.roots: dict[int, str] = {}

    async def publish(self, version: int, *, signing_key="trainer") -> PolicyVersion:
        """Version `version` after one more step; `signing_key` other than "trainer" publishes it from a
        rogue publisher (signed by that key, or unsigned for None), as a forger with log access would."""
        adam_like_step(self.state, 1e-5, torch.Generator().manual_seed(version))
        if signing_key == "trainer":
            await self.pub.open()  # the head may be a forged version: publish after it
            event = await self.pub.publish(version, self.state)
        else:
            rogue = publisher(self.event_log, self.settings, self.model, signing_key=signing_key)
            event = await rogue.publish(version, self.state)
            rogue.close()
        self.roots[version] = expected_root(self.state, "bf16")
        return event


async def _island(event_log, settings, cache_dir, name: str) -> Island:
    section = IslandSection(
        island_id=name,
        poll_interval_s=0.2,
        materialize=MaterializeSettings(cache_dir=cache_dir),
        route_retry=RouteRetrySection(first_s=3600.0, max_s=3600.0, jitter=0.0),
    )
    island = reference_island(event_log, settings, section)
    await island.start(follow=True)
    return island


async def _until(island: Island, predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert island.follower is not None
        if island.follower.done():
            island.follower.result()
            raise AssertionError(f"the follower ended before: {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


async def _dead_letters(event_log, run_id: str) -> list[DeadLetter]:
    events = [r.event async for r in replay(event_log, DEADLETTER.name, f"rl.{run_id}.deadletter.>")]
    return [e for e in events if isinstance(e, DeadLetter)]


async def _assert_refused_and_serving(island: Island, chain: _Chain, *, refused: int, serving: int, error_class: str):
    """The refused version is not served: the island is blocked at it, serves `serving` (bits that
    re-hash to its signed root), counted the refusal, and dead-lettered it once."""
    await _until(
        island, lambda: island.blocked is not None and island.blocked.head == refused, f"blocked at v{refused}"
    )
    assert island.version == serving and island.state == "catching_up"
    assert f"v{refused} refused" in island.blocked.reason
    current = island.materializer.current()
    assert current is not None and verify_directory(current) == chain.roots[serving]
    assert island.stats.root_hashes[serving] == chain.roots[serving] and refused not in island.stats.root_hashes
    assert island.refused_versions == 1
    # Woken again and again: nothing more is counted, logged or dead-lettered, and it still serves.
    for _ in range(3):
        assert await island.advance(refused) == serving
    assert island.refused_versions == 1
    await _until(island, lambda: not island.materializer.refusals.unreported(), "the refusal dead-lettered")
    letters = await _dead_letters(island.log, chain.settings.run_id)
    assert len(letters) == 1
    (letter,) = letters
    assert (letter.stream, letter.consumer, letter.error_class) == ("policy", island.identity().island_id, error_class)
    assert letter.original_subject == f"rl.{chain.settings.run_id}.policy.v{refused}"
    assert f"policy version {refused}" in letter.reason
    metrics = (await Sidecar(island).metrics(None)).text
    assert "sprawl_island_refused_versions_total 1" in metrics
    return letter


@pytest.mark.integration
async def test_a_patch_rewritten_in_the_bucket_is_refused_and_shown_by_the_audit(event_log, settings, tmp_path):
    chain = _Chain(event_log, settings, corrupt=patch_key(3, 2))
    island = await _island(event_log, settings, tmp_path, "tamper-blob")
    try:
        for v in range(3):
            await chain.publish(v)
        await _until(island, lambda: island.version == 2, "serving v2")
        await chain.publish(3)  # its patch is rewritten in the bucket after it was signed
        letter = await _assert_refused_and_serving(
            island, chain, refused=3, serving=2, error_class="blob_digest_mismatch"
        )
        [corrupt] = chain.blobs.corrupted
        assert corrupt in letter.reason and "corrupt after a refetch" in letter.reason
        # A second island refusing the same version counts it too, and finds the dead letter there.
        second = await _island(event_log, settings, tmp_path / "second", "tamper-blob-2")
        try:
            await _until(
                second,
                lambda: second.refused_versions == 1 and not second.materializer.refusals.unreported(),
                "the second island refuses v3 and reports it",
            )
            assert second.version == 2
            assert len(await _dead_letters(event_log, settings.run_id)) == 1
        finally:
            await second.stop()
    finally:
        await island.stop()
    archiver = ArchiverSettings(
        **settings.model_dump(include={"run_id", "nats", "blobs", "log"}), archive=ArchiveSection()
    )
    await drain_once(archiver)
    con, views = open_archive(settings)
    rows = query(con, views, AUDITS["dead-letters"]).fetchall()
    columns = [d[0] for d in query(con, views, AUDITS["dead-letters"]).description]
    shown = [dict(zip(columns, row, strict=True)) for row in rows]
    assert [(r["stream"], r["consumer"], r["error_class"]) for r in shown] == [
        ("policy", "tamper-blob", "blob_digest_mismatch")
    ]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("signing_key", "reason"),
    [
        pytest.param(OTHER, f"signed by key {key_id(OTHER)}, pinned {TEST_TRUST.key_id}", id="another-key"),
        pytest.param(None, "unsigned", id="unsigned"),
    ],
)
async def test_a_forged_version_is_refused_and_a_later_good_one_is_taken(
    event_log, settings, tmp_path, signing_key, reason
):
    chain = _Chain(event_log, settings)
    island = await _island(event_log, settings, tmp_path, "tamper-event")
    try:
        for v in range(2):
            await chain.publish(v)
        await _until(island, lambda: island.version == 1, "serving v1")
        forged = await chain.publish(2, signing_key=signing_key)  # a valid-looking body, blobs and all
        assert forged.views[0].kind == "keyframe"
        letter = await _assert_refused_and_serving(
            island, chain, refused=2, serving=1, error_class="version_signature_invalid"
        )
        assert letter.reason.endswith(reason)
        assert decode_event(letter.payload).event_id == forged.event_id  # the refused bytes themselves
        # The trainer's next version (a keyframe: it does not build on the forged one) is served.
        await chain.publish(3)
        await _until(island, lambda: island.version == 3, "serving v3")
        assert island.blocked is None and island.state == "serving"
        assert verify_directory(island.materializer.current()) == chain.roots[3]
        assert island.refused_versions == 1
    finally:
        await island.stop()
