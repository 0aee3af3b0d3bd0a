"""A shard on disk patched where it lies (`pipeline/shard_patch.py`), and the safetensors layout that makes
it possible (`pipeline/safetensors_layout.py`): bit-exact against the safetensors library's own reading,
only changed tensors' bytes touched, and every hostile header or patch ending in a clear error with
nothing written."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline import patch_codec
from pipeline.bits import checksum, dtype_name, to_bits
from pipeline.patch_codec import TensorBits
from pipeline.safetensors_layout import ShardLayoutError, hash_shard, mapped_tensors, read_layout
from pipeline.shard_patch import PatchRefused, PatchStep, PatchUnreadable, WrongBits, patch_shard


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(300, generator=g).to(torch.float8_e4m3fn),
        "b.weight_scale_inv": torch.rand(3, generator=g),
        "c.bias": torch.randn(17, generator=g).to(torch.bfloat16),
        "frozen.weight": torch.randn(40, 8, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, dtype=torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def _step(tensors: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    """A few elements of each trainable tensor change (as a small optimizer step does to served bits)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        if t.is_floating_point() and t.numel() and not name.startswith("frozen"):
            flat = t.view(-1)
            mask = torch.rand(flat.shape, generator=g) < rate
            mask[0] = True
            flat[mask] = (flat[mask].float() * 1.3 + 0.01).to(t.dtype)
        out[name] = t
    return out


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, TensorBits]:
    return {n: TensorBits(dtype_name(t.dtype), tuple(t.shape), to_bits(t).copy()) for n, t in tensors.items()}


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: checksum(to_bits(t)) for n, t in tensors.items()}


def _patch(base, target, label="patch v0->v1") -> PatchStep:
    data = patch_codec.encode(_bits(base), _bits(target))
    header, payload = patch_codec.read_header(data)
    return PatchStep(label, header, payload, _digests(target))


def _shard(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "model-00001-of-00001.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and np.array_equal(to_bits(a[n]), to_bits(b[n]))
        for n in a
    )


# ---------------------------------------------------------------- the layout


def test_the_layout_is_where_safetensors_reads_each_tensor(tmp_path):
    tensors = _tensors()
    path = _shard(tmp_path, tensors)
    layout = read_layout(path)
    assert set(layout.tensors) == set(tensors)
    raw = path.read_bytes()
    for name, span in layout.tensors.items():
        assert span.dtype == dtype_name(tensors[name].dtype) and span.shape == tuple(tensors[name].shape)
        assert raw[span.begin : span.end] == to_bits(tensors[name]).tobytes() and span.aligned
    assert hash_shard(layout) == _digests(tensors)
    with mapped_tensors(layout, writable=True) as mapped:
        mapped.prefault_for_writes("a.weight")
        mapped.arrays["a.weight"][3] ^= 0x00FF  # written through the mapping ...
    assert to_bits(_read(path)["a.weight"])[3] == to_bits(tensors["a.weight"])[3] ^ 0x00FF  # ... is in the file


def _file(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(body) if length is None else length) + body + data


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x01\x02", "shorter than the header length"),
        (_file({}, length=10_000), "does not fit a file"),
        (_file(b"{not json"), "unreadable header"),
        (_file([1, 2]), "not a JSON object"),
        (_file({"t": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]}}, b"\0" * 8), "do not hold"),
        (_file({"t": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 4), "past the file"),
        (_file({"t": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8), "malformed entry"),
        (_file({"t": {"dtype": "BF16", "shape": [-4], "data_offsets": [0, 8]}}, b"\0" * 8), "do not hold"),
        (_file({"t": {"dtype": "BF16", "shape": [4]}}, b"\0" * 8), "malformed entry"),
        # two tensors sharing bytes: a write into one would change the other unseen
        (
            _file(
                {
                    "t": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
                    "u": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]},
                },
                b"\0" * 8,
            ),
            "overlap",
        ),
        (
            _file(
                {
                    "t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                    "u": {"dtype": "BF16", "shape": [2], "data_offsets": [6, 10]},
                },
                b"\0" * 10,
            ),
            "leave a gap",
        ),
        (_file({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8), "the file at"),
    ],
)
def test_a_header_that_does_not_describe_its_file_is_refused(tmp_path, content, says):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ShardLayoutError, match=says):
        read_layout(path)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_shard_that_is_a_link_is_neither_read_nor_mapped(tmp_path, link):
    """An in-place write through a link would land in a file outside the directory being built."""
    real = _shard(tmp_path, _tensors())
    layout = read_layout(real)
    shard = tmp_path / "linked.safetensors"
    if link == "symlink":
        shard.symlink_to(real)
    else:
        os.link(real, shard)
    with pytest.raises(ShardLayoutError, match="symlink" if link == "symlink" else "2 links"):
        read_layout(shard)
    before = real.read_bytes()
    # even with a layout read before the link was made
    with pytest.raises(ShardLayoutError), mapped_tensors(replace(layout, path=shard), writable=True):
        pass
    assert real.read_bytes() == before


