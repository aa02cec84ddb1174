"""The CPU decode plan (model/cpu_decode_layer.py) against the general CPU default
path on the real SmolLM2-135M Q4_1 file, with either set of kernels it drives (ours: the AVX2
4-bit matmuls and the C attention call; torch's int4 kernel and attention ops): the same model
and cache layout, a prompt then the same 8 decode tokens each way (the general path's greedy
picks, teacher-forced on the plan).

The plan computes the same formulas with a different fp32 rounding order (the norm's sum of
squares, the rotation as a matmul), and each bf16 rounding that flips then moves the logits by
about as much as the bf16 kernels themselves: scaling the general path's norm weights by
1 + 2^-22 alone moves them 0.97% (relative). Bounds, torch's int4 kernel: relative distance
< 0.03 and max < 0.05 * max |logit| (observed 0.007 and 0.010); ours: the same argument with
int8 activation codes (a flipped code moves by absmax / 127 of its block): < 0.06 and < 0.075
(observed 0.032 and 0.035); greedy picks agree on >= 6 of 8 steps (observed 7: one pick is a
near tie). A wrong rotation sign moves them 71%, attention one key short 24%.
The rotation matrix alone equals layers/rotary.apply_rotary to fp32 rounding (1e-5). With our
kernels the plan also takes steps of several rows (sequences' decode tokens, a verify-like step,
a short prompt, 20 sequences at once; observed 0.016 / 0.039 against the same bounds); a prompt
chunk of more than SEQ_ROWS tokens or more than max_rows rows takes the general path (with
torch's kernels, anything but one sequence's one token). Scattered pages (gathered) give the
same logits as consecutive ones (viewed), bit for bit.
tests/engine/test_cpu_default.py bounds the plan's decode against the exact fp32 path."""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import q4_native, w4a16_cpu
from homelab_llm.engine.layers.rotary import apply_rotary
from homelab_llm.engine.kernels.q4_native import NativeLinear
from homelab_llm.engine.model.cpu_decode_layer import SEQ_ROWS, CpuDecodePlan
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness, plan_and_general, plan_steps

pytestmark = pytest.mark.skipif(not w4a16_cpu.cpu_kernel_available(),
                                reason="this torch has no CPU int4 kernel")

PROMPT = [1, 504, 3458, 282, 4649, 314, 216]
STEPS = 8


