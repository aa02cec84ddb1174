"""The CPU default for a GGUF Q4 model (device.fast_cpu_default): 4-bit linears through our AVX2
kernel (int8 activation blocks; kernels/q4_native.py) or, where it does not run, torch's int4
kernel in bf16; an int8 LM head; everything else fp32; --dtype float32 stays exact.

Bounds, on the real SmolLM2-135M Q4_1 file, three short prompts each run greedily on the exact
path for 8 steps, then both paths teacher-forced over prompt + continuation:
- logits near the exact path's: ||fast - exact|| / ||exact|| < 0.05 and max |fast - exact| <
  MAX_OFF * max |exact| (torch's kernel: observed 0.007-0.017 and up to 0.022; ours, llama.cpp's
  scheme of int8 activation blocks, ~5x coarser than bf16 for Gaussian blocks: 0.007-0.037 and
  up to 0.047, the worst a 13-row prompt below w4a16_cpu.NATIVE_ROWS; longer prompts take the
  fp32 dense copy, 0.007; the logits reach ~40, so single logits move by up to ~2);
- the greedy pick agrees with the exact path's on >= 90% of positions (observed 92-100%);
- the exact mode loads no 4-bit weight and no int8 head.
The int8 head alone: a Q8_0 tensor's codes come back exactly, so its product differs from the
dense one only by bf16 rounding (activations, scales, the two half sums): < 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.device import resolve_target
from homelab_llm.engine.kernels import int8_cpu, w4a16_cpu
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness

pytestmark = pytest.mark.skipif(not w4a16_cpu.cpu_kernel_available(),
                                reason="this torch has no CPU int4 kernel")

MAX_OFF = 0.075  # of max |exact logit|: the largest single-logit move (module docstring)
PROMPTS = ["1, 2, 3, 4, 5, 6,", "The capital of France is", "Once upon a time, in a small village,"]
STEPS = 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_int8_head_keeps_q8_0_codes():
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    q8 = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    exact = torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).copy())
    packed = int8_cpu.quantize_int8_for_cpu(exact)
    x = torch.randn(3, 96)
    got = int8_cpu.int8_matmul_cpu(x, packed)
    assert got.dtype == torch.float32 and got.shape == (3, 64)
    assert _rel(got, x @ exact.t()) < 1e-2
    # The codes are exact: a dense weight off the Q8_0 grid is further away than bf16 rounding.
    assert _rel(int8_cpu.int8_matmul_cpu(x, int8_cpu.quantize_int8_for_cpu(w)), x @ w.t()) > \
        _rel(got, x @ exact.t()) / 4
    assert int8_cpu.int8_matmul_cpu(x[:0], packed).shape == (0, 64)
    with pytest.raises(ValueError, match="features"):
        int8_cpu.int8_matmul_cpu(torch.randn(1, 32), packed)


def test_flags_pick_the_default_or_the_exact_mode(smollm2_path):
    fast = resolve_target(EngineArgs(model=str(smollm2_path), device="cpu"))
    assert fast.quantization == "w4a16" and fast.dtype == torch.float32
    exact = resolve_target(EngineArgs(model=str(smollm2_path), device="cpu", dtype="float32"))
    assert exact.quantization is None and exact.dtype == torch.float32


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from homelab_llm.engine.tokenizer import load_tokenizer

    return load_tokenizer(str(smollm2_path))


@pytest.fixture(scope="module")
def models(smollm2_path):
    config = load_model_config(smollm2_path)
    exact = load_model(config, smollm2_path, "gguf", torch.float32, "cpu")
    fast = load_model(config, smollm2_path, "gguf", torch.float32, "cpu", fast_cpu=True)
    return exact, fast


def test_default_runs_quantized_weights_and_the_exact_mode_does_not(models):
    exact, fast = models
    linears = [m for m in fast.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight is None and m.w4.cpu_pack is not None for m in linears)
    assert fast.lm_head.cpu_int8 is not None
    assert all(p.dtype == torch.float32 for p in fast.parameters())  # fp32 around the kernels
    assert all(m.w4 is None and m.weight.dtype == torch.float32
               for m in exact.modules() if isinstance(m, LinearBase))
    assert exact.lm_head.cpu_int8 is None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_logits_stay_near_the_exact_path(models, smollm2_tokenizer, prompt):
    exact, fast = models
    ids = smollm2_tokenizer.encode(prompt)
    harness = PagedHarness(exact, num_pages=16, page_size=16)
    token = int(harness.step({"s": ids})[-1].argmax())
    continuation = [token]
    for _ in range(STEPS - 1):
        token = int(harness.step({"s": [token]})[-1].argmax())
        continuation.append(token)
    full = ids + continuation
    ref = PagedHarness(exact, num_pages=16, page_size=16).step({"s": full})
    got = PagedHarness(fast, num_pages=16, page_size=16).step({"s": full})
    assert _rel(got, ref) < 0.05
    assert float((got - ref).abs().max()) < MAX_OFF * float(ref.abs().max())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree >= 0.9, f"greedy picks agree on {agree:.0%} of positions"


def test_default_decode_stays_near_the_exact_path(models, smollm2_tokenizer):
    """One-token decode steps (the decode plan, model/cpu_decode_layer.py) against the
    exact path's, the same tokens fed to both: the bounds of the prefill test above (torch's
    kernel: 0.008 relative, max 0.009 of max |logit|, 8 of 8 picks, 0.008-0.014 over the 3
    prompts; ours: 0.016 relative, max 0.023, 8 of 8 picks; 0.013-0.037 over the 3 prompts across
    kernel revisions)."""
    exact, fast = models
    assert fast.model.cpu_decode is not None
    ids = smollm2_tokenizer.encode(PROMPTS[2])
    ref_harness, harness = (PagedHarness(m, num_pages=16, page_size=16) for m in (exact, fast))
    token = int(ref_harness.step({"s": ids})[-1].argmax())
    harness.step({"s": ids})
    ref, got = [], []
    for _ in range(STEPS):
        ref.append(ref_harness.step({"s": [token]}))
        got.append(harness.step({"s": [token]}))
        token = int(ref[-1].argmax())
    ref_rows, got_rows = torch.cat(ref), torch.cat(got)
    assert _rel(got_rows, ref_rows) < 0.05
    assert float((got_rows - ref_rows).abs().max()) < MAX_OFF * float(ref_rows.abs().max())
    agree = float((got_rows.argmax(-1) == ref_rows.argmax(-1)).float().mean())
    assert agree >= 0.75, f"greedy picks agree on {agree:.0%} of steps"


def test_default_decode_matches_its_own_prefill(models, smollm2_tokenizer):
    """Decode steps (one row: the 4-bit kernel) and a prefill of the same tokens (the many-row
    path once past DENSE_ROWS) compute the same logits up to the kernels' rounding."""
    _, fast = models
    ids = (smollm2_tokenizer.encode(PROMPTS[2]) * 20)[: w4a16_cpu.DENSE_ROWS + 8]
    whole = PagedHarness(fast, num_pages=16, page_size=16).step({"s": ids})
    harness = PagedHarness(fast, num_pages=16, page_size=16)
    harness.step({"s": ids[:-4]})
    steps = torch.cat([harness.step({"s": [t]}) for t in ids[-4:]])
    assert _rel(steps, whole[-4:]) < 0.05


def test_small_model_keeps_dense_copies_for_prompts(models):
    """SmolLM2's 4-bit linears fit w4a16_cpu.DENSE_CACHE_BYTES dense: each keeps its dequantized
    copy, and a many-row matmul (past both the dense and our kernel's row thresholds) runs a
    GEMM on it: the product with the weight dequantized on the fly, bit for bit."""
    _, fast = models
    linears = [m for m in fast.modules() if isinstance(m, LinearBase)]
    assert all(m.w4.cpu_pack.dense is not None for m in linears)
    layer = linears[0]
    x = torch.randn(max(w4a16_cpu.DENSE_ROWS, w4a16_cpu.NATIVE_ROWS), layer.in_features)
    dtype = w4a16_cpu.DENSE_DTYPE
    fresh = torch.mm(x.to(dtype), w4a16_cpu.dequantize_dense(layer.w4, dtype)).to(x.dtype)
    assert torch.equal(w4a16_cpu.w4a16_matmul_cpu_rows(x, layer.w4), fresh)
