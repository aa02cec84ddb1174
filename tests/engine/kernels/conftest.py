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
def attention_case():
    """AttentionCase (below), as a fixture."""
    return AttentionCase


def make_attention_queries(q_lens: list[int], num_q_heads: int, head_dim: int, device: torch.device,
                           generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """bf16 queries over the same sequences for a decode call (one row each) and a prefill call
    (q_lens rows each), with their query_start_loc: (q_decode, qsl_decode, q_prefill, qsl_prefill)."""
    q1 = torch.randn(len(q_lens), num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    qsl1 = torch.arange(len(q_lens) + 1, dtype=torch.int32, device=device)
    qp = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    qslp = torch.tensor([0, *q_lens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    return q1, qsl1, qp, qslp


class AttentionCase:
    """Paged K/V (make_paged_kv) with a decode call's queries (one row a sequence) and a prefill
    call's (q_lens rows each, the sequences' last) over them, and paged_attention_ref's answers
    (want1, wantp). decode() / prefill() run the kernels on them, `check` compares within 2e-2
    (bf16 q and outputs, the bound of test_decode_attention / test_prefill_attention)."""

    def __init__(self, seq_lens: list[int], q_lens: list[int], num_q_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, kv_dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator) -> None:
        (self.k_cache, self.v_cache, self.k_scale, self.v_scale,
         self.pages) = make_paged_kv(seq_lens, num_kv_heads, head_dim, page_size, kv_dtype, device, generator)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5
        self.q1, self.qsl1, self.qp, self.qslp = make_attention_queries(q_lens, num_q_heads, head_dim, device,
                                                                        generator)
        int8 = kv_dtype == torch.int8
        self.kv_ref = (self.k_cache if int8 else self.k_cache.float(), self.v_cache if int8 else self.v_cache.float())
        self.want1 = self.reference(self.q1, self.qsl1)
        self.wantp = self.reference(self.qp, self.qslp)

    def reference(self, q: torch.Tensor, query_start_loc: torch.Tensor, pages: torch.Tensor | None = None,
                  seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        from homelab_llm.engine.kernels.ref import paged_attention_ref

        return paged_attention_ref(q.float(), *self.kv_ref, self.pages if pages is None else pages, query_start_loc,
                                   self.seq_lens if seq_lens is None else seq_lens, self.scale, self.k_scale,
                                   self.v_scale)

    def decode(self, **kw) -> torch.Tensor:
        from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

        return paged_decode_attention(self.q1, self.k_cache, self.v_cache, self.pages, self.qsl1, self.seq_lens,
                                      self.scale, self.k_scale, self.v_scale, **kw)

    def prefill(self, **kw) -> torch.Tensor:
        from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

        return paged_prefill_attention(self.qp, self.k_cache, self.v_cache, self.pages, self.qslp, self.seq_lens,
                                       self.scale, self.k_scale, self.v_scale, **kw)

    @staticmethod
    def check(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{what}: {m}")

