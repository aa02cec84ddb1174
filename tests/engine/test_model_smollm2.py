"""The real SmolLM2-135M-Instruct Q4_1 GGUF: our loader + decoder vs transformers reading the same
file (it dequantizes to fp32 as we do, and undoes llama.cpp's Q/K row permutation its own way).

Tolerance: fp32 on both sides, logits up to ~40; we allow 1e-3 absolute (observed ~4e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_reference import PagedHarness, hf_logits, load_ours

ATOL = 1e-3
PROMPT_TEXT = "1, 2, 3, 4, 5, 6,"


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_ours(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    transformers = pytest.importorskip("transformers")
    folder, name = str(smollm2_path.parent), smollm2_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tok


@pytest.fixture(scope="module")
def greedy_run(ours, reference):
    """Our prompt logits and greedy 16-token continuation, and transformers' logits over the
    prompt + that continuation in one teacher-forced forward (cheaper than its generate())."""
    _, model = ours
    hf, tok = reference
    ids = tok.encode(PROMPT_TEXT)
    harness = PagedHarness(model, page_size=4)
    prompt_logits = harness.step({"s": ids})
    token = int(prompt_logits[-1].argmax())
    continuation = []
    for _ in range(16):
        continuation.append(token)
        token = int(harness.step({"s": [token]})[-1].argmax())
    return ids, prompt_logits, continuation, hf_logits(hf, ids + continuation)


def test_prompt_logits_match_transformers(greedy_run):
    ids, prompt_logits, _, ref = greedy_run
    torch.testing.assert_close(prompt_logits, ref[: len(ids)], atol=ATOL, rtol=0)


def test_greedy_continuation_matches_transformers(greedy_run, reference):
    """transformers' greedy pick at every step of our continuation is our pick, so its own
    greedy generation is this same sequence."""
    ids, _, continuation, ref = greedy_run
    hf_picks = ref[len(ids) - 1 : -1].argmax(-1).tolist()
    assert hf_picks == continuation
    assert reference[1].decode(continuation).startswith(" 7, 8, 9,")


def test_quantized_blocks_stay_reachable_without_a_copy(ours, smollm2_path):
    config, model = ours
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert set(qkv.gguf_blocks) == {"q", "k", "v"}
    blocks, rows, cols = qkv.gguf_blocks["q"]
    assert blocks.ggml_type == "Q4_1" and blocks.tensor_name == "blk.0.attn_q.weight"
    assert blocks.shape == (config.q_size, config.hidden_size)
    # Q4_1: 32 weights per 20-byte block; the raw rows are a view of the file's memory map.
    assert blocks.raw.shape == (config.q_size, config.hidden_size // 32 * 20)
    base = blocks.raw
    while getattr(base, "base", None) is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)
    assert blocks.row_order is not None  # llama.cpp permuted q rows for its rope
    assert sorted(blocks.row_order.tolist()) == list(range(config.q_size))
    assert model.model.layers[0].mlp.gate_up_proj.gguf_blocks[1][0].tensor_name == "blk.0.ffn_up.weight"
    # norms and the Q8_0 embedding are not 4-bit: no record
    assert model.model.embed_tokens.gguf_blocks == {}
