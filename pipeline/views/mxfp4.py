"""The `mxfp4` view: linear projections in OCP MX FP4 (E2M1 elements, one E8M0 scale per 32), the rest bf16.

Format: OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, 2023). A block is
32 consecutive elements along a linear weight's INPUT dimension (the last dim of `[out, in]`);
each element is FP4 E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; emax_elem = 2),
the block shares one E8M0 scale X = 2^(byte - 127), byte 0xFF = NaN.

Rounding rule implemented (MX v1.0 §6.3, "Conversion from vector of scalar floats to an MX block"):

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem          (emax_elem = 2 for E2M1)
    shared_exp clamped to the E8M0 range [-127, 127]
    X = 2^shared_exp
    P_i = quantize_to_E2M1(V_i / X)   round to nearest, ties to even; |V_i / X| above the largest
                                      normal (6.0) saturates to ±6

Computed exactly from the fp32 value of each weight (as the fp8 view, master weights are fp32; bf16
widens exactly): floor(log2) from `torch.frexp` (no float log), V/X by `torch.ldexp` (a power-of-two
scaling: exact in fp32 unless P falls below 2^-126, where it rounds to 0 whatever its low bits), the
E2M1 rounding by comparisons with the midpoints between codes (ties to the even mantissa). All in
fp32 and comparisons on purpose: torch's float64 ops and `round` run ~1000x slower on small tensors
under a loaded thread pool. The sign of each element is kept, as an IEEE cast keeps it (a small
negative value rounds to -0, code 8). Two cases the spec leaves to us:
- an all-zero block gets scale byte 0 (2^-127) and zero codes (its log2 is -inf);
- a block holding NaN or ±inf gets scale byte 0xFF (the E8M0 NaN; the spec reads a NaN scale as
  every element of the block NaN) and zero codes, so every element dequantizes to NaN. Our choice
  for a case §6.3's algorithm does not spell out; master weights never hold either, this only keeps
  a corrupt master from being served as finite numbers.

What stays bf16: embeddings, lm_head, norms, MoE routers (the family's `disk_router`: `mlp.gate`,
Mixtral's `block_sparse_moe.gate`, GPT-OSS's `mlp.router`), GPT-OSS's fused 3-D experts, exactly what
the fp8 view keeps (`pipeline.views.linears`), as serving stacks do; and any linear whose input dim is
not a multiple of 32 (it has no whole blocks; no registered family has one, and the config's `exclude`
does not list it). With the model's config (`config_overrides(model_config)`), `exclude` names
lm_head, every MoE layer's router and GPT-OSS's experts exactly, module by module: vLLM's and
SGLang's Quark `exclude` matches an entry only by equality or as a `re:` regex, so a glob such as
`*mlp.gate` (what a caller that gives no config still gets) excludes nothing there.

GPT-OSS's experts stay bf16 because their established 4-bit layout is OpenAI's own MXFP4
(`gate_up_proj_blocks [E, 2I, H/32, 16]`, `gate_up_proj_scales [E, 2I, H/32]`, quant_method "mxfp4",
transformers' integrations/mxfp4.py), not Quark's, and the reference engine reads neither it nor
3-D quantized tensors.

On-disk layout (matched to AMD Quark's MXFP4 export, which vLLM and SGLang load through their
`quark` quantization method, scheme `QuarkW4A4MXFP4`: `weight` uint8 `[out, in/2]`, `weight_scale`
uint8 `[out, in/32]` (its `create_weights`); the emulation path's `mxfp4_to_f32` unpacks element 2j
from the low nibble, 2j+1 from the high one, and `e8m0_to_f32` is 2^(byte-127), 0xFF NaN. Read in
vLLM/SGLang sources through a code search, not run):

    <name>.weight        uint8 [out, in/2]   two E2M1 codes a byte, element 2j in the low nibble
    <name>.weight_scale  uint8 [out, in/32]  E8M0 shared scale of each block of 32

Not verified here (no GPU engine in this repository's default tests): that a current vLLM/SGLang
loads this config end to end. Quark's MXFP4 scheme in vLLM is W4A4 (activations quantized to MXFP4
on the fly as well); the reference engine computes with the dequantized weights and bf16
activations, i.e. weight-only numerics.
"""

from __future__ import annotations

import torch

from pipeline.views import View, register_view
from pipeline.views.bf16 import cast_bf16
from pipeline.views.layout import disk_layout
from pipeline.views.linears import is_quantized_linear, unquantized_modules

MX_BLOCK = 32
E2M1_EMAX = 2
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SIGN_BIT = 0x8

LEGACY_EXCLUDE = ["lm_head", "*mlp.gate"]
"""The exclusion list of a caller that gives no model config: Quark's fnmatch patterns for Qwen3-MoE."""

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""The magnitude of codes 0..7; code | 8 is the negative."""

_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Halfway between E2M1 codes i and i+1."""
_TIES_ROUND_UP = (0.75, 1.75, 3.5)
"""The midpoints whose upper neighbour has the even mantissa (codes 2, 4, 6: 1.0, 2.0, 4.0)."""


