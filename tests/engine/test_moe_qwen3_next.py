"""Qwen3-Next (hybrid Gated DeltaNet with fused per-key-head projections + experts + sigmoid-gated
shared expert + a dense mlp_only layer) vs transformers 5 on a tiny random checkpoint, through
the whole engine; its config layouts; TP=2 == TP=1; bad checkpoints named.

Tolerance: fp32 both sides; last-token logits within 1e-3 absolute (observed ~1e-5) and identical
greedy tokens; a batch gives what each prompt gives alone. TP=2 (gloo): logits within 1e-4 of
the largest logit (the all-reduce only reorders sums), greedy tokens identical.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybrid_reference import greedy, hf_greedy, hf_last_logits, our_llm
from homelab_llm.engine.layers.moe import SparseMoeBlock
from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR, ModelLoadError, config_from_hf
from homelab_llm.engine.model.loader import load_model, load_model_config
from homelab_llm.engine.model.split_tensor import SplitTensor
from moe_reference import make_hf_qwen3_next
from test_model_qwen3_5 import last_logits

ATOL = 1e-3
PROMPTS = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (70, 5, 23)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    return folder, make_hf_qwen3_next(folder)


@pytest.fixture(scope="module")
def pair(folder):
    path, hf = folder
    llm = our_llm(path)
    yield hf, llm
    llm.shutdown()


def test_config_and_layers(pair):
    _, llm = pair
    cfg = llm.engine.model_config
    assert cfg.architecture == "qwen3_next" and cfg.is_hybrid and cfg.is_moe
    assert cfg.moe_layers == (0, 2, 3) and cfg.shared_expert_intermediate_size == 48
    layers = llm.engine.runner.model.model.layers
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == [0, 2, 3] and all(layers[i].mlp.shared_expert is not None for i in sparse)


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


def test_tp2_equals_tp1(tmp_path):
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (37, 5)]
    make_hf_qwen3_next(tmp_path, seed=2)
    results = []
    for tp in (1, 2):
        llm = our_llm(tmp_path, tensor_parallel_size=tp)
        try:
            results.append((last_logits(llm, prompts),
                            [c.token_ids for c in llm.generate(prompts, greedy(4))]))
        finally:
            llm.shutdown()
    (l1, t1), (l2, t2) = results
    assert (l1 - l2).abs().max() <= 1e-4 * l1.abs().max()
    assert t1 == t2


def test_grouped_split_matches_the_reference_ordering():
    """SplitTensor with groups cuts rows as transformers' fix_query_key_value_ordering does."""
    hk, r, dk, dv = 2, 3, 2, 4
    rows = torch.arange(hk * (2 * dk + 2 * r * dv)).float().unsqueeze(1)
    split = SplitTensor("in_proj_qkvz", (("q", hk * dk), ("k", hk * dk), ("v", hk * r * dv),
                                         ("z", hk * r * dv)), groups=hk)
    per_head = rows.view(hk, -1)
    want = torch.split(per_head, [dk, dk, r * dv, r * dv], dim=1)
    for (name, got), ref in zip(split.take(rows), want):
        assert torch.equal(got.view(-1), ref.reshape(-1)), name
    with pytest.raises(ValueError, match="do not split into 4 groups"):
        SplitTensor("in_proj_ba", (("b", 6), ("a", 6)), groups=4)


PUBLISHED = {  # the old (transformers 4.57) layout, as Qwen3-Next-80B-A3B's config.json
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 320,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_scaling": None,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
}


def test_old_and_transformers5_config_layouts():
    old = config_from_hf(PUBLISHED)
    assert old.layer_types == (LAYER_LINEAR,) * 3 + (LAYER_FULL,) + (LAYER_LINEAR,) * 3 + (LAYER_FULL,)
    assert (old.rope_theta, old.partial_rotary_factor, old.attn_output_gate) == (1e7, 0.25, True)
    assert old.moe_layers == tuple(range(8)) and old.norm_topk_prob and old.qk_norm
    new = {k: v for k, v in PUBLISHED.items()
           if k not in ("full_attention_interval", "rope_theta", "rope_scaling", "partial_rotary_factor")}
    new.update(layer_types=list(old.layer_types), rope_parameters={
        "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25})
    assert config_from_hf(new) == old
    sparse_step = config_from_hf({**PUBLISHED, "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert sparse_step.moe_layers == (1, 3, 7)


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))


def _load(path):
    return load_model(load_model_config(path), path, "auto", torch.float32, "cpu")


def test_missing_expert_tensor_is_named(folder, tmp_path):
    src, _ = folder
    _rewrite(src, tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"layers\.2\.mlp\.experts\.w13\[up_proj of expert 5\]"):
        _load(tmp_path)


def test_router_shape_mismatch_is_named(folder, tmp_path):
    src, _ = folder

    def shrink(t):
        t["model.layers.0.mlp.gate.weight"] = t["model.layers.0.mlp.gate.weight"][:6].clone()
    _rewrite(src, tmp_path, shrink)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.gate\.weight: router weight "
                                             r"is \(6, 64\), expected \(8, 64\)"):
        _load(tmp_path)


def test_fused_projection_shape_mismatch_is_named(folder, tmp_path):
    src, _ = folder

    def shrink(t):
        name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
        t[name] = t[name][:-8].clone()
    _rewrite(src, tmp_path, shrink)
    with pytest.raises(ModelLoadError, match=r"in_proj_qkvz\.weight: 88 rows, expected 96"):
        _load(tmp_path)
