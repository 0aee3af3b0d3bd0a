"""docs/FORMAT.md kept honest: a reader written only from that page, checked against what the code writes.

The reader half of this file (`read_safetensors`, `tensor_digest`, `doc_root_hash`, `manifest_bytes`,
`verify_event`, `resolve_message`, the key patterns) imports nothing from sprawl: it is built from the
page alone, with `struct`, `json`, `hashlib`, `xxhash`, `cryptography`, nats-py and boto3, as someone
writing a loader in another language would. The examples the page shows (hex dump, root hash, event,
signed bytes, public key, key patterns) are read out of the page itself, so an edit to the code that
changes a byte makes these tests fail until the page says the new bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import xxhash
import zstandard
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.format_reader.patch_reader import WIDTHS

DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def doc_block(name: str) -> str:
    """The fenced block after `<!-- format-doc:<name> -->`, without its final newline."""
    text = doc_text()
    marker = f"<!-- format-doc:{name} -->"
    assert text.count(marker) == 1, f"{DOC.name} must hold exactly one {marker}"
    after = text.split(marker, 1)[1]
    match = re.match(r"\s*```[a-z]*\n(.*?)\n```", after, re.DOTALL)
    assert match is not None, f"no fenced block follows {marker}"
    return match.group(1)


# ================================================================ the reader, from the page only


class DocRefusal(Exception):
    """What the page says a reader must refuse."""


ELEMENT_BYTES = WIDTHS  # section 4: one table for both readers written from the page


def parse_hexdump(text: str) -> bytes:
    """`OFFSET  hh hh ...  |ascii|` lines (section 6's example) back to bytes."""
    out = bytearray()
    for line in text.splitlines():
        offset, rest = line.split("  ", 1)
        assert int(offset, 16) == len(out), f"hex dump offset {offset} out of step"
        out += bytes.fromhex(rest.split("|", 1)[0])
    return bytes(out)


def read_safetensors(data: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes), from section 6's table; refuses anything the page rules out."""
    if len(data) < 8:
        raise DocRefusal("shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise DocRefusal(f"header length {n} runs past the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DocRefusal(f"header is not UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise DocRefusal("header is not a JSON object")
    payload = data[8 + n :]
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ELEMENT_BYTES:
            raise DocRefusal(f"{name}: unknown dtype {dtype}")
        elements = 1
        for dim in shape:
            elements *= dim
        if not 0 <= begin <= end <= len(payload) or end - begin != elements * ELEMENT_BYTES[dtype]:
            raise DocRefusal(f"{name}: data_offsets {begin},{end} do not fit {dtype}{shape} in the data section")
        spans.append((begin, end))
        tensors[name] = (dtype, list(shape), payload[begin:end])
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise DocRefusal(f"data_offsets leave a gap or overlap at byte {position}")
        position = end
    if position != len(payload):
        raise DocRefusal(f"data section has {len(payload) - position} bytes no tensor covers")
    return tensors


def tensor_digest(raw: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(raw)  # section 3: XXH3-128, seed 0, canonical hex


def root_hash_input(digests) -> bytes:
    """Section 7: one line per tensor, sorted by the UTF-8 bytes of the name."""
    lines = sorted(
        (
            name.encode("utf-8"),
            name.encode("utf-8")
            + b"\x00"
            + dtype.encode()
            + b"\x00"
            + ",".join(str(d) for d in shape).encode()
            + b"\x00"
            + xxh3.encode()
            + b"\n",
        )
        for name, dtype, shape, xxh3 in digests
    )
    return b"".join(line for _, line in lines)


def doc_root_hash(digests) -> str:
    return xxhash.xxh3_128_hexdigest(root_hash_input(digests))


def _blobs(pointers: list[dict]) -> list[dict]:
    return [{"uri": b["uri"], "sha256": b["sha256"], "bytes": b["bytes"], "name": b["name"]} for b in pointers]


def manifest_bytes(event: dict) -> bytes:
    """Section 11.1, from a decoded event (a dict)."""
    manifest = {
        "format": "sprawl.version-manifest.v1",
        "run_id": event["run_id"],
        "version": event["version"],
        "parent_version": event["parent_version"],
        "trainer_step": event["trainer_step"],
        "lineage_uri": event["lineage_uri"],
        "lineage_sha256": event["lineage_sha256"],
        "views": [
            {
                "view": v["view"],
                "kind": v["kind"],
                "base_version": v["base_version"],
                "root_hash": v["root_hash"],
                "blobs": _blobs(v["blobs"]),
                "skip_patches": [
                    {"base_version": s["base_version"], "blobs": _blobs(s["blobs"])} for s in v["skip_patches"]
                ],
            }
            for v in event["views"]
        ],
    }
    body = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return b"sprawl.version-manifest.v1\n" + body


def raw_public_key(text: str) -> bytes:
    """Section 11.2: PEM SubjectPublicKeyInfo or base64 of the 32 raw bytes."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64decode(text, validate=True)


def doc_key_id(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


def verify_event(event: dict, pinned_raw: bytes) -> None:
    """Section 11.2, in its order; DocRefusal names the first failure."""
    signature = event.get("signature")
    if signature is None:
        raise DocRefusal("unsigned")
    if signature["algorithm"] != "ed25519":
        raise DocRefusal(f"algorithm {signature['algorithm']}")
    if signature["key_id"] != doc_key_id(pinned_raw):
        raise DocRefusal(f"signed by key {signature['key_id']}")
    try:
        Ed25519PublicKey.from_public_bytes(pinned_raw).verify(
            base64.b64decode(signature["signature"], validate=True), manifest_bytes(event)
        )
    except InvalidSignature:
        raise DocRefusal("signature does not match the manifest") from None
    for view in event["views"]:
        if doc_root_hash(t[:4] for t in view["tensors"]) != view["root_hash"]:
            raise DocRefusal(f"view {view['view']}'s digests do not hash to its root")


def check_blob(data: bytes, pointer: dict) -> bytes:
    """Section 12: the bytes are the pointer's, or refused."""
    if len(data) != pointer["bytes"] or hashlib.sha256(data).hexdigest() != pointer["sha256"]:
        raise DocRefusal(f"{pointer['uri']} differs from its pointer")
    return data


def split_s3_uri(uri: str) -> tuple[str, str]:
    assert uri.startswith("s3://"), uri
    bucket, key = uri[len("s3://") :].split("/", 1)
    return bucket, key


def s3_get(s3, uri: str) -> bytes:
    bucket, key = split_s3_uri(uri)
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def resolve_message(s3, bucket: str, run: str, subject: str, body: bytes) -> dict:
    """Sections 9.3 and 9.4: the version event a POLICY message holds, claim check followed."""
    event = json.loads(body)
    if event["type"] == "claim_check.v1":
        prefix = f"s3://{bucket}/claims/{run}/"
        if not event["uri"].startswith(prefix):
            raise DocRefusal(f"claim check {event['uri']} outside {prefix}")
        inner = json.loads(check_blob(s3_get(s3, event["uri"]), event))
        if inner["type"] != event["event_type"] or inner["event_id"] != event["event_id"]:
            raise DocRefusal("claim check holds another event")
        event = inner
    if event["type"] != "policy_version.v1":
        raise DocRefusal(f"unknown type {event['type']}")
    if subject != f"rl.{event['run_id'].lower()}.policy.v{event['version']}":
        raise DocRefusal(f"{subject} holds version {event['version']} of {event['run_id']}")
    return event


PLACEHOLDER_PATTERNS = {  # section 13's placeholder table, as regular expressions
    "run_id": r"[a-z0-9][a-z0-9_-]*",
    "version": r"\d{8}",
    "writer_id": r"[0-9a-f]{12}",
    "view": r"[a-z0-9_]+",
    "file": r"[^/]+",
    "base_version": r"(?:0|[1-9]\d*)",
    "shard_stem": r"model-\d{5}-of-\d{5}",
    "holder": r"[^/]+",
    "kind": r"(?:policy|traj|reward|prompts|metrics|heartbeat|deadletter|trainer)",
    "sha256_prefix": r"[0-9a-f]{2}",
    "sha256": r"[0-9a-f]{64}",
    "event_type": r"[^/]+",
    "date": r"(?:\d{4}-\d{2}-\d{2}|unknown)",
    "stream": r"[a-z_]+",
    "first_seq": r"\d{12}",
    "last_seq": r"\d{12}",
    "rows": r"[1-9]\d*",
}


def key_patterns() -> list[str]:
    return doc_block("s3-keys").splitlines()


def key_pattern(prefix: str) -> str:
    """The one documented key pattern that starts with `prefix`."""
    found = [p for p in key_patterns() if p.startswith(prefix)]
    assert len(found) == 1, f"{len(found)} documented key patterns start with {prefix!r}"
    return found[0]


def key_regex(pattern: str) -> re.Pattern:
    parts = re.split(r"\{([a-z_0-9]+)(?::[^}]*)?\}", pattern)
    regex = "".join(re.escape(p) if i % 2 == 0 else PLACEHOLDER_PATTERNS[p] for i, p in enumerate(parts))
    return re.compile(f"^{regex}$")


# ================================================================ the page's examples are the code's bytes

EXAMPLE_STATE = {
    "model.norm.weight": [1.0, -0.5, 0.25],
    "model.layers.0.mlp.up_proj.weight": [[0.5, -1.0, 2.0], [0.0, 3.0, -0.125]],
}
"""Section 6's worked example, as the page states it (fp32 masters)."""
EXAMPLE_SEED = bytes(range(32))
"""Section 11.3: the example key's private seed `00 01 ... 1f`."""


def _example_checkpoint(tmp_path: Path, view: str) -> Path:
    from pipeline.keyframe import write_checkpoint
    from pipeline.views import get_view

    state = {name: torch.tensor(values, dtype=torch.float32) for name, values in EXAMPLE_STATE.items()}
    write_checkpoint(
        tmp_path, get_view(view).compute(state), {"model_type": "tiny", **get_view(view).config_overrides()}
    )
    return tmp_path


def test_xxh3_test_vectors_are_xxh3_128():
    vectors = dict(
        re.fullmatch(r'xxh3_128\("(.*)"\)\s+= ([0-9a-f]{32})', line).groups()
        for line in doc_block("xxh3-vectors").splitlines()
    )
    assert vectors == {"": xxhash.xxh3_128_hexdigest(b""), "abc": xxhash.xxh3_128_hexdigest(b"abc")}
    assert len(vectors) == 2


def test_the_hex_dump_is_the_shard_write_checkpoint_writes(tmp_path):
    shown = parse_hexdump(doc_block("safetensors-bf16"))
    written = (_example_checkpoint(tmp_path, "bf16") / "model-00001-of-00001.safetensors").read_bytes()
    assert shown == written
    assert len(shown) == 226


def test_the_doc_reader_reads_the_example_and_its_root_hash():
    tensors = read_safetensors(parse_hexdump(doc_block("safetensors-bf16")))
    assert {n: (d, s) for n, (d, s, _) in tensors.items()} == {
        "model.layers.0.mlp.up_proj.weight": ("BF16", [2, 3]),
        "model.norm.weight": ("BF16", [3]),
    }
    assert tensors["model.layers.0.mlp.up_proj.weight"][2] == bytes.fromhex("00 3f 80 bf 00 40 00 00 40 40 00 be")
    digests = [(n, d, s, tensor_digest(raw)) for n, (d, s, raw) in tensors.items()]
    shown_input = doc_block("root-hash-input").replace("<NUL>", "\x00").replace("<LF>", "\n").encode()
    assert root_hash_input(digests) == shown_input
    assert doc_root_hash(digests) == doc_block("root-hash")
    # and the code agrees with the page
    from pipeline.bits import root_hash

    assert root_hash([(n, d, tuple(s), x) for n, d, s, x in digests]) == doc_block("root-hash")
    # the event example names the same digests
    event = json.loads(doc_block("event-json"))
    assert sorted(tuple(t[:4]) for t in event["views"][0]["tensors"]) == sorted((n, d, s, x) for n, d, s, x in digests)


def test_the_fp8_example_bytes_are_the_fp8_view(tmp_path):
    path = _example_checkpoint(tmp_path, "fp8_e4m3") / "model-00001-of-00001.safetensors"
    tensors = read_safetensors(path.read_bytes())
    weight = tensors["model.layers.0.mlp.up_proj.weight"]
    scale = tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert (weight[0], weight[1], scale[0], scale[1]) == ("F8_E4M3", [2, 3], "F32", [1, 1])
    assert tensors["model.norm.weight"][0] == "BF16"
    values = torch.frombuffer(bytearray(weight[2]), dtype=torch.float8_e4m3fn).to(torch.float32).tolist()
    text = " ".join(doc_text().split())
    assert f"bytes `{weight[2].hex(' ')}` ({', '.join(f'{v:g}' for v in values)} in e4m3fn)" in text
    assert f"bytes `{scale[2].hex(' ')}`, = 3/448" in text
    assert struct.unpack("<f", scale[2])[0] == pytest.approx(3 / 448)
    # the dequantization the page gives recovers the masters to fp8 precision
    masters = torch.tensor(EXAMPLE_STATE["model.layers.0.mlp.up_proj.weight"]).reshape(-1).tolist()
    scale_value = struct.unpack("<f", scale[2])[0]
    for got, want in zip(values, masters, strict=True):
        assert got * scale_value == pytest.approx(want, rel=0.07, abs=1e-6)


def _all_dtypes_model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    floats = {
        torch.bfloat16: "bf16",
        torch.float16: "f16",
        torch.float32: "f32",
        torch.float64: "f64",
        torch.float8_e4m3fn: "f8e4m3",
        torch.float8_e5m2: "f8e5m2",
    }
    tensors = {f"t.{tag}": torch.randn(300, 700, generator=gen).to(dtype) for dtype, tag in floats.items()}
    tensors |= {
        "t.i8": torch.randint(-128, 128, (17, 5), generator=gen, dtype=torch.int8),
        "t.u8": torch.randint(0, 256, (9,), generator=gen, dtype=torch.uint8),
        "t.i16": torch.randint(-(2**15), 2**15, (4, 4), generator=gen, dtype=torch.int16),
        "t.i32": torch.randint(-(2**31), 2**31, (3, 2, 2), generator=gen, dtype=torch.int32),
        "t.i64": torch.randint(-(2**62), 2**62, (5,), generator=gen, dtype=torch.int64),
        "t.bool": torch.randint(0, 2, (6,), generator=gen).to(torch.bool),
        "t.scalar": torch.tensor(1.5, dtype=torch.float32),
        "t.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "t.nan": torch.tensor([float("nan"), -0.0, float("inf"), 1e-40], dtype=torch.float32),
    }
    return tensors


def test_the_doc_reader_reads_every_shard_of_a_multi_shard_checkpoint(tmp_path):
    from pipeline.bits import checksum, dtype_name, root_hash, to_bits
    from pipeline.keyframe import write_checkpoint

    tensors = _all_dtypes_model()
    files = write_checkpoint(tmp_path, tensors, {"b": 1, "a": 2}, max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and files[: len(shards)] == shards
    assert files[len(shards) :] == ["model.safetensors.index.json", "config.json"]
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert list(index["weight_map"]) == sorted(tensors)
    assert (tmp_path / "config.json").read_text() == json.dumps({"a": 2, "b": 1}, indent=2)

    read: dict[str, tuple[str, list[int], bytes]] = {}
    for shard in shards:
        held = read_safetensors((tmp_path / shard).read_bytes())
        assert set(held) == {n for n, s in index["weight_map"].items() if s == shard}
        read |= held
    assert set(read) == set(tensors)
    assert index["metadata"]["total_size"] == sum(len(raw) for _, _, raw in read.values())
    for name, tensor in tensors.items():
        dtype, shape, raw = read[name]
        bits = to_bits(tensor)
        assert (dtype, shape) == (dtype_name(tensor.dtype), list(tensor.shape))
        assert raw == bits.tobytes()  # section 4: raw bytes are the tensor's bits, little-endian, row-major
        assert tensor_digest(raw) == checksum(bits)
    digests = [(n, d, s, tensor_digest(raw)) for n, (d, s, raw) in read.items()]
    assert doc_root_hash(digests) == root_hash([(n, d, tuple(s), x) for n, d, s, x in digests])


def _shard(header: dict, payload: bytes, *, length: int | None = None) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + payload


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x08\x00\x00", "shorter than"),
        (
            _shard({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, length=1 << 40),
            "runs past",
        ),
        (b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe{}", "not UTF-8 JSON"),
        (_shard({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 6]}}, b"\0" * 6), "do not fit"),
        (_shard({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2), "unknown dtype"),
        (
            _shard(
                {
                    "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                    "b": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]},
                },
                b"\0" * 6,
            ),
            "gap or overlap",
        ),
        (_shard({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 5), "no tensor covers"),
    ],
)
def test_the_doc_reader_refuses_shards_the_page_rules_out(data, reason, tmp_path):
    with pytest.raises(DocRefusal, match=reason):
        read_safetensors(data)
    # the page's rules are safetensors' own: the library refuses these files too
    from safetensors import SafetensorError, safe_open

    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(SafetensorError), safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            f.get_tensor(name)


def test_the_doc_reader_refuses_a_truncated_or_altered_example():
    good = parse_hexdump(doc_block("safetensors-bf16"))
    with pytest.raises(DocRefusal):
        read_safetensors(good[:-1])
    altered = bytearray(good)
    altered[-1] ^= 0x01  # the bits change: the reader parses it, the digest is what catches it
    tensors = read_safetensors(bytes(altered))
    digests = [(n, d, s, tensor_digest(raw)) for n, (d, s, raw) in tensors.items()]
    assert doc_root_hash(digests) != doc_block("root-hash")


_names = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        _names,
        st.tuples(
            st.sampled_from(sorted(ELEMENT_BYTES)),
            st.lists(st.integers(0, 5000), max_size=4),
            st.binary(min_size=16, max_size=16).map(bytes.hex),
        ),
        max_size=12,
    )
)
def test_the_root_hash_recipe_is_the_codes(entries):
    from pipeline.bits import root_hash

    digests = [(name, dtype, shape, xxh3) for name, (dtype, shape, xxh3) in entries.items()]
    assert doc_root_hash(digests) == root_hash([(n, d, tuple(s), x) for n, d, s, x in digests])


# ---------------------------------------------------------------- the event and its signature


def test_the_example_event_verifies_from_the_page_alone():
    event = json.loads(doc_block("event-json"))
    pinned = raw_public_key(doc_block("public-key"))
    assert doc_key_id(pinned) == event["signature"]["key_id"]
    assert manifest_bytes(event) == doc_block("signed-bytes").encode()
    assert len(manifest_bytes(event)) == 1083
    verify_event(event, pinned)
    # the raw-bytes form of the same key (section 11.3) is the same key
    shown = re.search(r"\(base64\s+`([A-Za-z0-9+/=]+)`\)", doc_text()).group(1)
    assert raw_public_key(shown) == pinned
    assert pinned.hex() in doc_text()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda e: e["views"][0]["blobs"][0].update(sha256="0" * 64),
        lambda e: e["views"][0]["blobs"][2].update(bytes=79),
        lambda e: e["views"][0].update(root_hash="0" * 32),
        lambda e: e["views"][0]["tensors"][1].__setitem__(3, "0" * 32),
        lambda e: e.update(version=1),
        lambda e: e.update(lineage_sha256=None),
        lambda e: e["signature"].update(key_id="0" * 16),
        lambda e: e.update(signature=None),
    ],
)
def test_the_doc_reader_refuses_a_tampered_example(tamper):
    event = json.loads(doc_block("event-json"))
    tamper(event)
    with pytest.raises(DocRefusal):
        verify_event(event, raw_public_key(doc_block("public-key")))


def test_unsigned_fields_are_what_the_page_says():
    """Changing what the page calls unsigned leaves the signature valid (a reader must not trust them)."""
    event = json.loads(doc_block("event-json"))
    event["views"][0].update(bytes=1, changed_elements=0, total_elements=0)
    event["views"][0]["tensors"][0][4] = 0
    event.update(consumed_trajectories=99, producer="someone else", event_id="x")
    verify_event(event, raw_public_key(doc_block("public-key")))


def test_the_example_event_is_what_the_code_writes(tmp_path):
    from pipeline.version_signing import load_public_key, sign_version, signed_bytes, verify_version
    from schemas.codec import decode_event, encode_event

    pretty = json.loads(doc_block("event-json"))
    wire = json.dumps(pretty, separators=(",", ":"), ensure_ascii=False).encode()
    event = decode_event(wire)
    assert encode_event(event) == wire  # the page's key order and encoding are msgspec's
    assert len(wire) == 1600
    assert signed_bytes(event) == doc_block("signed-bytes").encode()
    verify_version(event, load_public_key(doc_block("public-key")))
    key = Ed25519PrivateKey.from_private_bytes(EXAMPLE_SEED)
    resigned = sign_version(msgspec.structs.replace(event, signature=None), key)
    assert resigned.signature == event.signature  # Ed25519 is deterministic: the page's signature is real
    assert resigned.signature.signature.hex() in doc_text()
    # the blobs it names are the example checkpoint's files
    directory = _example_checkpoint(tmp_path, "bf16")
    for blob in pretty["views"][0]["blobs"]:
        check_blob((directory / blob["name"]).read_bytes(), blob)


def _random_event(key: Ed25519PrivateKey):
    """A two-view version with a patch, skip patches, no lineage, and strings that need escaping."""
    from pipeline.bits import root_hash
    from pipeline.version_signing import sign_version
    from schemas import BlobPointer, PolicyVersion, SkipPatch, TensorDigest, ViewVersion

    def pointer(i: int, name: str) -> BlobPointer:
        return BlobPointer(uri=f's3://b/k/ü\\"\t{i}/{name}', sha256=f"{i:064x}", bytes=i * 7, name=name)

    views = []
    for j, (view, kind) in enumerate([("bf16", "patch"), ("fp8_e4m3", "keyframe")]):
        tensors = [
            TensorDigest(name=f"w{i}.é", dtype="BF16", shape=[i, 3], xxh3=f"{i + j:032x}", changed=i) for i in range(3)
        ]
        views.append(
            ViewVersion(
                view=view,
                kind=kind,
                base_version=6 if kind == "patch" else None,
                blobs=[pointer(j * 10 + i, f"model-0000{i}-of-00002.safetensors") for i in (1, 2)],
                tensors=tensors,
                root_hash=root_hash([(t.name, t.dtype, tuple(t.shape), t.xxh3) for t in tensors]),
                bytes=3,
                changed_elements=1,
                total_elements=9,
                skip_patches=[
                    SkipPatch(
                        base_version=7 - k,
                        blobs=[pointer(100 + k, "model-00001-of-00002.safetensors")],
                        bytes=k,
                        changed_elements=k,
                    )
                    for k in (2, 4)
                ]
                if kind == "patch"
                else [],
            )
        )
    event = PolicyVersion(run_id="r-1", version=7, parent_version=6, trainer_step=70, views=views)
    return sign_version(event, key)


def test_the_doc_recipe_verifies_what_sign_version_signs():
    from pipeline.version_signing import public_key_text
    from schemas.codec import encode_event

    key = Ed25519PrivateKey.generate()
    event = json.loads(encode_event(_random_event(key)))
    assert event["lineage_uri"] is None and event["views"][0]["skip_patches"]
    verify_event(event, raw_public_key(public_key_text(key)))
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    verify_event(event, raw_public_key(base64.b64encode(raw).decode()))
    with pytest.raises(DocRefusal, match="signed by key"):
        verify_event(event, raw_public_key(public_key_text(Ed25519PrivateKey.generate())))
    event["views"][0]["skip_patches"][1]["base_version"] = 2
    with pytest.raises(DocRefusal, match="does not match"):
        verify_event(event, raw)


# ---------------------------------------------------------------- key patterns the code builds without a server


def test_the_lineage_and_archive_keys_are_the_documented_ones():
    from schemas.archive import ArchiveKey
    from schemas.lineage import lineage_key

    assert lineage_key("run-1", 42) == key_pattern("runs/{run_id}/lineage/").format(run_id="run-1", version=42)
    archive = ArchiveKey(
        run_id="run-1",
        event_type="trajectory.v1",
        date="2025-01-02",
        stream="trajectories",
        first_seq=7,
        last_seq=9,
        rows=3,
    )
    assert archive.to_key() == key_pattern("archive/").format(
        run_id="run-1",
        event_type="trajectory.v1",
        date="2025-01-02",
        stream="trajectories",
        first_seq=7,
        last_seq=9,
        rows=3,
    )
    assert key_regex(key_pattern("archive/")).match(archive.to_key())
    assert all(key_regex(p) for p in key_patterns())  # every placeholder is one the page describes


# ================================================================ section 8: the patch examples are the codec's bytes
# These check the page's patch examples against pipeline/patch_codec.py; they are not a reader (the
# reader of section 8 is written apart from the codec, from the page alone).


def listing_bytes(block: str) -> bytes:
    """An annotated listing (section 8.10: the hex before `#` on each line, in order) back to bytes."""
    return bytes.fromhex("".join("".join(line.split("#", 1)[0].split()) for line in block.splitlines()))


def _patch_example_inputs():
    """Section 8.10's inputs: encode() keyword arguments, then base and target TensorBits by name."""
    from pipeline.bits import bits_dtype
    from pipeline.patch_codec import TensorBits

    first, *lines = doc_block("patch-example-inputs").splitlines()
    params = {key: value if key == "view" else int(value) for key, value in re.findall(r"(\w+) (\w+)", first)}
    specs, values, current = {}, {}, None
    for line in lines:
        if not line.startswith(" "):
            name, dtype, dims = re.fullmatch(r"(\S+) (\w+) \[([\d, ]*)\]", line).groups()
            specs[name] = (dtype, tuple(int(d) for d in dims.split(",") if d.strip()))
            values[name] = {"base": [], "target": []}
            continue
        words = line.split()
        if words[0] in ("base", "target"):
            current, words = words[0], words[1:]
        values[name][current] += [int(w, 16) for w in words]
    sides = {
        side: {
            n: TensorBits(dtype, shape, np.array(values[n][side], dtype=bits_dtype(dtype)))
            for n, (dtype, shape) in specs.items()
        }
        for side in ("base", "target")
    }
    for n, (_, shape) in specs.items():
        assert len(values[n]["base"]) == len(values[n]["target"]) == math.prod(shape), n
    return params, sides["base"], sides["target"]


def test_the_patch_example_is_what_the_codec_writes():
    from pipeline import patch_codec

    params, base, target = _patch_example_inputs()
    assert len(base) == 3 and params["chunk_elements"] == 16
    patch = patch_codec.encode(base, target, **params)
    (header_length,) = struct.unpack_from("<I", patch, 10)
    header = zstandard.ZstdDecompressor().decompress(patch[14 : 14 + header_length])
    assert listing_bytes(doc_block("patch-example-header")) == header, "8.10: the header's msgpack changed"
    assert listing_bytes(doc_block("patch-example-payload")) == patch[14 + header_length :], "8.10: the payload"
    assert parse_hexdump(doc_block("patch-example-hex")) == patch, (
        "8.10's hex dump is not what encode() writes (msgpack and payload agree: if only the zstd frame "
        "differs, a new libzstd compresses the header differently; regenerate the dump)"
    )
    assert f"The patch ({len(patch)} bytes)" in doc_text()
    # the example is a patch the codec applies, bit for bit, and refuses on any other base
    out = patch_codec.apply(patch, base)
    assert all(np.array_equal(out[n].bits, target[n].bits) for n in target)
    header_struct, _ = patch_codec.read_header(patch)
    modes = [
        (patch[14 + header_length + c.offset], patch[15 + header_length + c.offset])
        for g in header_struct.groups
        for c in g.chunks
        if c.size
    ]
    assert modes == [(1, 1), (2, 0), (1, 2)]  # 8.10: sparse ulp, dense xor, sparse raw
    with pytest.raises(patch_codec.ChecksumMismatch):
        patch_codec.apply(patch, target)


def _rans_example():
    """Section 8.11's patch, built by the rule the page states; returns it and the d sequence."""
    from pipeline.patch_codec import TensorBits, encode

    rule = doc_block("rans-example-inputs")
    n = int(re.search(r"BF16 \[(\d+)\]", rule).group(1))
    period = [int(d) for d in re.search(r"d = ([-+\d ]+)$", rule).group(1).split()]
    base = (0x3F80 + np.arange(n) % 7).astype(np.uint16)
    target = base.copy()
    for j in range(n // 4):
        target[4 * j] = int(base[4 * j]) + period[j % len(period)]
    patch = encode({"w": TensorBits("BF16", (n,), base)}, {"w": TensorBits("BF16", (n,), target)})
    return patch, [period[j % len(period)] for j in range(n // 4)]


def test_the_rans_example_is_a_stream_the_codec_writes():
    from pipeline import patch_codec

    patch, steps = _rans_example()
    header, payload = patch_codec.read_header(patch)
    (chunk,) = header.groups[0].chunks
    record = bytes(payload[chunk.offset : chunk.offset + chunk.size])
    assert record[:2] == bytes([1, 1])  # sparse, ulp
    at = 2
    for _ in range(4):  # the gap planes; the fifth stream is value plane 0
        at += 9 + struct.unpack_from("<I", record, at + 5)[0]
    end = at + 9 + struct.unpack_from("<I", record, at + 5)[0]
    assert record[at:end] == listing_bytes(doc_block("rans-example-stream"))
    assert record[at] == 2 and f"bytes {at}–{end - 1} of the record" in doc_text()

    # The hand-decoding table: each row's arithmetic holds, its symbol is zigzag(d), the first four rows
    # start from the stream's initial states (just before its body) and the next four from their results,
    # and the last four end at L.
    stream = record[at:end]
    zigzag = {1: 2, -1: 1, 2: 4, -2: 3}
    rows = re.findall(
        r"^\| (\d+) \| x(\d) \| `0x(\w+)` \| (\d+) \| (\d) \| "
        r"(\d+)·(\d+) \+ (\d+) − (\d+) = `0x(\w+)` \| (.*?) \| `0x(\w+)` \|$",
        doc_text(),
        re.MULTILINE,
    )
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7, 252, 253, 254, 255]
    body = int(re.search(r"all (\d+) body bytes have been read", doc_text()).group(1))
    initial = struct.pack("<4I", *(int(r[2], 16) for r in rows[:4]))
    assert stream.index(initial) + 16 + body == len(stream)
    states = {}
    for i, lane, before, slot, symbol, freq, quotient, slot2, cum, value, read, after in rows:
        i, lane, x = int(i), int(lane), int(before, 16)
        assert lane == i % 4 and int(symbol) == zigzag[steps[i]]
        if 4 <= i < 8:
            assert x == states[lane], f"row {i}: x{lane} is not what row {i - 4} left"
        assert int(slot) == int(slot2) == x & 16383 and int(quotient) == x >> 14
        assert int(cum) <= int(slot) < int(cum) + int(freq)
        x = int(freq) * int(quotient) + int(slot) - int(cum)
        assert x == int(value, 16)
        for byte in read.strip("`").split() if read != "—" else []:
            x = (x << 8) | int(byte, 16)
        assert x == int(after, 16) >= 1 << 23
        states[lane] = x
        if i >= 252:
            assert x == 1 << 23


# ================================================================ a published chain, read from the page


def _doc_test_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "model.embed_tokens.weight": torch.randn(1024, 640, generator=gen) * 0.02,  # > 1 MiB in bf16: own shard
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=gen) * 0.02,
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 160, generator=gen) * 0.02,
        "model.norm.weight": torch.ones(64),
    }


