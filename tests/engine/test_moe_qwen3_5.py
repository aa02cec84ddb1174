"""Qwen3.5-MoE (hybrid Gated DeltaNet + experts + sigmoid-gated shared expert) vs transformers 5
on a tiny random checkpoint, through the whole engine.

Tolerance: fp32 both sides; last-token logits within 1e-3 absolute (observed ~1e-5) and identical
greedy tokens; a batch gives what each prompt gives alone.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_reference import greedy, hf_greedy, hf_last_logits, our_llm
from homelab_llm.engine.layers.moe import SparseMoeBlock
from moe_reference import make_hf_qwen3_5_moe
from test_model_qwen3_5 import last_logits

ATOL = 1e-3
PROMPTS = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (70, 5, 23)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    hf = make_hf_qwen3_5_moe(folder)
    llm = our_llm(folder)
    yield hf, llm
    llm.shutdown()


def test_config_and_layers(pair):
    _, llm = pair
    cfg = llm.engine.model_config
    assert cfg.architecture == "qwen3_5_moe" and cfg.is_hybrid and cfg.is_moe
    assert cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 48
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == cfg.num_hidden_layers and all(b.shared_expert is not None for b in blocks)


def test_logits_match_transformers(pair):
    hf, llm = pair
    got = last_logits(llm, PROMPTS)
    want = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_greedy_tokens_batched_and_alone(pair):
    hf, llm = pair
    want = [hf_greedy(hf, p, 5) for p in PROMPTS]
    batched = [o.token_ids for o in llm.generate(PROMPTS, greedy(5))]
    alone = [llm.generate([p], greedy(5))[0].token_ids for p in PROMPTS]
    assert batched == alone == want