@pytest.fixture(scope="module", params=["native", "torch-int4"])
def fast(smollm2_path, request):
    """The CPU default with each kernel the plan drives: ours (kernels/q4_native.py) where it
    runs, and torch's int4 kernel (HOMELAB_LLM_CPU_NATIVE=0 while loading: the packs decide)."""
    if request.param == "native" and not q4_native.available():
        pytest.skip(f"our AVX2 kernel does not run here: {q4_native.unavailable_reason()}")
    config = load_model_config(smollm2_path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOMELAB_LLM_CPU_NATIVE", "1" if request.param == "native" else "0")
        model = load_model(config, smollm2_path, "gguf", torch.float32, "cpu", fast_cpu=True)
    packs = [m.w4.cpu_pack for m in model.modules() if getattr(m, "w4", None) is not None]
    assert packs and all((p.native is not None) == (request.param == "native") for p in packs)
    return model


def _decode(model, harness: PagedHarness, plan, tokens: list[int] | None = None) -> torch.Tensor:
    """Prompt then STEPS one-token steps with `plan` as the model's decode plan: greedy, or
    feeding `tokens` (the first is the prompt's greedy pick either way, appended to `tokens`
    when greedy)."""
    model.model.cpu_decode = plan
    token = int(harness.step({"s": PROMPT})[-1].argmax())
    rows = []
    for i in range(STEPS):
        if tokens is not None and i < len(tokens):
            token = tokens[i]
        elif tokens is not None:
            tokens.append(token)
        logits = harness.step({"s": [token]})
        rows.append(logits)
        token = int(logits[-1].argmax())
    return torch.cat(rows)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fast_decode_matches_the_general_path(fast):
    plan = fast.model.cpu_decode
    assert isinstance(plan, CpuDecodePlan)
    try:
        tokens: list[int] = []
        ref = _decode(fast, PagedHarness(fast, num_pages=16, page_size=4), None, tokens)
        with plan_steps() as taken:
            got = _decode(fast, PagedHarness(fast, num_pages=16, page_size=4), plan, tokens)
        native = isinstance(plan.layers[0].qkv, NativeLinear)
        # The prompt's 7 rows take the plan with our attention call (any rows up to max_rows),
        # not with torch's (one token a step).
        assert sum(taken) == STEPS + native
        assert (plan.native_attention is not None) == native  # our attention call comes with our linears
        rel_bound, max_bound = (0.06, 0.075) if native else (0.03, 0.05)
        assert _rel(got, ref) < rel_bound
        assert float((got - ref).abs().max()) < max_bound * float(ref.abs().max())
        assert int((got.argmax(-1) == ref.argmax(-1)).sum()) >= STEPS - 2
        # Scattered pages: the sequence's pages out of order (torch's attention gathers them, the
        # C call reads the page table): the same logits, bit for bit.
        harness = PagedHarness(fast, num_pages=16, page_size=4)
        harness.free_pages = [3, 9, 1, 12, 5, 0, 7, 14, 2, 11, 6, 15, 4, 10, 8, 13]
        assert torch.equal(_decode(fast, harness, plan, tokens), got)
    finally:
        fast.model.cpu_decode = plan


def test_rotation_matrix_is_the_rotary_layers(fast):
    plan = fast.model.cpu_decode
    torch.manual_seed(0)
    x = torch.randn(5, 4, plan.head_dim)
    for position in (0, 3, 700):
        rope = fast.model.rotary.lookup(torch.tensor([position]), torch.float32)
        want = apply_rotary(x, rope.cos, rope.sin)
        got = x @ plan.rotation_matrix(torch.tensor([position]))
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_steps_of_several_rows_match_the_general_path(fast):
    """Several sequences' decode tokens, a verify-like step of 5 tokens of one sequence, a mix with
    a short prompt, and 20 sequences' tokens at once (more rows than a sequence may bring), each
    run through the plan and through the general path from the same cache contents: the same
    bounds as one token's steps."""
    plan = fast.model.cpu_decode
    if plan.max_rows == 1:
        pytest.skip("torch's attention path takes one sequence's one token")
    many = {f"d{i}": PROMPT[i % 7:][:3] for i in range(17)}
    steps = [{"a": PROMPT * 3, "b": PROMPT[:5] * 4, **many},  # 92 rows: the general path for both
             {"a": [5], "b": [6]},
             {"a": [7, 8, 9, 10, 11]},
             {"a": [12], "b": [13, 14, 15], "c": PROMPT},
             {"b": [16], "c": [17], **{name: [20 + i] for i, name in enumerate(many)}}]
    ref, got = plan_and_general(fast, steps, num_pages=64, seed=1)
    assert _rel(got, ref) < 0.06
    assert float((got - ref).abs().max()) < 0.075 * float(ref.abs().max())
    assert int((got.argmax(-1) == ref.argmax(-1)).sum()) >= got.shape[0] - 3


def test_other_steps_take_the_general_path(fast):
    """More rows than max_rows or a sequence with more than SEQ_ROWS new tokens; with torch's
    attention, also two sequences or two tokens."""
    plan = fast.model.cpu_decode
    harness = PagedHarness(fast, num_pages=plan.max_rows + 16, page_size=4)
    harness.step({"a": PROMPT, "b": PROMPT[:3]})
    with plan_steps() as taken:
        harness.step({"a": list(range(5, 5 + SEQ_ROWS + 1)), "b": [4]})  # a prompt chunk
        harness.step({f"s{i}": [4] for i in range(plan.max_rows + 1)})  # too many rows
        if plan.max_rows == 1:
            harness.step({"a": [5], "b": [6]})  # two sequences
            harness.step({"a": [5, 6]})  # two new tokens
    assert not any(taken)
    assert plan.current(fast.model)