def _step(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    for tensor in state.values():
        flat = tensor.view(-1)
        picked = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gen)
        flat[picked] += 0.01


async def _publish(event_log, settings, key, versions: int):
    from pipeline.blobstore import S3BlobStore
    from pipeline.chain_publish import ChainPublisher
    from pipeline.config import ChainSettings
    from workers.trainer.recovery import put_lineage

    blobs = S3BlobStore(settings.blobs)
    publisher = ChainPublisher(
        event_log,
        blobs,
        run_id=settings.run_id,
        model_config={"model_type": "tiny", "tie_word_embeddings": False},
        settings=ChainSettings(
            views=["bf16", "fp8_e4m3"], keyframe_every=3, skip_distances=[2], max_shard_bytes=1 << 20
        ),
        extra_files={"generation_config.json": b"{}"},
        signing_key=key,
    )
    state, gen = _doc_test_state(), torch.Generator().manual_seed(6)
    try:
        for version in range(versions):
            if version:
                _step(state, gen)
            lineage = await put_lineage(blobs, settings.run_id, version, [])
            await publisher.publish(version, state, lineage_uri=lineage.uri, lineage_sha256=lineage.checksum)
    finally:
        publisher.close()
    return publisher.writer_id


@pytest.mark.integration
@pytest.mark.parametrize("claim_checked", [False, True], ids=["plain", "claim-checked"])
async def test_a_reader_from_the_page_reads_a_published_chain(event_log, settings, claim_checked):
    from pipeline.blobstore import S3BlobStore
    from pipeline.eventlog import EventLog
    from workers.trainer.checkpoint import save_checkpoint

    key = Ed25519PrivateKey.generate()
    pinned = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    run, bucket = settings.run_id, settings.blobs.bucket
    log = event_log
    if claim_checked:  # the smallest threshold: every version event goes to the blob store
        low = settings.model_copy(update={"log": settings.log.model_copy(update={"claim_check_threshold_bytes": 1024})})
        log = await EventLog.connect(low, worker="test")
    try:
        writer_id = await _publish(log, settings, key, versions=4)
        model = torch.nn.Linear(2, 2)
        await save_checkpoint(
            log,
            S3BlobStore(settings.blobs),
            run_id=run,
            holder="doc-test",
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            version=3,
            step=3,
            used=set(),
            positions=(0, 0),
        )
    finally:
        if claim_checked:
            await log.close()
    s3 = S3BlobStore(settings.blobs).client
    js = event_log.js  # nats-py's JetStream client: the JetStream API of section 9.2, nothing of sprawl's

    # 9.2: the newest version is the largest v<N> among the POLICY subjects of the run
    info = await js.stream_info("POLICY", subjects_filter=f"rl.{run}.policy.*")
    numbers = [int(s.rsplit(".", 1)[1][1:]) for s in info.state.subjects if re.fullmatch(r"v\d+", s.rsplit(".", 1)[1])]
    assert max(numbers) == 3 and sorted(numbers) == [0, 1, 2, 3]

    events, claim_checks = {}, 0
    for version in range(4):
        subject = f"rl.{run}.policy.v{version}"
        message = await js.get_last_msg("POLICY", subject)
        claim_checks += json.loads(message.data)["type"] == "claim_check.v1"
        event = resolve_message(s3, bucket, run, subject, message.data)
        verify_event(event, pinned)
        events[version] = event
    assert claim_checks == (4 if claim_checked else 0)

    named = _check_blob_keys(s3, bucket, run, writer_id, events)
    for version in (0, 3):
        _check_keyframe(s3, events[version])
    for version in (1, 2):  # 14: one patch blob per keyframe shard, named by the shard it covers
        for view, keyframe in zip(events[version]["views"], events[0]["views"], strict=True):
            shards = sorted(b["name"] for b in keyframe["blobs"] if b["name"].endswith(".safetensors"))
            assert [b["name"] for b in view["blobs"]] == shards
    assert [s["base_version"] for v in events[2]["views"] for s in v["skip_patches"]] == [0, 0]
    _check_listing(s3, bucket, run, named, claims=4 if claim_checked else 0)


