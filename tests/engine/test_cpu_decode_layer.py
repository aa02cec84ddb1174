"""The one-sequence CPU decode path (model/cpu_decode_layer.py) against the general CPU default
path on the real SmolLM2-135M Q4_1 file: the same model and cache layout, prompt then 8 greedy
decode steps each way. Both run the same ops on the same numbers in the same order (only fewer
of them, into buffers), so the logits are equal bit for bit (bound: 0; observed 0). Also: the path is taken for one
sequence's decode step, not for a prefill or a two-sequence step, and scattered pages (gathered)
give the same logits as consecutive ones (viewed)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from homelab_llm.engine.kernels import w4a16_cpu
from homelab_llm.engine.model.cpu_decode_layer import CpuDecodePlan
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness

pytestmark = pytest.mark.skipif(not w4a16_cpu.cpu_kernel_available(),
                                reason="this torch has no CPU int4 kernel")

PROMPT = [1, 504, 3458, 282, 4649, 314, 216]
STEPS = 8


@pytest.fixture(scope="module")
def fast(smollm2_path):
    config = load_model_config(smollm2_path)
    return load_model(config, smollm2_path, "gguf", torch.float32, "cpu", fast_cpu=True)


def _decode(model, harness: PagedHarness, plan) -> torch.Tensor:
    """Prompt then STEPS greedy one-token steps with `plan` as the model's decode plan."""
    model.model.cpu_decode = plan
    token = int(harness.step({"s": PROMPT})[-1].argmax())
    rows = []
    for _ in range(STEPS):
        logits = harness.step({"s": [token]})
        rows.append(logits)
        token = int(logits[-1].argmax())
    return torch.cat(rows)


def test_fast_decode_matches_the_general_path(fast):
    plan = fast.model.cpu_decode
    assert isinstance(plan, CpuDecodePlan)
    try:
        ref = _decode(fast, PagedHarness(fast, num_pages=16, page_size=4), None)
        with mock.patch.object(CpuDecodePlan, "decode", autospec=True,
                               side_effect=CpuDecodePlan.decode) as spy:
            got = _decode(fast, PagedHarness(fast, num_pages=16, page_size=4), plan)
        assert spy.call_count == STEPS  # the prompt (7 rows) never reaches the plan
        assert torch.equal(got, ref)
        # Scattered pages: the sequence's pages out of order, so the plan gathers them.
        harness = PagedHarness(fast, num_pages=16, page_size=4)
        harness.free_pages = [3, 9, 1, 12, 5, 0, 7, 14, 2, 11, 6, 15, 4, 10, 8, 13]
        assert torch.equal(_decode(fast, harness, plan), ref)
    finally:
        fast.model.cpu_decode = plan


def test_other_steps_take_the_general_path(fast):
    plan = fast.model.cpu_decode
    harness = PagedHarness(fast, num_pages=16, page_size=4)
    harness.step({"a": PROMPT, "b": PROMPT[:3]})
    with mock.patch.object(CpuDecodePlan, "_layers", autospec=True) as layers:
        harness.step({"a": [5], "b": [6]})  # two sequences
        harness.step({"a": [5, 6]})  # two new tokens
    assert not layers.called
    assert plan.current(fast.model)