def round_to_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """|P| (fp32, >= 0) -> the E2M1 code 0..7: round to nearest, ties to even, saturating at 6.

    The code is the number of midpoints |P| lies above, plus one where |P| is exactly a midpoint whose
    upper neighbour is the even one (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4). Above 5 every value is code 7 (6.0): saturation needs no clamp. Comparisons only, so
    exact, and fast on small tensors (torch's `round` and `bucketize` are not, under a loaded thread pool).
    """
    code = torch.zeros(magnitude.shape, dtype=torch.uint8)
    for midpoint in _MIDPOINTS:
        code += magnitude > midpoint if midpoint not in _TIES_ROUND_UP else magnitude >= midpoint
    return code


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D `[out, in]` weight (in % 32 == 0) -> (uint8 packed codes `[out, in/2]`, uint8 E8M0 scales `[out, in/32]`)."""
    rows, cols = weight.shape
    if cols % MX_BLOCK:
        raise ValueError(f"input dim {cols} is not a multiple of the MX block ({MX_BLOCK})")
    blocks = weight.detach().to("cpu", torch.float32).reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN propagates, inf stays inf
    _, exponent = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    shared = (exponent.to(torch.int32) - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    zero = amax == 0
    special = ~torch.isfinite(amax)
    shared = torch.where(zero | special, torch.full_like(shared, -E8M0_BIAS), shared)
    scaled = torch.ldexp(blocks, (-shared)[..., None])  # V / X, exact: a power-of-two scaling
    codes = round_to_e2m1(scaled.abs())  # NaN/inf blocks get zero codes below
    codes = codes | (torch.signbit(blocks).to(torch.uint8) * SIGN_BIT)
    codes = torch.where(special[..., None], torch.zeros_like(codes), codes)
    scale = (shared + E8M0_BIAS).to(torch.uint8)
    scale = torch.where(special, torch.full_like(scale, E8M0_NAN), scale)
    return pack_nibbles(codes.reshape(rows, cols)), scale.contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[..., 2n]` (each 0..15) -> bytes `[..., n]`: element 2j low nibble, 2j+1 high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: bytes `[..., n]` -> codes `[..., 2n]`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> their fp32 values (code 8 is -0.0), built from the bits: code `s ee m` is
    (-1)^s 2^(ee-1) (1 + m/2) for ee >= 1, (-1)^s m/2 for ee = 0 (E2M1, bias 1). Integer ops, not a
    table lookup: indexing is slow on small tensors under a loaded thread pool."""
    c = codes.to(torch.int32)
    exponent, mantissa, sign = (c >> 1) & 0x3, c & 0x1, (c >> 3) & 0x1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    subnormal = mantissa * (126 << 23)  # 0.5 or 0
    return ((sign << 31) | torch.where(exponent == 0, subnormal, normal)).to(torch.int32).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> fp32 2^(byte - 127), built from its bits (exact): byte b >= 1 is the fp32 with
    biased exponent b and no mantissa, byte 0 the subnormal 2^-127, 0xFF NaN."""
    byte = scale.to(torch.int32)
    bits = torch.where(byte == 0, 1 << 22, torch.where(byte == E8M0_NAN, 0x7FC00000, byte << 23))
    return bits.to(torch.int32).view(torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(uint8 `[out, in/2]`, uint8 `[out, in/32]`) -> fp32 `[out, in]`, exactly code value * 2^(byte-127)."""
    return dequantize_codes(unpack_nibbles(packed), scale)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Unpacked codes `[out, in]` with their scales -> fp32 (every product is exact in fp32)."""
    rows, cols = codes.shape
    if scale.shape != (rows, cols // MX_BLOCK) or cols % MX_BLOCK:
        raise ValueError(f"MXFP4 scales {tuple(scale.shape)} do not fit codes {(rows, cols)} in blocks of {MX_BLOCK}")
    values = decode_e2m1(codes).view(rows, cols // MX_BLOCK, MX_BLOCK)
    return (values * e8m0_to_float(scale)[..., None]).view(rows, cols)


def is_mxfp4_linear(name: str, tensor: torch.Tensor, model_type: str | None = None) -> bool:
    """The fp8 view's linears whose input dim holds whole MX blocks; the rest stays bf16."""
    return is_quantized_linear(name, tensor, model_type) and tensor.shape[-1] % MX_BLOCK == 0


class MXFP4View(View):
    name = "mxfp4"

    def tensors(self, state_dict, *, tie_word_embeddings=False, model_type=None):
        for name, tensor in disk_layout(state_dict, tie_word_embeddings=tie_word_embeddings, model_type=model_type):
            if is_mxfp4_linear(name, tensor, model_type):
                packed, scale = quantize_mxfp4(tensor)
                yield name, packed
                yield name.removesuffix("weight") + "weight_scale", scale
            else:
                yield name, cast_bf16(tensor)

    def config_overrides(self, model_config=None):
        # Quark's config as vLLM/SGLang's QuarkConfig._is_mx_fp4 reads it: fp4 weights, per_group 32,
        # e8m0 scales, static; activations fp4 dynamic per_group 32 (the W4A4 scheme they implement).
        group = {"dtype": "fp4", "qscheme": "per_group", "group_size": MX_BLOCK, "ch_axis": -1, "scale_format": "e8m0"}
        return {
            **super().config_overrides(model_config),
            "quantization_config": {
                "quant_method": "quark",
                "global_quant_config": {
                    "weight": {**group, "is_dynamic": False, "round_method": "half_even"},
                    "input_tensors": {**group, "is_dynamic": True},
                    "output_tensors": None,
                    "bias": None,
                },
                "layer_quant_config": {},
                "layer_type_quant_config": {},
                "exclude": LEGACY_EXCLUDE if model_config is None else unquantized_modules(model_config),
                "export": {"pack_method": "reorder", "weight_format": "real_quantized"},
            },
        }


register_view(MXFP4View())
