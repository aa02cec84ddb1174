"""The CPU 4-bit path: torch's int4 weight-only kernel against the exact fp32 reference (our
AVX2 kernel, which takes precedence where it runs, is switched off here: test_q4_native.py).

Tolerance: the kernel runs in bf16 (activations, scales and zeros rounded to 8 mantissa bits),
so one matmul is ~2-3e-3 relative off the fp32 reference; we allow 1e-2 relative (Frobenius).
Layers take it for bf16 activations only; fp32 ones stay on the exact reference.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, w4a16_cpu
from homelab_llm.engine.kernels.ref import dequantize_w4_ref, w4a16_matmul_ref
from homelab_llm.engine.kernels.w4a16_pack import from_parts, quantize_rtn
from homelab_llm.engine.layers.linear import ColumnParallelLinear

pytestmark = pytest.mark.skipif(not w4a16_cpu.cpu_kernel_available(),
                                reason="this torch has no CPU int4 kernel")


@pytest.fixture(autouse=True)
def _torch_int4_kernel(monkeypatch):
    monkeypatch.setenv("HOMELAB_LLM_CPU_NATIVE", "0")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 8])
def test_int4_kernel_matches_reference(group, symmetric, m):
    torch.manual_seed(group + m)
    w = quantize_rtn(torch.randn(96, 256) * 0.05, group, symmetric)
    assert w4a16_cpu.supports(w)
    packed = w4a16_cpu.repack_for_cpu(w)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 256, dtype=dtype)
        got = w4a16_cpu.w4a16_matmul_cpu(x, packed)
        assert got.dtype == dtype and got.shape == (m, 96)
        assert _rel(got, w4a16_matmul_ref(x.float(), w)) < 1e-2


def test_act_order_permutation_is_applied():
    torch.manual_seed(0)
    k, n, g = 128, 32, 32
    q = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    perm = torch.randperm(k)
    w = from_parts(q, torch.rand(k // g, n) * 0.01 + 0.001, torch.full((k // g, n), 7.0), g, perm)
    x = torch.randn(3, k)
    got = w4a16_cpu.w4a16_matmul_cpu(x, w4a16_cpu.repack_for_cpu(w))
    assert _rel(got, w4a16_matmul_ref(x, w)) < 1e-2
    w.perm = None  # the same weight without its permutation gives a different answer
    assert _rel(got, w4a16_matmul_ref(x, w)) > 0.1


def test_linear_takes_the_kernel_when_it_computes_in_bf16(monkeypatch):
    """The layer's compute dtype decides, not the activations': an fp32 layer stays exact, a bf16
    one (or an fp32 model's layer told compute_w4_in(bf16), the CPU default) takes the kernel."""
    torch.manual_seed(1)
    layer = ColumnParallelLinear(256, 64)
    w = quantize_rtn(torch.randn(64, 256) * 0.05, 64)
    layer.set_w4(w, torch.float32)
    assert layer.w4.cpu_pack is None  # an fp32 model never takes the kernel: no second copy
    x = torch.randn(2, 256)
    exact = w4a16_matmul_ref(x, w)
    assert torch.equal(layer(x), exact)  # the exact reference
    layer.set_w4(w, torch.bfloat16)
    assert layer.w4.cpu_pack is not None
    # The repacked copy is registered, so memory accounting sees it.
    names = {name for name, _ in layer.named_buffers()}
    assert {"w4_qweight", "w4_cpu_packed", "w4_cpu_scales_and_zeros"} <= names
    fast = layer(x.bfloat16())
    kernel = w4a16_cpu.w4a16_matmul_cpu(x.bfloat16(), layer.w4.cpu_pack)
    assert fast.dtype == torch.bfloat16 and torch.equal(fast, kernel)
    assert _rel(fast, exact) < 1e-2
    mixed = layer(x)  # fp32 activations through the bf16 kernel, result back in fp32
    assert mixed.dtype == torch.float32 and torch.equal(mixed, kernel.float())
    layer.set_w4(w, torch.float32)
    layer.compute_w4_in(torch.bfloat16)
    assert torch.equal(layer(x), kernel.float())
    monkeypatch.setenv("HOMELAB_LLM_KERNELS", "ref")
    assert torch.equal(layer(x.bfloat16()), w4a16_matmul_ref(x.bfloat16(), w))


@pytest.mark.parametrize("symmetric", [True, False])
def test_many_rows_take_the_dequantized_gemm(symmetric):
    """From DENSE_ROWS rows on, the weight is dequantized for a dense fp32 GEMM (on every CPU:
    w4a16_cpu.DENSE_DTYPE): q * scale + bias of fp16 scales and biases, exact but for one fp32
    rounding, so within the kernel's 1e-2 bound of the reference."""
    assert w4a16_cpu.DENSE_DTYPE == torch.float32 and w4a16_cpu.DENSE_ROWS == 32
    torch.manual_seed(3)
    w = quantize_rtn(torch.randn(48, 128) * 0.05, 32, symmetric)
    w.cpu_pack = w4a16_cpu.repack_for_cpu(w)
    dense = w4a16_cpu.dequantize_dense(w, torch.float32)
    assert dense.dtype == torch.float32 and dense.shape == (128, 48)
    torch.testing.assert_close(dense, dequantize_w4_ref(w), atol=1e-7, rtol=2**-20)
    for rows in (w4a16_cpu.DENSE_ROWS - 1, w4a16_cpu.DENSE_ROWS, 300):
        x = torch.randn(rows, 128)
        got = dispatch.w4a16_matmul(x, w)
        assert got.dtype == torch.float32 and got.shape == (rows, 48)
        assert _rel(got, w4a16_matmul_ref(x, w)) < 1e-2
        if rows >= w4a16_cpu.DENSE_ROWS:  # the dense GEMM itself
            assert torch.equal(got, torch.mm(x, dense))
    x = torch.randn(1, 5, 128)  # leading dims kept; few rows take the int4 kernel itself
    assert torch.equal(dispatch.w4a16_matmul(x, w), w4a16_cpu.w4a16_matmul_cpu(x, w.cpu_pack))


def test_shapes_the_kernel_cannot_take_fall_back_to_the_reference():
    torch.manual_seed(2)
    w = quantize_rtn(torch.randn(40, 64) * 0.05, 32)  # 40 outputs: not a multiple of 16
    assert not w4a16_cpu.supports(w)
    layer = ColumnParallelLinear(64, 40)
    layer.set_w4(w, torch.bfloat16)
    assert layer.w4.cpu_pack is None and layer.w4_cpu_packed is None
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), w4a16_matmul_ref(x, w))
    assert torch.equal(dispatch.w4a16_matmul(x, w), w4a16_matmul_ref(x, w))