def _check_blob_keys(s3, bucket: str, run: str, writer_id: str, events: dict[int, dict]) -> set[str]:
    """Section 13: every key the chain names is the documented pattern filled in with the event's values,
    and (section 12) every blob's bytes are its pointer's. Returns the keys named."""
    patterns = [p for p in key_patterns() if p.startswith("runs/{run_id}/policy/")]
    keyframe_key = next(p for p in patterns if "/keyframe/" in p)
    patch_key = next(p for p in patterns if "/patch-from-" in p)
    named = set()
    for version, event in events.items():
        assert event["parent_version"] == (version - 1 if version else None)
        for view in event["views"]:
            assert view["kind"] == ("keyframe" if version % 3 == 0 else "patch")
            common = {"run_id": run, "version": version, "writer_id": writer_id, "view": view["view"]}
            edges = [(view["base_version"], view["blobs"])] if view["kind"] == "patch" else []
            edges += [(s["base_version"], s["blobs"]) for s in view["skip_patches"]]
            if view["kind"] == "keyframe":
                for blob in view["blobs"]:
                    assert blob["uri"] == f"s3://{bucket}/" + keyframe_key.format(**common, file=blob["name"])
            for base, blobs in edges:
                for blob in blobs:
                    stem = blob["name"].removesuffix(".safetensors")
                    expected = patch_key.format(**common, base_version=base, shard_stem=stem)
                    assert blob["uri"] == f"s3://{bucket}/{expected}"
            for blobs in [view["blobs"], *(blobs for _, blobs in edges)]:
                for blob in blobs:
                    check_blob(s3_get(s3, blob["uri"]), blob)
                    named.add(split_s3_uri(blob["uri"])[1])
        lineage = key_pattern("runs/{run_id}/lineage/").format(run_id=run, version=version)
        assert event["lineage_uri"] == f"s3://{bucket}/{lineage}"
        lineage_bytes = s3_get(s3, event["lineage_uri"])
        assert hashlib.sha256(lineage_bytes).hexdigest() == event["lineage_sha256"]
        assert json.loads(lineage_bytes) == {"version": version, "groups": []}
    return named


