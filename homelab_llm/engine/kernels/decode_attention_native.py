"""The attention of a CPU step's few new tokens in one C call (decode_attention_cpu.c).

Why: in the CPU decode plan (model/cpu_decode_layer.py) the torch path takes ~8 ops a layer
around attention (the rotation as a matmul, two index_copy_ into the cache, strided views or a
page gather, SDPA, a copy out), ~2.3 ms of a SmolLM2 token at 2 threads on an AVX2 EPYC (torch
profiler: SDPA alone 33-42 us a call for a few dozen positions), more than the 4-bit matmuls of
the same layers took after kernels/q4_native.py; a speculative verify step or a batch of
sequences took the general path's gathers and SDPA per sequence. This does it in one call for
all of a step's rows (up to the plan's row limit): add the qkv projection's bias (Qwen2) and
normalize each q / k head (Qwen3's RMSNorm) where the model has them, rotate q and k
(rotate-half RoPE from each row's cos | sin row), store k and v at each row's slot, then attend
each row over its sequence's pages up to its own position (causal across a sequence's rows),
the query heads of a KV head reading each key and value row once; positions in chunks of 256,
(row, KV head, chunk) tasks on torch's OpenMP team when there is enough work, merged by their
maxima. fp32 throughout; the
exponential is a polynomial (~1e-7 relative), so the result is the torch path's up to fp32
rounding: tests/engine/test_decode_attention_native.py bounds it (1e-5) against rotary + SDPA on
random pages.

Available where q4_native builds (the same CPU flags and compiler); head dims that are multiples
of 16 up to 256, up to 16 query heads a KV head. Otherwise `available()` is False and the plan
keeps its torch ops (one sequence, one token a step).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from homelab_llm.engine.kernels import native_build, q4_native

SOURCE = Path(__file__).with_name("decode_attention_cpu.c")
MAX_GROUP, MAX_DIM = 16, 256


class AttendCall(ctypes.Structure):
    """attend_rows's arguments as one struct (decode_attention_cpu.c's attend_call), bound once
    per layer by the decode plan (DecodeAttention.bind)."""

    _fields_ = [("qkv", ctypes.c_void_p), ("ldqkv", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("hq", ctypes.c_int64), ("hkv", ctypes.c_int64), ("d", ctypes.c_int64),
                ("cos_sin", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("page_table", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("info", ctypes.c_void_p),
                ("page_size", ctypes.c_int64), ("scale", ctypes.c_double), ("out", ctypes.c_void_p),
                ("ldout", ctypes.c_int64), ("bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("eps", ctypes.c_double)]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    if not q4_native.cpu_supports():
        return None
    lib = native_build.load(SOURCE, q4_native.FLAGS, q4_native.HEADERS)
    if lib is None:
        return None
    lib.attend_rows_call.argtypes, lib.attend_rows_call.restype = [ctypes.POINTER(AttendCall)], ctypes.c_int
    lib.attend_call_size.argtypes, lib.attend_call_size.restype = [], ctypes.c_int64
    if lib.attend_call_size() != ctypes.sizeof(AttendCall):
        return None
    return lib


def available(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the call runs here for this shape (and HOMELAB_LLM_CPU_NATIVE is not 0)."""
    return (head_dim % 16 == 0 and head_dim <= MAX_DIM and q_heads % kv_heads == 0
            and q_heads // kv_heads <= MAX_GROUP and q4_native.available() and library() is not None)


def row_info(query_lens: list[int], seq_lens: list[int], slots: list[int],
             into: ctypes.Array | None = None) -> ctypes.Array:
    """The C call's per-row triples for a step: (the row's sequence index in the page table, its
    cache slot, the positions it attends), written into `into` (at least 3 per row) if given. A
    sequence with n new tokens and seq_len positions in all (its new ones included) has rows
    attending seq_len - n + 1 ... seq_len positions."""
    info: list[int] = []
    slot = iter(slots)
    for seq, (new, total) in enumerate(zip(query_lens, seq_lens)):
        for j in range(new):
            info += (seq, next(slot), total - new + 1 + j)
    if into is None:
        return (ctypes.c_int64 * len(info))(*info)
    into[: len(info)] = info
    return into


class DecodeAttention:
    """Bound to one model's head counts; call per layer and step (see __call__). eps: the q / k
    heads' RMSNorm epsilon where a layer has those norms (Qwen3)."""

    __slots__ = ("fn", "hq", "hkv", "d", "scale", "eps")

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, scale: float, eps: float = 0.0):
        self.fn = library().attend_rows_call
        self.hq, self.hkv, self.d, self.scale, self.eps = q_heads, kv_heads, head_dim, scale, eps

    def bind(self, qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, info: ctypes.Array, out: torch.Tensor, bias: int | None = None,
             q_norm: int | None = None, k_norm: int | None = None) -> AttendCall:
        """__call__'s arguments as a struct for library().attend_rows_call, but for the page
        table (set its page_table / table_stride each step): valid while the tensors and info
        keep their storage (the caller holds them)."""
        return AttendCall(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], self.hq, self.hkv, self.d,
                          cos_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), None, 0,
                          ctypes.addressof(info), k_cache.shape[1], self.scale, out.data_ptr(),
                          out.stride(0), bias, q_norm, k_norm, self.eps)

    def __call__(self, qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, page_table: torch.Tensor, info: ctypes.Array,
                 out: torch.Tensor, bias: int | None = None, q_norm: int | None = None,
                 k_norm: int | None = None) -> None:
        """qkv [R, (hq + 2 hkv) d] fp32 (unrotated; unit inner stride), cos_sin [R, d] fp32
        contiguous (each row's position's row), k_cache / v_cache [pages, page_size, hkv, d] fp32
        contiguous, page_table [sequences, pages] int32 (unit inner stride), info: row_info() of
        the R rows, out [R, hq d] fp32 (unit inner stride). bias: the data_ptr of the
        projection's fp32 [(hq + 2 hkv) d] bias, added first; q_norm / k_norm: those of each q / k
        head's fp32 [d] RMSNorm weight (both or neither), applied before the rotation. The caller
        checks dtypes and layouts once (the plan)."""
        call = self.bind(qkv, cos_sin, k_cache, v_cache, info, out, bias, q_norm, k_norm)
        call.page_table, call.table_stride = page_table.data_ptr(), page_table.stride(0)
        code = self.fn(ctypes.byref(call))
        if code == -2:
            raise MemoryError("native decode attention: no memory for its scratch")
        if code:
            raise ValueError("native decode attention: a row with no positions or no cache slot, "
                             "or one of q_norm / k_norm without the other")
