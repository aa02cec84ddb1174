"""Tiny random Qwen3.5 hybrids (transformers 5.x) for the hybrid-model tests: save one to a folder,
run transformers on it, and run our engine on the same folder."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from homelab_llm.engine.llm import LLM
from homelab_llm.engine.sampling_params import SamplingParams

# 2 linear-attention layers then 1 full-attention layer, twice; every split divisible by 2.
TEXT_SHAPE: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)


# The linear-attention branch's output gate (z) and out projection scaled up. At the default
# init (std 0.02) a tiny model's GDN output reaches the residual so weakly that its greedy tokens
# do not notice even a wrong state (a conv state scaled by 1.5 mid-run: same tokens; a prefix
# snapshot without its conv state: same tokens), and its logits hardly test the GDN math against
# transformers'; with this gain they do.
GDN_GAIN = 10.0


@torch.no_grad()
def perturb_hybrid(model, gdn_gain: float = GDN_GAIN) -> None:
    """Norm weights and the decay parameters start at constants: randomise them so the (1 + w)
    norms and the gating are exercised; gdn_gain scales the GDN branch's z and out projection."""
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "dt_bias")):
            p.normal_(0.0, 0.2)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.0)
        elif "linear_attn.out_proj" in name or "linear_attn.in_proj_z" in name:
            p.mul_(gdn_gain)


def make_hf_qwen3_5(folder: Path, seed: int = 0, conditional: bool = False, gdn_gain: float = GDN_GAIN,
                    **overrides: Any):
    """A random Qwen3_5ForCausalLM (or the ForConditionalGeneration layout) saved to `folder`;
    returns the text model (a CausalLM) in fp32, eval mode. Norm weights and the decay
    parameters are randomised too, so the (1 + w) norms and gating are exercised (gdn_gain:
    perturb_hybrid's)."""
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig)

    torch.manual_seed(seed)
    text = Qwen3_5TextConfig(**{**TEXT_SHAPE, **overrides})
    if conditional:
        cfg = Qwen3_5Config(text_config=text.to_dict(),
                            vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 32,
                                           "num_heads": 2, "out_hidden_size": 64},
                            tie_word_embeddings=text.tie_word_embeddings)
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = Qwen3_5ForCausalLM(text)
    perturb_hybrid(model, gdn_gain)
    model.float().eval()
    model.save_pretrained(folder)
    if conditional:
        causal = Qwen3_5ForCausalLM(text).float().eval()
        causal.model.load_state_dict(model.model.language_model.state_dict())
        causal.lm_head.load_state_dict(model.lm_head.state_dict())
        return causal
    return model


@torch.no_grad()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def our_llm(folder: Path, **engine_args: Any) -> LLM:
    defaults: dict[str, Any] = dict(device="cpu", dtype="float32", page_size=4,
                                    kv_cache_memory_bytes=1 << 20, seed=0,
                                    tokenizer=str(folder / "config.json"))
    defaults.update(engine_args)
    return LLM(str(folder), **defaults)


def slot_states(llm: LLM, seq) -> list[torch.Tensor]:
    """Every GDN layer's (conv, recurrent) state of a running sequence, its pending verify rows
    applied (kernels/gdn_pending.replay_slot)."""
    from homelab_llm.engine.cache.verify_slots import slot_word
    from homelab_llm.engine.kernels.gdn_pending import replay_slot

    pool = llm.engine.runner.state_pool
    if not pool.pending:
        return [t[seq.state_slot].clone() for pair in zip(pool.conv_states, pool.ssm_states) for t in pair]
    return [t for args in zip(pool.conv_states, pool.ssm_states, pool.pending)
            for t in replay_slot(*args, slot_word(seq))]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def assert_matches_transformers(hf, llm: LLM, prompts: list[list[int]], atol: float = 1e-3,
                                tokens: int = 5) -> None:
    """Last-token logits of a batched prefill within atol of transformers', and greedy tokens
    identical to transformers' whether the prompts run batched or one at a time."""
    from test_model_qwen3_5 import last_logits

    got = last_logits(llm, prompts)
    want = torch.stack([hf_last_logits(hf, p) for p in prompts])
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    expected = [hf_greedy(hf, p, tokens) for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, greedy(tokens))]
    alone = [llm.generate([p], greedy(tokens))[0].token_ids for p in prompts]
    assert batched == alone == expected


def transformers_config(asset: Path, folder: Path, class_name: str):
    """transformers' own reading of a model_configs asset, which must be a class_name (the test
    is skipped on a transformers without it)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, class_name):
        pytest.skip(f"this transformers has no {class_name}")
    shutil.copy(asset, folder / "config.json")
    hf = transformers.AutoConfig.from_pretrained(folder)
    assert type(hf).__name__ == class_name
    return hf
