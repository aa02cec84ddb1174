"""The hybrid MoEs vs transformers 5 on tiny random checkpoints, through the whole engine:
Qwen3.5-MoE (Gated DeltaNet + experts + sigmoid-gated shared expert on every layer) and Qwen3-Next
(the same with fused per-key-head GDN projections and a dense mlp_only layer).

Tolerance: fp32 both sides; last-token logits within 1e-3 absolute (observed ~1e-5) and identical
greedy tokens; a batch gives what each prompt gives alone.
"""

from __future__ import annotations

import pytest

from hybrid_reference import assert_matches_transformers, our_llm
from homelab_llm.engine.layers.moe import SparseMoeBlock
from moe_reference import make_hf_qwen3_5_moe, make_hf_qwen3_next

ATOL = 1e-3
PROMPTS = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (70, 5, 23)]
# family -> (checkpoint maker, its sparse layers)
FAMILIES = {"qwen3_5_moe": (make_hf_qwen3_5_moe, [0, 1, 2, 3]),
            "qwen3_next": (make_hf_qwen3_next, [0, 2, 3])}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(request.param)
    hf = FAMILIES[request.param][0](folder)
    llm = our_llm(folder)
    yield request.param, hf, llm
    llm.shutdown()


def test_config_and_layers(pair):
    family, _, llm = pair
    cfg = llm.engine.model_config
    assert cfg.architecture == family and cfg.is_hybrid and cfg.is_moe
    assert cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 48
    layers = llm.engine.runner.model.model.layers
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == list(cfg.moe_layers) == FAMILIES[family][1]
    assert all(layers[i].mlp.shared_expert is not None for i in sparse)


def test_matches_transformers_batched_and_alone(pair):
    _, hf, llm = pair
    assert_matches_transformers(hf, llm, PROMPTS, ATOL)
