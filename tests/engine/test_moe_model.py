"""Qwen3-MoE vs transformers 5 on a tiny random checkpoint, through paged KV.

Tolerance: fp32 on both sides, 1e-3 absolute on logits of O(10) (observed ~1e-5): a wrong
router (softmax, top-k, renormalisation), expert layout or combine moves them by O(1).
"""

from __future__ import annotations

import pytest
import torch

from model_reference import PagedHarness, hf_logits, load_ours
from moe_reference import make_hf_moe

ATOL = 1e-3
PROMPT = [5, 17, 3, 99, 150, 42, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    hf = make_hf_moe(folder)
    config, ours = load_ours(folder)
    return hf, config, ours, folder


def test_config_reads_the_moe_shape(pair):
    _, config, _, _ = pair
    assert config.architecture == "qwen3_moe" and config.qk_norm
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob and config.mlp_only_layers == (1,)
    assert config.moe_layers == (0, 2)


def test_only_the_sparse_layers_attention_runs_as_an_experts_layer(pair, monkeypatch):
    """The sparse layers (0, 2) run their attention inside pdl.in_experts_layer (their W4A16
    GEMVs launch early on sm_90), the dense layer 1 plainly; the logits are the same either way."""
    from homelab_llm.engine.kernels import pdl
    from homelab_llm.engine.model import llama

    _, _, ours, _ = pair
    assert [layer.experts for layer in ours.model.layers] == [True, False, True]
    calls = []

    def recorded(fn, *args):
        calls.append(args[3])  # the layer's self_attn
        return pdl.in_experts_layer(fn, *args)

    plain = PagedHarness(ours, page_size=4).step({"s": PROMPT})
    monkeypatch.setattr(llama, "in_experts_layer", recorded)
    got = PagedHarness(ours, page_size=4).step({"s": PROMPT})
    layers = ours.model.layers
    assert calls == [layers[0].self_attn, layers[2].self_attn]
    torch.testing.assert_close(got, plain, atol=0, rtol=0)


def test_prefill_then_decode_matches_transformers(pair):
    hf, _, ours, _ = pair
    decode = [60, 61, 62]
    ref = hf_logits(hf, PROMPT + decode)
    harness = PagedHarness(ours, page_size=4)
    got = [harness.step({"s": PROMPT[:6]}), harness.step({"s": PROMPT[6:]})]
    got += [harness.step({"s": [t]}) for t in decode]
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers(pair):
    hf, _, ours, _ = pair
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
    harness = PagedHarness(ours, page_size=4)
    logits = harness.step({"s": PROMPT})
    tokens = []
    for _ in range(6):
        tokens.append(int(logits[-1].argmax()))
        logits = harness.step({"s": [tokens[-1]]})
    assert tokens == expected


def test_batch_equals_one_at_a_time(pair):
    """Three sequences in one step route their tokens to experts exactly as they do alone."""
    _, _, ours, _ = pair
    seqs = {"a": PROMPT[:7], "b": [40, 41, 42, 43, 44], "c": [9]}
    solo = {name: PagedHarness(ours, page_size=4).step({name: ids}) for name, ids in seqs.items()}
    batched = PagedHarness(ours, page_size=4).step(seqs)
    torch.testing.assert_close(batched, torch.cat([solo[n] for n in seqs]), atol=1e-5, rtol=0)


def test_fused_expert_tensors_load_the_same(pair, tmp_path):
    """transformers-5 fused layout (experts.gate_up_proj [E, 2I, H], experts.down_proj) works."""
    from safetensors.torch import load_file, save_file
    import shutil

    _, _, ours, folder = pair
    tensors = load_file(str(folder / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{pre}.{e}.gate_proj.weight") for e in range(8)]
        up = [tensors.pop(f"{pre}.{e}.up_proj.weight") for e in range(8)]
        down = [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(8)]
        fused[f"{pre}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        fused[f"{pre}.down_proj"] = torch.stack(down)
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    save_file({**tensors, **fused}, str(tmp_path / "model.safetensors"))
    _, again = load_ours(tmp_path)
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
