"""Kernel tests: on a CUDA machine they run the compiled kernels at full shapes; elsewhere the same
tests run through Triton's CPU interpreter (TRITON_INTERPRET=1) at small shapes.

The variable must be set before any kernel module is imported: `triton.jit` picks the interpreter
when the decorator runs.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
if not HAS_CUDA:
    from tests.engine.kernels.interpreter_speed import install

    install()  # the interpreter without its per-helper-call re-patching (~30% of its time)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


@pytest.fixture
def full_shapes() -> bool:
    """True on a GPU: tests widen to Llama-3.1-8B-like shapes there."""
    return HAS_CUDA


@pytest.fixture
def paged_kv():
    """The factory below, as a fixture (test modules here are not a package)."""
    return make_paged_kv


def make_paged_kv(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
    device: torch.device, generator: torch.Generator, spare_pages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Random K/V caches with each sequence's pages scattered in shuffled order (so a kernel that
    ignores the page table fails). Returns (k_cache, v_cache, k_scale, v_scale, page_table).
    int8: the rows as the engine stores them (ref.quantize_kv: Hadamard-rotated where the kernels
    expect it, then quantized), so the K/V read back are the random rows themselves. Unrotated rows
    read back as x @ H / D, 1/sqrt(D) of their size: near-uniform attention, outputs ~0.02 that
    a 2e-2 bound could not tell from a kernel ignoring q (so it was until BENCHMARKS 63)."""
    from homelab_llm.engine.kernels.ref import quantize_kv

    pages_per_seq = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator).to(device)
    v = torch.randn(shape, generator=generator).to(device)
    perm = torch.randperm(num_pages, generator=generator).to(device)
    max_pages = max(pages_per_seq) if pages_per_seq else 1
    page_table = torch.zeros((len(seq_lens), max_pages + 1), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    if dtype == torch.int8:
        kq, ks = quantize_kv(k)
        vq, vs = quantize_kv(v)
        return kq, vq, ks, vs, page_table
    return k.to(dtype), v.to(dtype), None, None, page_table


@pytest.fixture
def attention_queries():
    """The factory below, as a fixture."""
    return make_attention_queries


def make_attention_queries(q_lens: list[int], num_q_heads: int, head_dim: int, device: torch.device,
                           generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """bf16 queries over the same sequences for a decode call (one row each) and a prefill call
    (q_lens rows each), with their query_start_loc: (q_decode, qsl_decode, q_prefill, qsl_prefill)."""
    q1 = torch.randn(len(q_lens), num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    qsl1 = torch.arange(len(q_lens) + 1, dtype=torch.int32, device=device)
    qp = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    qslp = torch.tensor([0, *q_lens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    return q1, qsl1, qp, qslp
