"""Our AVX2 CPU kernel (kernels/q4_native.py, q4_cpu.c) against exact products of the same weights.

Bounds: the only rounding beyond the weight format is each activation block's int8 grid (at most
absmax / 254 an element), so a product is off the exact one of the same (fp16-scaled) weights by
~5e-3 relative on Gaussian inputs; we allow 1.5e-2 (Frobenius). The quantizer itself is checked
exactly: an identity weight returns d * round(x / d) for each block's d = absmax / 127.
The builder: a cached library is reused, a source that does not compile or a missing compiler
gives None with the reason, and the callers keep torch's kernels.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from homelab_llm.engine.kernels import dispatch, int8_cpu, native_build, q4_native, w4a16_cpu
from homelab_llm.engine.kernels.ref import w4a16_matmul_ref
from homelab_llm.engine.kernels.w4a16_pack import from_parts, quantize_rtn
from homelab_llm.engine.layers.linear import ColumnParallelLinear

needs_native = pytest.mark.skipif(not q4_native.available(),
                                  reason=f"our AVX2 kernel does not run here: {q4_native.unavailable_reason()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _q4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    offsets = (-8 * scales + torch.randn(n, k // 32, generator=g) * 1e-3).half().float()
    dense = (codes.float().view(n, k // 32, 32) * scales.unsqueeze(-1) + offsets.unsqueeze(-1)).view(n, k)
    return q4_native.pack_q4(codes, scales, offsets), dense


def _q8(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    dense = (codes.float().view(n, k // 32, 32) * scales.unsqueeze(-1)).view(n, k)
    return q4_native.pack_q8(codes, scales), dense


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(40, 96), (96, 576), (200, 1536)])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_matmul_matches_the_exact_product(bits, n, k, m):
    w, dense = (_q4 if bits == 4 else _q8)(n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    exact = x @ dense.t()
    got = q4_native.matmul(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert _rel(got, exact) < 1.5e-2
    # bf16 activations come back in bf16; leading dims are kept
    assert q4_native.matmul(x.bfloat16().view(1, m, k), w).shape == (1, m, n)
    # strided rows in, accumulate into strided rows out
    wide = torch.randn(m, k + 64)
    wide[:, 32:32 + k] = x
    out = torch.randn(m, n + 8)
    before = out.clone()
    q4_native.matmul_into(wide[:, 32:32 + k], w, out[:, 4:4 + n], accumulate=True)
    assert torch.allclose(out[:, 4:4 + n], before[:, 4:4 + n] + got, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :4], before[:, :4]) and torch.equal(out[:, 4 + n:], before[:, 4 + n:])


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bits):
    """Batch invariance, bit for bit: 7 rows in one call equal the same rows in calls of 1 to 6
    (tiles of 1 to 7 rows), so a speculative verify step's rows reproduce one-token steps
    and greedy output is the same with and without speculation."""
    w, _ = (_q4 if bits == 4 else _q8)(96, 576, seed=bits)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(3))
    whole = q4_native.matmul(x, w)
    for m in range(1, 7):
        assert torch.equal(torch.cat([q4_native.matmul(x[i: i + m], w) for i in range(0, 7, m)]), whole), m


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_rms_norm_inside_the_call(bits):
    """norm=: each row is RMS-normalized (x / sqrt(mean(x^2) + eps) * w) before it is quantized:
    the exact product of the normalized rows, within the matmul bound; a NativeLinear does the
    same for one row; a norm weight of the wrong shape is refused."""
    n, k, eps = 64, 160, 1e-5
    w, dense = (_q4 if bits == 4 else _q8)(n, k, seed=bits)
    x = torch.randn(3, k) * 4
    norm = torch.rand(k) + 0.5
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm
    out = torch.empty(3, n)
    q4_native.matmul_into(x, w, out, norm=norm, eps=eps)
    assert _rel(out, normed @ dense.t()) < 1.5e-2
    one = torch.zeros(1, n)
    q4_native.NativeLinear(w, eps)(x[:1], one, False, norm)
    assert torch.allclose(one, out[:1], rtol=1e-5, atol=1e-5)  # another summation order (one row)
    with pytest.raises(ValueError, match="norm weight"):
        q4_native.matmul_into(x, w, out, norm=norm[:32])


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_gated_activation_inside_the_call(bits):
    """swiglu=: x rows hold gate then up and the product takes silu(gate) * up (gates up to
    +-120: no overflow, silu(-120) ~ 0); within the matmul bound of the exact product; refused
    together with a norm."""
    n, k = 48, 96
    w, dense = (_q4 if bits == 4 else _q8)(n, k, seed=10 + bits)
    g = torch.Generator().manual_seed(bits)
    gate, up = torch.randn(2, k, generator=g) * 3, torch.randn(2, k, generator=g)
    gate[0, :4] = torch.tensor([120.0, -120.0, 0.0, -0.0])
    out = torch.empty(2, n)
    q4_native.matmul_into(torch.cat([gate, up], 1), w, out, swiglu=True)
    assert torch.isfinite(out).all()
    assert _rel(out, (torch.nn.functional.silu(gate) * up) @ dense.t()) < 1.5e-2
    one = torch.zeros(1, n)
    q4_native.NativeLinear(w)(torch.cat([gate, up], 1)[:1], one, False, None, True)
    assert torch.allclose(one, out[:1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not with swiglu"):
        q4_native.matmul_into(torch.cat([gate, up], 1), w, out, norm=torch.ones(k), swiglu=True)


@needs_native
def test_activation_blocks_round_to_their_int8_grid():
    """An identity 8-bit weight (codes 1, scale 1) returns the quantized activations themselves:
    per block of 32, d = absmax / 127 and d * round(x / d); an all-zero block stays zero."""
    k = 128
    codes = torch.eye(k, dtype=torch.int32)
    w = q4_native.pack_q8(codes, torch.ones(k, k // 32))
    x = torch.randn(2, k) * torch.tensor([1e-3, 1.0, 50.0, 0.0]).repeat_interleave(32)
    got = q4_native.matmul(x, w)
    d = x.view(2, 4, 32).abs().amax(-1, keepdim=True) / 127
    want = (torch.round(x.view(2, 4, 32) / torch.where(d > 0, d, 1)) * d).view(2, k)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got[:, 96:], torch.zeros(2, 32))
    assert float((got - x).abs().view(2, 4, 32).amax(-1).div(d.squeeze(-1).clamp_min(1e-30)).max()) <= 0.5 + 1e-4


@needs_native
def test_bad_shapes_are_refused():
    w, _ = _q4(16, 64, seed=0)
    with pytest.raises(ValueError, match="features"):
        q4_native.matmul(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="native matmul"):
        q4_native.matmul_into(torch.randn(1, 64), w, torch.empty(1, 8))
    with pytest.raises(ValueError, match="K % 32"):
        q4_native.pack_q4(torch.zeros(4, 40, dtype=torch.int32), torch.ones(4, 1), torch.ones(4, 1))
    assert q4_native.matmul(torch.randn(0, 64), w).shape == (0, 16)


@needs_native
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cpu_layers_take_it_where_it_fits(monkeypatch, group, symmetric):
    """A W4Weight repacks for our kernel (no torch int4 copy kept); an act-order weight keeps
    torch's kernel; HOMELAB_LLM_CPU_NATIVE=0 switches it off. Few rows run it, within the bound
    of the exact reference; the registered buffer is what memory accounting counts."""
    torch.manual_seed(group)
    w = quantize_rtn(torch.randn(48, 256) * 0.05, group, symmetric)
    layer = ColumnParallelLinear(256, 48)
    layer.set_w4(w, torch.bfloat16)
    pack = layer.w4.cpu_pack
    assert pack.native is not None and pack.packed is None and layer.w4_cpu_native is pack.native.blocks
    assert pack.native.blocks.numel() == 48 * 256 // 32 * q4_native.Q4_BLOCK_BYTES
    for rows in (1, 5, w4a16_cpu.NATIVE_ROWS + 1):
        x = torch.randn(rows, 256)
        assert _rel(layer(x), w4a16_matmul_ref(x, w)) < 1.5e-2
    assert torch.equal(dispatch.w4a16_matmul(x[:1], layer.w4), q4_native.matmul(x[:1], pack.native))
    q = torch.randint(0, 16, (128, 32), dtype=torch.uint8)
    permuted = from_parts(q, torch.rand(4, 32) * 0.01 + 1e-3, torch.full((4, 32), 7.0), 32, torch.randperm(128))
    assert w4a16_cpu.repack_for_cpu(permuted).native is None
    monkeypatch.setenv("HOMELAB_LLM_CPU_NATIVE", "0")
    assert not q4_native.available() and q4_native.unavailable_reason() == "HOMELAB_LLM_CPU_NATIVE=0"
    assert w4a16_cpu.repack_for_cpu(w).native is None


@needs_native
def test_int8_head_takes_it_with_the_q8_0_codes():
    torch.manual_seed(4)
    weight = torch.randn(72, 96) * 0.05
    head = int8_cpu.quantize_int8_for_cpu(weight)
    assert head.native is not None and head.packed is None
    q, d = int8_cpu.int8_codes(weight)
    exact = (q.float().view(72, 3, 32) * d.half().float().unsqueeze(-1)).view(72, 96)
    x = torch.randn(2, 96)
    assert _rel(int8_cpu.int8_matmul_cpu(x, head), x @ exact.t()) < 1.5e-2
    assert int8_cpu.quantize_int8_for_cpu(weight, native=False).native is None


def test_builder_reports_why_it_cannot_build(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMELAB_LLM_NATIVE_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return }\n")
    assert native_build.load(broken, ("-O1",)) is None
    assert "failed" in native_build.last_error(broken)
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-written library left
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    lonely = tmp_path / "lonely.c"
    lonely.write_text("int f(void) { return 1; }\n")
    assert native_build.load(lonely, ()) is None
    assert "no C compiler" in native_build.last_error(lonely)


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler here")
def test_builder_builds_once_and_reuses_the_library(tmp_path):
    """Two fresh processes load one source: the first builds into the cache, the second finds
    the file (same name, same modification time) and builds nothing."""
    source = tmp_path / "seven.c"
    source.write_text("int seven(void) { return 7; }\n")
    code = ("import sys; from pathlib import Path; from homelab_llm.engine.kernels import native_build as b;"
            f"lib = b.load(Path({str(source)!r}), ('-O1',)); print(lib.seven())")
    env = {"HOMELAB_LLM_NATIVE_CACHE": str(tmp_path / "cache"), "PATH": __import__("os").environ["PATH"],
           "PYTHONPATH": ":".join(sys.path)}
    for attempt in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "7", out.stderr
        built = list((tmp_path / "cache").glob("seven-*.so"))
        assert len(built) == 1
        if attempt == 0:
            first = built[0].stat().st_mtime_ns
    assert built[0].stat().st_mtime_ns == first
