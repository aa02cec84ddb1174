"""dispatch.py: CPU tensors take the references; the GPU routes are covered where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, ref
from homelab_llm.engine.kernels.w4a16_pack import quantize_rtn


def test_cpu_routes_to_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    w = torch.rand(64, generator=gen)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), ref.rms_norm_ref(x, w, 1e-6))
    weight = quantize_rtn(torch.randn(32, 64, generator=gen), 32)
    assert torch.equal(dispatch.w4a16_matmul(x, weight), ref.w4a16_matmul_ref(x, weight))
    cache = ref.rope_cos_sin_cache(ref.rope_inv_freq(16, 10000.0), 8)
    q, k = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 1, 16, generator=gen)
    q2, k2 = q.clone(), k.clone()
    dispatch.apply_rope(q, k, torch.tensor([1, 5]), cache)
    ref.apply_rope_ref(q2, k2, torch.tensor([1, 5]), cache)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert not dispatch.use_triton(x)


def test_cpu_moe_router_and_shared_expert_routes() -> None:
    """route_gate_topk on the CPU: the linear layer then the reference router, and the shared
    expert's gate as sigmoid(x @ g); fused_moe's `shared` as moe_ref.add_shared_ref."""
    from homelab_llm.engine.kernels.moe_ref import add_shared_ref, moe_experts_ref, route_topk_ref

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=gen)
    gate, shared_gate = torch.randn(8, 32, generator=gen), torch.randn(1, 32, generator=gen)
    weights, ids, shared_w = dispatch.route_gate_topk(x, gate, 2, True, shared_gate)
    want_w, want_ids = route_topk_ref(torch.nn.functional.linear(x, gate), 2, True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    assert torch.equal(shared_w, torch.sigmoid(torch.nn.functional.linear(x, shared_gate)).reshape(-1))
    assert dispatch.route_gate_topk(x, gate, 2, True)[2] is None
    w13, w2 = torch.randn(8, 24, 32, generator=gen), torch.randn(8, 32, 12, generator=gen)
    shared = (torch.randn(3, 32, generator=gen), shared_w)
    got = dispatch.fused_moe(x, w13, w2, weights, ids, shared=shared)
    assert torch.equal(got, add_shared_ref(moe_experts_ref(x, w13, w2, weights, ids), *shared))


def test_cpu_sampling_is_seeded_and_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen)
    temperature = torch.tensor([1.0, 1.0, 0.0, 0.5])
    top_k = torch.tensor([0, 5, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9])
    min_p = torch.zeros(4)
    seeds = torch.tensor([7, 7, 7, 8])
    steps = torch.tensor([0, 0, 0, 3])
    a = dispatch.sample(logits, temperature, top_k, top_p, min_p, seeds, steps)
    b = dispatch.sample(logits, temperature, top_k, top_p, min_p, seeds, steps)
    assert torch.equal(a, b)
    assert a[2].item() == int(logits[2].argmax())
    assert a[1].item() in torch.topk(logits[1], 5).indices.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_attention_routes_agree_with_reference(paged_kv) -> None:
    gen = torch.Generator().manual_seed(2)
    dev = torch.device("cuda")
    k_cache, v_cache, _, _, page_table = paged_kv([40, 9], 2, 64, 16, torch.bfloat16, dev, gen)
    for q_lens in ([1, 1], [5, 9]):
        q = torch.randn(sum(q_lens), 8, 64, generator=gen).to(dev, torch.bfloat16)
        qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=dev)
        sl = torch.tensor([40, 9], dtype=torch.int32, device=dev)
        want = ref.paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), page_table, qsl, sl, 0.125)
        for hosts in ((q_lens, [40, 9]), (None, None)):
            got = dispatch.paged_attention(q, k_cache, v_cache, page_table, qsl, sl, 0.125, None, None, *hosts)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