def _check_keyframe(s3, event: dict) -> None:
    """Sections 5 to 7: a keyframe's files, read by the page's reader, hash to the signed digests."""
    for view in event["views"]:
        files = {b["name"]: check_blob(s3_get(s3, b["uri"]), b) for b in view["blobs"]}
        assert list(files)[-3:] == ["model.safetensors.index.json", "config.json", "generation_config.json"]
        weight_map = json.loads(files["model.safetensors.index.json"])["weight_map"]
        shards = sorted(set(weight_map.values()))
        assert len(shards) == 2 and list(files)[:2] == shards
        digests = {t[0]: t for t in view["tensors"]}
        assert [t[0] for t in view["tensors"]] == sorted(digests)
        for shard in shards:
            tensors = read_safetensors(files[shard])
            assert set(tensors) == {n for n, s in weight_map.items() if s == shard}
            for name, (dtype, shape, raw) in tensors.items():
                assert [dtype, shape, tensor_digest(raw)] == digests[name][1:4]
        assert doc_root_hash(t[:4] for t in view["tensors"]) == view["root_hash"]
        if view["view"] == "fp8_e4m3":
            assert digests["model.layers.0.self_attn.q_proj.weight"][1:3] == ["F8_E4M3", [64, 64]]
            assert digests["model.layers.0.self_attn.q_proj.weight_scale_inv"][1:3] == ["F32", [1, 1]]
            assert digests["model.layers.0.mlp.down_proj.weight_scale_inv"][1:3] == ["F32", [1, 2]]
            assert digests["model.embed_tokens.weight"][1] == "BF16"
            config = json.loads(files["config.json"])
            assert config["quantization_config"]["weight_block_size"] == [128, 128]


