"""Our one int4 weight layout, and repacking into it from GPTQ, AWQ, AutoRound and GGUF blocks.

Layout (`W4Weight`), for a linear with K inputs and N outputs, y = x @ W (W is [K, N]):
  qweight  int32 [K // 8, N]   nibble j (bits 4j..4j+3) of row r holds k = 8r + j, unsigned 0..15
  scales   fp16  [K // G, N]
  biases   fp16  [K // G, N]   W[k, n] = q * scales[k // G, n] + biases[k // G, n]
           (fp32 where fp16 cannot hold them exactly: asymmetric zero points, Q4_K mins)
  perm     int64 [K] | None    act-order checkpoints: the kernel reads x[:, perm]

A bias instead of an integer zero point lets one kernel serve every source: symmetric GPTQ
(bias = -8 * scale, exact in fp16), GPTQ/AWQ with zero points (bias = -zero * scale), GGUF Q4_1
and Q4_K (bias = min). The qweight packing along K matches GPTQ's, so coalesced loads along N
stay coalesced. Repacking runs once at load time, in plain torch, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from homelab_llm.errors import HomelabError

SUPPORTED_GROUP_SIZES = (32, 64, 128)
# AWQ stores the 8 nibbles of a word in this column order (an artefact of its CUDA dequant).
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class QuantFormatError(HomelabError, ValueError):
    """A quantized checkpoint we cannot repack; the message says what we accept."""


@dataclass
class W4Weight:
    qweight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None
    # The same weight repacked for torch's CPU int4 kernel (kernels/w4a16_cpu.py), set once at
    # load on the CPU; None elsewhere. Derived data: never narrowed or moved with the rest.
    cpu_pack: Any = None
    # Every bias is -z * scale for an integer z in [-64, 127], exactly (integer_zero_points):
    # GPTQ / AWQ / AutoRound / symmetric / Q4_0 weights, not Q4_1 / Q4_K mins. Lets the few-row
    # kernel hold q - z in registers (GemmTiles.int_zeros). Set by the repacks and again where a
    # linear installs its weight (LinearBase.set_w4: concatenated parts).
    int_zeros: bool = False

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def to(self, device: torch.device | str) -> "W4Weight":
        perm = None if self.perm is None else self.perm.to(device)
        return W4Weight(self.qweight.to(device), self.scales.to(device), self.biases.to(device),
                        self.group_size, perm, int_zeros=self.int_zeros)

    def narrow_out(self, start: int, length: int) -> "W4Weight":
        """Output columns [start, start+length): a column-parallel shard."""
        sl = slice(start, start + length)
        return W4Weight(self.qweight[:, sl].contiguous(), self.scales[:, sl].contiguous(),
                        self.biases[:, sl].contiguous(), self.group_size, self.perm,
                        int_zeros=self.int_zeros)

    def regroup(self, group_size: int) -> "W4Weight":
        """The same weight in finer groups (group_size divides ours): scales repeat, exactly."""
        if group_size == self.group_size:
            return self
        if self.group_size % group_size:
            raise QuantFormatError(f"cannot regroup group size {self.group_size} into {group_size}")
        r = self.group_size // group_size
        return W4Weight(self.qweight, self.scales.repeat_interleave(r, 0),
                        self.biases.repeat_interleave(r, 0), group_size, self.perm,
                        int_zeros=self.int_zeros)

    def narrow_in(self, start: int, length: int) -> "W4Weight":
        """Input rows [start, start+length): a row-parallel shard; must cut on group boundaries."""
        if self.perm is not None:
            raise QuantFormatError("act-order (desc_act) weights cannot be split along the input; "
                                   "use a checkpoint without desc_act for tensor parallelism")
        if start % self.group_size or length % self.group_size:
            raise QuantFormatError(f"input shard [{start}, {start + length}) is not aligned to "
                                   f"group size {self.group_size}")
        g = slice(start // self.group_size, (start + length) // self.group_size)
        return W4Weight(self.qweight[start // 8:(start + length) // 8].contiguous(),
                        self.scales[g].contiguous(), self.biases[g].contiguous(), self.group_size,
                        int_zeros=self.int_zeros)


def integer_zero_points(w: W4Weight) -> bool:
    """Whether every bias is -z * scale for an integer z in [-64, 127], exactly in fp32, with z
    as the few-row kernel computes it (w4a16_dot.zero_point: round(-b / s), z = 0 where s = 0).
    One pass over the scales and biases (1/64 of the weight's bytes at group 128)."""
    s, b = w.scales.float(), w.biases.float()
    z = torch.round(-b / torch.where(s == 0, torch.ones_like(s), s))
    return bool(((z >= -64) & (z <= 127) & (b + z * s == 0)).all())


def _check_group(group_size: int, k: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantFormatError(f"group size {group_size} is not supported (have {SUPPORTED_GROUP_SIZES})")
    if k % group_size:
        raise QuantFormatError(f"in_features {k} is not a multiple of group size {group_size}")


def checkpoint_group_size(group_size: int, k: int) -> int:
    """A checkpoint's group size for a weight with k inputs: -1 (one group per output column)
    becomes k. Any multiple of 32 dividing k is accepted: coarser groups are stored as our
    finest native size that divides them (from_parts repeats their scales; the same numbers)."""
    if group_size in (-1, 0):
        group_size = k
    if group_size <= 0 or group_size % 32:
        raise QuantFormatError(f"group size {group_size} is not supported (have "
                               f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}, any multiple of 32, or -1)")
    if k % group_size:
        raise QuantFormatError(f"in_features {k} is not a multiple of group size {group_size}")
    return group_size


def exact_biases(biases: torch.Tensor) -> torch.Tensor:
    """fp16 when every bias is an fp16 number (symmetric: -8 * scale; Q4_0/Q4_1), else fp32.
    An asymmetric zero point times an fp16 scale needs up to 15 bits of mantissa: rounding it
    to fp16 moves a whole group by up to 2^-11 of its range, the same way for every input, and
    that shows (~3e-3 relative on a 2-layer model's logits) where fp32 would be exact. The cost
    is 2 bytes per group per output (+0.125 bit per weight at group 128)."""
    b = biases.float()
    half = b.half()
    return half if torch.equal(half.float(), b) else b.contiguous()


def _native_group(group_size: int) -> int:
    return next(g for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True) if group_size % g == 0)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[K, N] values 0..15 -> int32 [K // 8, N], nibble j of row r = k 8r + j."""
    k, n = q.shape
    if k % 8:
        raise QuantFormatError(f"in_features {k} is not a multiple of 8")
    q = q.to(torch.int64).view(k // 8, 8, n)
    shifts = (torch.arange(8, device=q.device) * 4).view(1, 8, 1)
    return (q << shifts).sum(dim=1).to(torch.int32)  # bits past 31 wrap into the sign, as intended


def unpack_int4(packed: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of pack_int4 along `dim` (0: rows hold 8 k's each; 1: columns hold 8 n's each)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    if dim == 0:
        nib = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
        return nib.reshape(packed.shape[0] * 8, packed.shape[1]).to(torch.uint8)
    nib = (packed.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF
    return nib.reshape(packed.shape[0], packed.shape[1] * 8).to(torch.uint8)


def from_parts(q_kn: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | float,
               group_size: int, perm: torch.Tensor | None = None) -> W4Weight:
    """q [K, N] 0..15, scales [K/G, N], zeros [K/G, N] (or one number) in integer units.
    A group size above 128 (a multiple of 32) is re-expressed in native groups."""
    return _from_packed(pack_int4(q_kn), scales, zeros, group_size, perm)


def _from_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | float,
                 group_size: int, perm: torch.Tensor | None) -> W4Weight:
    group_size = checkpoint_group_size(group_size, qweight.shape[0] * 8)
    s = scales.float()
    biases = -torch.as_tensor(zeros, dtype=torch.float32, device=s.device) * s
    biases = biases.expand_as(s)
    native = _native_group(group_size)
    if native != group_size:
        s = s.repeat_interleave(group_size // native, dim=0)
        biases = biases.repeat_interleave(group_size // native, dim=0)
        group_size = native
    w = W4Weight(qweight, s.to(torch.float16), exact_biases(biases), group_size, perm)
    w.int_zeros = integer_zero_points(w)
    return w


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                 clips: tuple[float, ...] = (1.0,)) -> W4Weight:
    """Round-to-nearest int4 of an nn.Linear weight [N, K] (dummy weights, tests, the 4-bit LM
    head). clips: range shrink factors tried per group (asymmetric only), each group keeping the
    one whose rounding has the least squared error (AWQ's and llama.cpp's clip search: a group's
    extremes cost the rest resolution); (1.0,) is plain round to nearest."""
    w = weight.float().t().contiguous()  # [K, N]
    k, n = w.shape
    _check_group(group_size, k)
    g = w.view(k // group_size, group_size, n)
    if symmetric:
        scale = (g.abs().amax(dim=1) / 7.0).clamp_min(1e-8)
        zero = torch.full_like(scale, 8.0)
        scale = scale.half().float()  # quantize against the scale the kernel will see
        q = torch.clamp(torch.round(g / scale[:, None]) + zero[:, None], 0, 15)
        return from_parts(q.view(k, n).to(torch.uint8), scale, zero, group_size)
    lo, hi = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)
    best = None
    for clip in clips:
        scale = ((hi - lo) * clip / 15.0).clamp_min(1e-8).half().float()  # the scale the kernel sees
        zero = torch.clamp(torch.round(-lo * clip / scale), 0, 15)
        q = torch.clamp(torch.round(g / scale[:, None]) + zero[:, None], 0, 15)
        err = ((q - zero[:, None]) * scale[:, None] - g).square().sum(dim=1)  # [K/G, N]
        if best is None:
            best = [err, scale, zero, q]
        else:
            take = err < best[0]
            best = [torch.where(take, err, best[0]), torch.where(take, scale, best[1]),
                     torch.where(take, zero, best[2]), torch.where(take[:, None], q, best[3])]
    _, scale, zero, q = best
    return from_parts(q.view(k, n).to(torch.uint8), scale, zero, group_size)


def repack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                group_size: int, g_idx: torch.Tensor | None = None, sym: bool = True,
                zero_offset: bool = True) -> W4Weight:
    """GPTQ 4-bit: qweight int32 [K/8, N] (our packing already), qzeros int32 [K/G, N/8]
    (8 columns per word), scales [K/G, N]. `zero_offset` is the v1 format's quirk: stored zeros
    are one less than the real ones (checkpoint_format "gptq"); "gptq_v2" stores them as is.
    g_idx (act-order) becomes a permutation of the input that makes each group contiguous."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group_size = checkpoint_group_size(group_size, k)
    if tuple(scales.shape) != (k // group_size, n):
        raise QuantFormatError(f"GPTQ scales {tuple(scales.shape)} do not match qweight "
                               f"(expected {(k // group_size, n)})")
    if qzeros is None:
        if not sym:
            raise QuantFormatError("asymmetric GPTQ weight without qzeros")
        zeros: torch.Tensor | float = 8.0
    else:
        zeros = unpack_int4(qzeros, dim=1)[:, :n].float() + (1.0 if zero_offset else 0.0)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        trivial = torch.arange(k, device=g_idx.device) // group_size
        if not torch.equal(g_idx, trivial):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], trivial):
                raise QuantFormatError("GPTQ g_idx does not give every group exactly group_size rows")
            return from_parts(unpack_int4(qweight, dim=0)[perm], scales, zeros, group_size, perm)
    # Without act-order GPTQ's qweight is our packing already: no unpack (and no 8x-sized copy).
    return _from_packed(qweight.to(torch.int32).contiguous(), scales, zeros, group_size, None)


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> W4Weight:
    """AWQ GEMM: qweight int32 [K, N/8] and qzeros [K/G, N/8] with AWQ's interleaved nibble order,
    scales [K/G, N]; zeros stored as is."""
    order = torch.tensor(_AWQ_ORDER, device=qweight.device)
    inverse = torch.argsort(order)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        nib = unpack_int4(packed, dim=1).view(packed.shape[0], -1, 8)  # nibble i = column order[i]
        return nib[:, :, inverse].reshape(packed.shape[0], -1)

    return from_parts(columns(qweight), scales, columns(qzeros).float(), group_size)


# AutoRound's packing_format names (older exports: `backend`). All but the AWQ ones use GPTQ's
# tensor layout; they differ in whether stored zeros are one less than the real ones.
AUTOROUND_GPTQ_V1_PACKINGS = ("auto_round:auto_gptq", "auto_round:gptq", "auto_gptq", "auto")
AUTOROUND_NATIVE_PACKINGS = ("auto_round", "auto_round:gptqmodel", "auto_round:triton",
                             "auto_round:tritonv2", "auto_round:exllamav2", "auto_round:marlin",
                             "auto_round:torch")
AUTOROUND_AWQ_PACKINGS = ("auto_round:auto_awq", "auto_round:awq", "auto_awq")


def autoround_packing(packing_format: str | None) -> str:
    """AutoRound packing_format -> "gptq" (zeros stored minus one, as GPTQ v1), "gptq_v2"
    (zeros as they are: AutoRound's own format) or "awq". auto-round itself exports symmetric
    models as auto_round:auto_gptq and asymmetric ones as auto_round."""
    fmt = (packing_format or "auto_round:auto_gptq").lower()
    # Legacy backend strings name a kernel after the format: auto_round:gptq:exllamav2.
    if fmt in AUTOROUND_GPTQ_V1_PACKINGS or fmt.startswith(("auto_round:gptq:", "auto_gptq:")):
        return "gptq"
    if fmt in AUTOROUND_NATIVE_PACKINGS:
        return "gptq_v2"
    if fmt in AUTOROUND_AWQ_PACKINGS or fmt.startswith("auto_round:awq:"):
        return "awq"
    raise QuantFormatError(
        f"AutoRound packing_format {packing_format!r} is not supported (have: "
        f"{', '.join(AUTOROUND_GPTQ_V1_PACKINGS + AUTOROUND_NATIVE_PACKINGS + AUTOROUND_AWQ_PACKINGS)})")


def repack_autoround(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                     group_size: int, packing_format: str = "auto_round", sym: bool = True,
                     g_idx: torch.Tensor | None = None) -> W4Weight:
    """AutoRound int4 weights, in GPTQ's layout or AWQ's as packing_format says."""
    packing = autoround_packing(packing_format)
    if packing == "awq":
        if qzeros is None:
            raise QuantFormatError("AutoRound AWQ packing needs qzeros")
        return repack_awq(qweight, qzeros, scales, group_size)
    return repack_gptq(qweight, qzeros, scales, group_size, g_idx, sym,
                       zero_offset=packing == "gptq")


# --- GGUF ------------------------------------------------------------------------------------------

_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_GGUF_BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _gguf_groups(raw: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [N, bytes_per_row] -> (q [N, K] 0..15, scale [N, K/32], bias [N, K/32]), float32."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, _GGUF_BLOCK_BYTES[ggml_type])
    if ggml_type in ("Q4_0", "Q4_1"):
        d = _f16(blocks[..., 0:2])
        qs = blocks[..., -16:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # value j and j + 16 share byte j
        bias = -8.0 * d if ggml_type == "Q4_0" else _f16(blocks[..., 2:4])
        return q.reshape(n, -1), d, bias
    # Q4_K: 8 sub-blocks of 32 per 256, each with a 6-bit scale and min scaled by d and dmin.
    d = _f16(blocks[..., 0:2]).unsqueeze(-1)
    dmin = _f16(blocks[..., 2:4]).unsqueeze(-1)
    sc = blocks[..., 4:16].to(torch.int32)
    low_sc, low_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    high_sc = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    high_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    scale = d * torch.cat([low_sc, high_sc], dim=-1).float()
    bias = -dmin * torch.cat([low_m, high_m], dim=-1).float()
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes; each holds 2 sub-blocks
    q = torch.stack([qs & 0xF, qs >> 4], dim=3)  # [n, blocks, 4, 2, 32]
    return q.reshape(n, -1), scale.reshape(n, -1), bias.reshape(n, -1)


def repack_gguf(raw: np.ndarray | torch.Tensor, ggml_type: str, shape: tuple[int, int],
                row_order: np.ndarray | None = None, rows: slice = slice(None),
                cols: slice = slice(None), device: torch.device | str | None = None) -> W4Weight:
    """GGUF Q4_0 / Q4_1 / Q4_K blocks ([out_features, bytes_per_row], GGUF row order) -> group-32
    W4Weight of the HF-ordered weight, optionally one rank's rows/cols shard of it."""
    if ggml_type not in _GGUF_BLOCK_BYTES:
        raise QuantFormatError(f"GGUF type {ggml_type} cannot be repacked to W4A16 (have: "
                               f"{', '.join(_GGUF_BLOCK_BYTES)})")
    n, k = shape
    t = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    t = t.to(device=device, dtype=torch.uint8)
    if t.shape[0] != n or t.shape[1] * _GGUF_BLOCK_VALUES[ggml_type] != k * _GGUF_BLOCK_BYTES[ggml_type]:
        raise QuantFormatError(f"GGUF {ggml_type} blocks {tuple(t.shape)} do not match shape {shape}")
    if row_order is not None:
        t = t[torch.as_tensor(row_order, device=t.device)]
    t = t[rows]
    q, scale, bias = _gguf_groups(t, ggml_type)
    c0 = cols.start or 0
    c1 = k if cols.stop is None else cols.stop
    if c0 % 32 or c1 % 32:
        raise QuantFormatError(f"GGUF input shard [{c0}, {c1}) is not aligned to 32")
    q, scale, bias = q[:, c0:c1], scale[:, c0 // 32:c1 // 32], bias[:, c0 // 32:c1 // 32]
    w = W4Weight(pack_int4(q.t().contiguous()), scale.t().contiguous().half(),
                 exact_biases(bias.t().contiguous()), 32)
    w.int_zeros = integer_zero_points(w)  # Q4_0 (-8 d): yes; Q4_1 / Q4_K mins: no
    return w
