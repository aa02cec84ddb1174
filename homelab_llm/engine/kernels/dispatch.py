"""One door to the kernels: layers call these; each picks the Triton kernel on a GPU and the torch
reference on the CPU (or when HOMELAB_LLM_KERNELS=ref), so CI runs the same engine code."""

from __future__ import annotations

import os

import torch

from homelab_llm.engine.kernels import ref


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("HOMELAB_LLM_KERNELS", "triton") != "ref"


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    ref.store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, page_table, query_start_loc, seq_lens, softmax_scale,
                    k_scale=None, v_scale=None, query_lens_host=None, seq_lens_host=None):
    return ref.paged_attention_ref(q, k_cache, v_cache, page_table, query_start_loc, seq_lens,
                                   softmax_scale, k_scale, v_scale, query_lens_host, seq_lens_host)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ref.rms_norm_ref(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return ref.add_rms_norm_ref(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return ref.silu_and_mul_ref(gate_up)