def _check_listing(s3, bucket: str, run: str, named: set[str], *, claims: int) -> None:
    """Section 13: nothing under the run's prefixes is outside the documented layout; the trainer's
    checkpoint and the claim checks are where it says."""
    listed = []
    for prefix in (f"runs/{run}/", f"claims/{run}/"):
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        listed += [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    regexes = [key_regex(p) for p in key_patterns()]
    undocumented = [k for k in listed if sum(bool(r.match(k)) for r in regexes) != 1]
    assert listed and not undocumented
    assert named <= set(listed)
    assert key_pattern("runs/{run_id}/trainer/").format(run_id=run, version=3, holder="doc-test") in listed
    claim_keys = [k for k in listed if k.startswith(f"claims/{run}/policy/")]
    assert len(claim_keys) == claims
    for key in claim_keys:
        digest = hashlib.sha256(s3.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()
        assert key == key_pattern("claims/").format(run_id=run, kind="policy", sha256_prefix=digest[:2], sha256=digest)


@pytest.mark.integration
async def test_a_forged_claim_check_is_refused_by_the_page_reader(settings):
    """Section 9.4's refusals, on bodies a hostile writer could put on the subject."""
    from pipeline.blobstore import S3BlobStore

    s3 = S3BlobStore(settings.blobs).client
    run, bucket = settings.run_id, settings.blobs.bucket
    inner = json.loads(doc_block("event-json"))
    inner.update(run_id=run)
    body = json.dumps(inner, separators=(",", ":")).encode()
    digest = hashlib.sha256(body).hexdigest()
    key = f"claims/{run}/policy/{digest[:2]}/{digest}"
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    subject = f"rl.{run}.policy.v0"

    def claim(**fields) -> bytes:
        base = {
            "type": "claim_check.v1",
            "run_id": run,
            "event_id": inner["event_id"],
            "schema_version": 1,
            "produced_at": "2025-01-02T03:04:05Z",
            "producer": "x",
            "event_type": "policy_version.v1",
            "uri": f"s3://{bucket}/{key}",
            "sha256": digest,
            "bytes": len(body),
        }
        return json.dumps(base | fields).encode()

    assert resolve_message(s3, bucket, run, subject, claim())["version"] == 0
    with pytest.raises(DocRefusal, match="outside"):
        resolve_message(s3, bucket, run, subject, claim(uri=f"s3://{bucket}/claims/other-run/policy/x"))
    with pytest.raises(DocRefusal, match="outside"):
        resolve_message(s3, bucket, run, subject, claim(uri=f"s3://elsewhere/{key}"))
    with pytest.raises(DocRefusal, match="outside"):
        resolve_message(s3, bucket, run, subject, claim(uri=f"s3://{bucket}/runs/{run}/claims/{run}/policy/x"))
    with pytest.raises(DocRefusal, match="differs from its pointer"):
        resolve_message(s3, bucket, run, subject, claim(sha256="0" * 64))
    with pytest.raises(DocRefusal, match="another event"):
        resolve_message(s3, bucket, run, subject, claim(event_id="someone-else"))
    with pytest.raises(DocRefusal, match="holds version 0"):
        resolve_message(s3, bucket, run, f"rl.{run}.policy.v1", claim())
