"""4-bit and 8-bit weight matmuls for x86-64 CPUs with AVX2: our C kernel (q4_cpu.c).

Why: torch's CPU int4 kernel (w4a16_cpu.py) has a fast AVX-512 path, but on an AVX2-only CPU it
took 12-14 ms of a SmolLM2-135M decode token at 2 threads, 75% of the step (docs/BENCHMARKS.md
52.4), and torch 2.13 has nothing faster that keeps the CPU default's accuracy. This is the
scheme llama.cpp runs on such CPUs (written from the formats, not from its code):
- a weight keeps its codes and one fp16 scale (4-bit: also one fp16 offset) per 32 inputs, as a
  GGUF Q4_1 / Q8_0 block: 20 bytes per 32 4-bit weights (Q4_BLOCK), 34 per 32 int8 (Q8_BLOCK);
- each activation row is quantized per 32 inputs to int8 with one fp32 scale (absmax / 127,
  round to nearest), and the block sums sum(q) are kept for the 4-bit offsets;
- a block's dot product is 32 byte products summed in integers (vpmaddubsw, vpmaddwd), then
  scaled once: sum(d_w d_x q_w q_x) + m_w d_x sum(q_x); fp32 accumulation.
The only rounding beyond the weight format is the activations' int8 grid: per block, at most
d_x / 2 = absmax / 254 per element. tests/engine/test_q4_native.py bounds a matmul's relative
error against the exact product of the same weights (< 1.5e-2, observed ~5e-3 on Gaussian
inputs); test_cpu_default.py bounds the whole model against the exact fp32 path.
Speed (BENCHMARKS 53, 2 threads, AVX2 EPYC): SmolLM2's gate_up at one row 44-52 us against
torch's int4 kernel's 131-148; with the C attention call (decode_attention_native.py) the CPU
default decodes at 1.05-1.08x llama.cpp in the same runs (0.35x before).

Output rows are split over torch's OpenMP team (native_build.py). The library is built once per
machine with the system's C compiler; without a compiler, on another architecture, on a CPU
without AVX2/FMA/F16C, or with HOMELAB_LLM_CPU_NATIVE=0, `available()` is False and the callers
keep torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from homelab_llm.engine.kernels import native_build

SOURCE = Path(__file__).with_name("q4_cpu.c")
HEADERS = (Path(__file__).with_name("cpu_simd.h"),)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
QK = 32
GROUP = 8  # blocks whose scales sit together (q4_cpu.c)
Q4_BLOCK_BYTES, Q8_BLOCK_BYTES = 20, 34
_CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_supports() -> bool:
    """x86-64 Linux with AVX2, FMA and F16C (read from /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return all(f in have for f in _CPU_FLAGS)
    return False


class QCall(ctypes.Structure):
    """q_matmul's arguments as one struct (q4_cpu.c's q_call): a call bound once
    (NativeLinear.bind) costs ~1 us of ctypes instead of ~4.5 for 13 arguments."""

    _fields_ = [("bits", ctypes.c_int64), ("w", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("x", ctypes.c_void_p), ("m", ctypes.c_int64),
                ("ldx", ctypes.c_int64), ("y", ctypes.c_void_p), ("ldy", ctypes.c_int64),
                ("accumulate", ctypes.c_int64), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_double),
                ("swiglu", ctypes.c_int64)]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (not this CPU, no compiler, or the build failed)."""
    if not cpu_supports():
        return None
    lib = native_build.load(SOURCE, FLAGS, HEADERS)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int, ptr,
                             ctypes.c_float, ctypes.c_int]
    lib.q_matmul.restype = ctypes.c_int
    lib.q_matmul_call.argtypes, lib.q_matmul_call.restype = [ctypes.POINTER(QCall)], ctypes.c_int
    lib.layout.argtypes, lib.layout.restype = [ctypes.c_int], i64
    if (lib.layout(0), lib.layout(1), lib.layout(2), lib.layout(3)) != (
            QK, GROUP, 8 * GROUP + QK * GROUP, ctypes.sizeof(QCall)):
        return None
    return lib


def _switched_off() -> bool:
    return os.environ.get("HOMELAB_LLM_CPU_NATIVE", "1") in ("0", "off", "false")


def available() -> bool:
    """Whether the native kernels run here and are wanted (HOMELAB_LLM_CPU_NATIVE=0: not)."""
    return not _switched_off() and library() is not None


def unavailable_reason() -> str | None:
    if _switched_off():
        return "HOMELAB_LLM_CPU_NATIVE=0"
    if not cpu_supports():
        return "not an x86-64 CPU with AVX2, FMA and F16C"
    return None if library() is not None else native_build.last_error(SOURCE) or "build failed"


@dataclass
class NativeWeight:
    """[N, K] weight as N rows of K / 32 blocks (Q4_BLOCK_BYTES or Q8_BLOCK_BYTES each)."""

    blocks: torch.Tensor  # uint8 [N, K / 32 * block bytes]
    bits: int  # 4 or 8
    out_features: int
    in_features: int


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, B] -> uint8 [N, 2B]: each value's fp16 bytes."""
    return t.to(torch.float16).contiguous().view(torch.uint8)


def _grouped(n: int, nb: int, parts) -> torch.Tensor:
    """uint8 [N, row bytes]: for each group of up to GROUP blocks, parts(blocks slice) (a list of
    uint8 [N, bytes] pieces) side by side."""
    groups = []
    for g0 in range(0, nb, GROUP):
        groups.extend(parts(slice(g0, min(g0 + GROUP, nb))))
    return torch.cat(groups, dim=1).contiguous()


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> NativeWeight:
    """codes [N, K] in 0..15, scales and offsets [N, K / 32] (w = code * scale + offset; rounded
    to fp16) -> a 4-bit NativeWeight: per group, the scales, the offsets, then 16 code bytes a
    block (byte j: code j low, code j + 16 high), a pair of blocks' bytes interleaved 4 at a time
    (q4_cpu.c)."""
    n, k = codes.shape
    if k % QK or scales.shape != (n, k // QK) or offsets.shape != scales.shape:
        raise ValueError(f"4-bit pack needs K % {QK} == 0 and [N, K/32] scales, got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}, {tuple(offsets.shape)}")
    q = codes.to(torch.uint8).view(n, k // QK, QK)
    nibbles = q[..., : QK // 2] | (q[..., QK // 2:] << 4)

    def parts(sl: slice) -> list[torch.Tensor]:
        group = nibbles[:, sl]  # [N, r, 16]
        pairs = group.shape[1] // 2
        # a pair's 2 x 16 bytes interleaved 4 at a time: [b 0-3][b+1 0-3][b 4-7][b+1 4-7]...
        paired = group[:, : 2 * pairs].reshape(n, pairs, 2, 4, 4).transpose(2, 3).reshape(n, -1)
        return [_half_bytes(scales[:, sl]), _half_bytes(offsets[:, sl]), paired,
                group[:, 2 * pairs:].reshape(n, -1)]

    return NativeWeight(_grouped(n, k // QK, parts), 4, n, k)


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> NativeWeight:
    """codes [N, K] in -127..127, scales [N, K / 32] (w = code * scale) -> an 8-bit NativeWeight:
    per group, the scales, then 32 code bytes a block."""
    n, k = codes.shape
    if k % QK or scales.shape != (n, k // QK):
        raise ValueError(f"8-bit pack needs K % {QK} == 0 and [N, K/32] scales, got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    q = codes.to(torch.int8).view(torch.uint8).view(n, k // QK, QK)
    blocks = _grouped(n, k // QK, lambda sl: [_half_bytes(scales[:, sl]), q[:, sl].reshape(n, -1)])
    return NativeWeight(blocks, 8, n, k)


def matmul_into(x: torch.Tensor, w: NativeWeight, out: torch.Tensor, accumulate: bool = False,
                norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False) -> torch.Tensor:
    """out [M, N] = (or +=, accumulate) x [M, K] @ W^T; x and out fp32 with unit inner stride.
    norm: an fp32 [K] RMSNorm weight: each row of x is normalized (x / rms(x) * norm, eps) first.
    swiglu: x is [M, 2K], gate then up, and the product takes silu(gate) * up (not with norm)."""
    k = w.in_features * (2 if swiglu else 1)
    if x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(-1) != 1 or out.stride(-1) != 1 \
            or x.shape[1] != k or out.shape != (x.shape[0], w.out_features) or (norm is not None and (
                swiglu or norm.dtype != torch.float32 or norm.shape != (w.in_features,) or not norm.is_contiguous())):
        raise ValueError(f"native matmul: x {tuple(x.shape)} {x.dtype}, out {tuple(out.shape)} {out.dtype} "
                         f"for a {w.out_features}x{w.in_features} weight (fp32, unit inner stride; "
                         f"a norm weight: fp32 [K], not with swiglu)")
    if library().q_matmul(w.bits, w.blocks.data_ptr(), w.out_features, w.in_features, x.data_ptr(),
                          x.shape[0], x.stride(0), out.data_ptr(), out.stride(0), int(accumulate),
                          None if norm is None else norm.data_ptr(), eps, int(swiglu)) != 0:
        raise MemoryError("native matmul: no memory for the activation scratch")
    return out


def matmul(x: torch.Tensor, w: NativeWeight) -> torch.Tensor:
    """x [..., K] (any float dtype) @ W^T -> [..., N] in x's dtype."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation has {x.shape[-1]} features, weight expects {w.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).to(torch.float32).contiguous()
    out = torch.empty(x2.shape[0], w.out_features)
    if x2.shape[0]:
        matmul_into(x2, w, out)
    return out.to(x.dtype).view(*lead, w.out_features)


class NativeLinear:
    """One weight bound for the decode loop (model/cpu_decode_layer.py): calling it with x [M, K]
    and out [M, N] (fp32, unit inner stride) sets or adds x @ W^T into out, with the pointer and
    sizes looked up once; with norm (an fp32 [K] RMSNorm weight, eps given here), each row of x
    is normalized first, inside the same call; with swiglu, x [M, 2K] holds gate then up and the
    product takes silu(gate) * up."""

    __slots__ = ("weight", "fn", "bits", "ptr", "n", "k", "eps")

    def __init__(self, weight: NativeWeight, eps: float = 0.0):
        self.weight = weight  # keeps the blocks alive
        self.fn, self.bits, self.eps = library().q_matmul, weight.bits, eps
        self.ptr, self.n, self.k = weight.blocks.data_ptr(), weight.out_features, weight.in_features

    def bind(self, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
             norm: torch.Tensor | None = None, swiglu: bool = False) -> QCall:
        """The call __call__ makes, as a struct for library().q_matmul_call: valid while x, out
        and norm keep their storage (the caller holds them)."""
        return QCall(self.bits, self.ptr, self.n, self.k, x.data_ptr(), x.shape[0], x.stride(0),
                     out.data_ptr(), out.stride(0), int(accumulate),
                     None if norm is None else norm.data_ptr(), self.eps, int(swiglu))

    def __call__(self, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
                 norm: torch.Tensor | None = None, swiglu: bool = False) -> None:
        if self.fn(self.bits, self.ptr, self.n, self.k, x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr(),
                   out.stride(0), accumulate, None if norm is None else norm.data_ptr(), self.eps, swiglu):
            raise MemoryError("native matmul: no memory for the activation scratch")
