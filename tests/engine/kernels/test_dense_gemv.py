"""The bf16/fp16 decode GEMV with its fused norm prologue, residual add and SiLU epilogue
(kernels/dense_gemv.py) against the plain-torch composition it replaces (dense_gemv_ref)."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels.dense_gemv_ref import norm_linear_ref

BF16, FP16 = torch.bfloat16, torch.float16
# (M, K, N, split, dtype, norm, residual, gated, bias): 1-4 rows (3: a masked row of BLOCK_M 4),
# 5-8 in two row groups of 4 (5: a group of one row; each group its own split slots and tickets);
# odd N (a partial column block); K 100/200/72 not a multiple of the tile (32 in the interpreter);
# split None (the table's), 1 (no tickets) and 2-4 (ticket reduction; with the norm, each split
# program gathers the whole row's squares first); gated only unsplit, as the wrapper runs it.
CASES = [
    (1, 96, 37, None, BF16, False, False, False, False),
    (2, 100, 20, 3, FP16, True, True, False, True),
    (3, 64, 24, 1, BF16, True, True, True, False),
    (4, 200, 33, 4, BF16, True, False, False, False),
    (1, 128, 30, 1, FP16, True, False, True, True),
    (4, 72, 17, 2, BF16, False, False, False, True),
    (8, 200, 37, 3, BF16, False, False, False, True),
    (5, 100, 20, 2, FP16, True, True, False, False),
    (7, 64, 24, 1, BF16, True, True, True, False),
    (8, 96, 33, None, BF16, True, False, False, False),
]
# The kernel rounds once, at its store; the fp32 reference not at all. Row-relative bound: one
# rounding of the output, 2^-8 (bf16) / 2^-11 (fp16), doubled where the interpreter's cast
# truncates; a wrong row, column block, split or scale shows as errors of order 1.
BOUND = {BF16: 8e-3, FP16: 1e-3}


def _inputs(m, k, n, dtype, norm, residual, gated, bias, device):
    gen = torch.Generator().manual_seed(m * 7919 + k * 31 + n)
    rows = 2 * n if gated else n

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    return dict(x=rand(m, k), weight=rand(rows, k, scale=k ** -0.5),
                bias=rand(rows) if bias else None,
                norm_weight=(torch.rand(k, generator=gen) + 0.5).to(device, dtype) if norm else None,
                residual=rand(m, k) if residual else None)


def _fp32(t):
    return None if t is None else t.float()


def _rel_rows(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want).norm(dim=1) / want.norm(dim=1)).max())


def _assert_same_residual(got: torch.Tensor, want: torch.Tensor) -> None:
    """The unfused add's result bit for bit; the interpreter's bf16 cast truncates where a GPU
    rounds to nearest, so there one bf16 ulp (2^-7 relative)."""
    exact = got.is_cuda or got.dtype != BF16
    torch.testing.assert_close(got, want, rtol=0 if exact else 2 ** -7, atol=0)


@pytest.mark.parametrize("m,k,n,split,dtype,norm,residual,gated,bias", CASES)
def test_dense_gemv_matches_reference(m, k, n, split, dtype, norm, residual, gated, bias,
                                      device) -> None:
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    a = _inputs(m, k, n, dtype, norm, residual, gated, bias, device)
    want, _ = norm_linear_ref(**{key: _fp32(v) for key, v in a.items()}, eps=1e-5, gated=gated)
    for _ in range(2):  # the second call finds the tickets reset
        out, new_res = dense_gemv(a["x"], a["weight"], a["bias"], norm_weight=a["norm_weight"],
                                  eps=1e-5, residual=a["residual"], gated=gated, split=split)
        assert out.shape == (m, n) and out.dtype == dtype
        err = _rel_rows(out, want)
        assert err < BOUND[dtype], (m, k, n, split, dtype, err)
    if residual:
        _assert_same_residual(new_res, (a["x"].float() + a["residual"].float()).to(dtype))
    else:
        assert new_res is None


def test_dense_gemv_close_to_unfused_path(device) -> None:
    """Against the unfused ops in bf16 (what the engine ran before): they round the normalized
    input and the gate/up outputs to bf16, the kernel does not; both stay within 2 roundings."""
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    a = _inputs(2, 96, 40, BF16, True, True, True, False, device)
    want, want_res = norm_linear_ref(**a, eps=1e-6, gated=True)
    out, new_res = dense_gemv(a["x"], a["weight"], norm_weight=a["norm_weight"], eps=1e-6,
                              residual=a["residual"], gated=True)
    _assert_same_residual(new_res, want_res)
    err = _rel_rows(out, want.float())
    assert err < 2e-2, err


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_dense_gemv_gelu_epilogue(dtype, device) -> None:
    """Gemma's GELU-tanh-and-mul in the gated epilogue (elementwise.gate_act's sigmoid form of
    torch's tanh formula) against the fp32 reference; SiLU's result differs (the switch acts)."""
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    a = _inputs(2, 96, 40, dtype, True, True, True, False, device)
    want, _ = norm_linear_ref(**{key: _fp32(v) for key, v in a.items()}, eps=1e-6, gated=True,
                              act="gelu_tanh")
    out, _ = dense_gemv(a["x"], a["weight"], norm_weight=a["norm_weight"], eps=1e-6,
                        residual=a["residual"], gated=True, act="gelu_tanh")
    assert _rel_rows(out, want) < BOUND[dtype]
    silu, _ = dense_gemv(a["x"], a["weight"], norm_weight=a["norm_weight"], eps=1e-6,
                         residual=a["residual"], gated=True)
    assert _rel_rows(silu, want) > 10 * BOUND[dtype]
    with pytest.raises(ValueError, match="activation 'relu'"):
        dense_gemv(a["x"], a["weight"], gated=True, act="relu")


def test_dense_gemv_rejects_mismatched_weight(device) -> None:
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    x = torch.zeros((1, 64), dtype=BF16, device=device)
    with pytest.raises(ValueError, match="same dtype"):
        dense_gemv(x, torch.zeros((8, 64), dtype=FP16, device=device))
    with pytest.raises(ValueError, match="residual"):
        dense_gemv(x, torch.zeros((8, 64), dtype=BF16, device=device), residual=x)


def test_cpu_routes_to_the_unfused_ops() -> None:
    """Off the GPU the dispatch never takes the GEMV: dispatch.linear is F.linear and
    dispatch.norm_linear the reference composition, bit for bit."""
    from homelab_llm.engine.kernels import dispatch

    a = _inputs(2, 64, 24, BF16, True, True, True, True, torch.device("cpu"))
    assert not dispatch.dense_gemv_route(a["x"], a["weight"])
    assert torch.equal(dispatch.linear(a["x"], a["weight"], a["bias"]),
                       torch.nn.functional.linear(a["x"], a["weight"], a["bias"]))
    got = dispatch.norm_linear(a["x"], a["residual"], a["norm_weight"], 1e-6, a["weight"],
                               a["bias"], gated=True)
    want = norm_linear_ref(**a, eps=1e-6, gated=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_skinny_outputs_take_the_gemv_up_to_the_skinny_rows(monkeypatch) -> None:
    """An arch whose table serves 1 row (sm_90) and names skinny_n sends outputs at most that
    narrow (Gated DeltaNet's in_proj_ba) to the GEMV for up to SKINNY_GEMV_ROWS rows (4: a
    verify step's; cuBLAS keeps batch 8); wider outputs and more rows stay with the BLAS GEMM;
    forced (HOMELAB_LLM_DENSE_GEMV=1), any width takes it up to FORCED_GEMV_ROWS."""
    import dataclasses

    from homelab_llm.engine.kernels import dispatch, tuning

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.delenv("HOMELAB_LLM_DENSE_GEMV", raising=False)
    arch = tuning.DENSE_GEMV_TABLE["interpret"]
    monkeypatch.setitem(tuning.DENSE_GEMV_TABLE, "interpret", dataclasses.replace(arch, max_rows=1))
    narrow, wide = torch.zeros(96, 64, dtype=BF16), torch.zeros(200, 64, dtype=BF16)
    rows = {m: torch.zeros(m, 64, dtype=BF16) for m in (1, 2, 4, 5, 8, 9)}
    assert dispatch.dense_gemv_route(rows[1], wide) and not dispatch.dense_gemv_route(rows[2], narrow)
    monkeypatch.setitem(tuning.DENSE_GEMV_TABLE, "interpret",
                        dataclasses.replace(arch, max_rows=1, skinny_n=128))
    skinny = dispatch.SKINNY_GEMV_ROWS
    assert 1 < skinny < 9
    assert all(dispatch.dense_gemv_route(rows[m], narrow) == (m <= skinny) for m in rows)
    assert not dispatch.dense_gemv_route(rows[2], wide)
    monkeypatch.setattr(dispatch, "SKINNY_GEMV_ROWS", 8)  # the row groups' upper end
    assert dispatch.dense_gemv_route(rows[8], narrow) and not dispatch.dense_gemv_route(rows[9], narrow)
    monkeypatch.setenv("HOMELAB_LLM_DENSE_GEMV", "1")
    monkeypatch.setitem(tuning.DENSE_GEMV_TABLE, "interpret", dataclasses.replace(arch, max_rows=0))
    assert dispatch.dense_gemv_route(rows[4], wide) and not dispatch.dense_gemv_route(rows[5], wide)


@pytest.mark.parametrize("m", [1, 4])
def test_dense_gemv_8b_shapes(m: int, device, full_shapes: bool) -> None:
    """On a GPU: the Llama-3.1-8B step's shapes with the table's tiles and splits (the
    interpreter would take minutes here)."""
    if not full_shapes:
        pytest.skip("full shapes run on a GPU")
    from homelab_llm.engine.kernels.dense_gemv import dense_gemv

    for k, n, norm, gated in ((4096, 6144, True, False), (4096, 4096, False, False),
                              (4096, 2 * 14336, True, True), (14336, 4096, False, False)):
        a = _inputs(m, k, n // 2 if gated else n, BF16, norm, norm, gated, False, device)
        want, _ = norm_linear_ref(**{key: _fp32(v) for key, v in a.items()}, eps=1e-5, gated=gated)
        out, _ = dense_gemv(a["x"], a["weight"], norm_weight=a["norm_weight"], eps=1e-5,
                            residual=a["residual"], gated=gated)
        assert _rel_rows(out, want) < BOUND[BF16], (m, k, n)