def test_an_unaligned_tensor_is_read_and_hashed_but_not_patched_in_place(tmp_path):
    data = bytes(range(1, 10))  # a 1-byte tensor first puts the bf16 one at an odd offset
    header = {
        "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [1, 9]},
    }
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(_file(body, data))
    layout = read_layout(path)
    assert not layout.tensors["b"].aligned and layout.tensors["a"].aligned
    assert hash_shard(layout)["b"] == xxhash.xxh3_128_hexdigest(data[1:9])


# ---------------------------------------------------------------- patching


def test_patches_applied_in_place_are_bit_exact_and_touch_only_changed_tensors(tmp_path):
    v0 = _tensors()
    v1 = _step(v0, 0.05, 1)
    v2 = _step(v1, 0.05, 2)
    path = _shard(tmp_path, v0)
    layout, before = read_layout(path), path.read_bytes()
    digests = _digests(v0)
    done = patch_shard(path, [_patch(v0, v1), _patch(v1, v2, "patch v1->v2")], digests)
    assert done.in_place and _same(_read(path), v2) and digests == _digests(v2)
    assert done.changed == {"a.weight", "b.weight", "b.weight_scale_inv", "c.bias"}
    after = path.read_bytes()
    # the header and every unchanged tensor's bytes are as they were: nothing else was rewritten
    first = min(s.begin for s in layout.tensors.values())
    assert after[:first] == before[:first]
    for name in ("frozen.weight", "steps", "empty"):
        span = layout.tensors[name]
        assert after[span.begin : span.end] == before[span.begin : span.end]


def test_a_patch_whose_base_is_not_the_bits_there_is_refused_before_writing(tmp_path):
    v0 = _tensors()
    v1 = _step(v0, 0.05, 1)
    path = _shard(tmp_path, v0)
    before = path.read_bytes()
    # a patch made against other bits than the shard's (v1 -> v2, applied to v0)
    with pytest.raises(PatchRefused, match="base of patch v1->v2 does not match") as info:
        patch_shard(path, [_patch(v1, _step(v1, 0.05, 2), "patch v1->v2")], _digests(v0))
    assert info.value.step == 0 and path.read_bytes() == before


def test_a_patch_that_disagrees_with_its_version_is_refused_before_writing(tmp_path):
    v0 = _tensors()
    v1 = _step(v0, 0.05, 1)
    path = _shard(tmp_path, v0)
    before = path.read_bytes()
    step = _patch(v0, v1)
    forged = PatchStep(step.label, step.header, step.payload, {**step.target_digests, "c.bias": "0" * 32})
    with pytest.raises(PatchRefused, match=r"makes tensor c\.bias"):
        patch_shard(path, [forged], _digests(v0))
    assert path.read_bytes() == before
    # a second step failing names its index; the first step's changes are the caller's to drop
    with pytest.raises(PatchRefused) as info:
        patch_shard(
            path, [step, PatchStep("patch v1->v2", step.header, step.payload, step.target_digests)], _digests(v0)
        )
    assert info.value.step == 1


def test_a_damaged_patch_never_passes_for_the_version(tmp_path):
    v0 = _tensors()
    v1 = _step(v0, 0.3, 1)
    data = bytearray(patch_codec.encode(_bits(v0), _bits(v1)))
    header, payload = patch_codec.read_header(bytes(data))
    data[len(data) - len(payload) + len(payload) // 2] ^= 0x10  # one bit of the payload
    header, payload = patch_codec.read_header(bytes(data))
    path = _shard(tmp_path, v0)
    try:
        patch_shard(path, [PatchStep("patch v0->v1", header, payload, _digests(v1))], _digests(v0))
    except (PatchUnreadable, WrongBits):
        return
    assert _same(_read(path), v1)  # no error: then the flipped bit was one the decoder does not use


def test_wrong_bits_from_the_shard_itself_are_told_apart_from_a_bad_later_step(tmp_path):
    v0 = _tensors()
    v1 = _step(v0, 0.05, 1)
    altered = {**v0, "a.weight": v0["a.weight"].clone()}
    altered["a.weight"].view(-1)[-1] += 1  # the shard is not quite what its digests say
    path = _shard(tmp_path, altered)
    with pytest.raises(WrongBits) as info:
        patch_shard(path, [_patch(v0, v1)], _digests(v0))
    assert info.value.tensor == "a.weight" and info.value.from_start


def test_a_patch_that_changes_a_shape_rewrites_the_shard(tmp_path):
    v0 = _tensors()
    v1 = {**_step(v0, 0.05, 1), "c.bias": torch.randn(19).to(torch.bfloat16)}  # a tensor grown
    path = _shard(tmp_path, v0)
    digests = _digests(v0)
    done = patch_shard(path, [_patch(v0, v1)], digests)
    assert not done.in_place and _same(_read(path), v1) and digests == _digests(v1)
    assert read_layout(path).tensors["c.bias"].shape == (19,)
