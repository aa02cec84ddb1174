"""A GPTQ (W4A16) Qwen3-Next checkpoint: the fused per-key-head in_proj_qkvz / in_proj_ba are cut
into our parts on their 4-bit output columns (model/split_tensor.py through w4a16_checkpoint),
the experts load as stacked 4-bit experts, the gated attention and shared expert 4-bit too; and
the same checkpoint over two gloo ranks equals one rank.

Reference: the same model with the dequantized weights as plain fp32 tensors (the packer of
test_w4a16_checkpoint.py). Tolerance: relative (Frobenius) logits error < 1e-3 (the same numbers
on both sides; observed ~1e-6); TP=2 within 1e-3 of the largest logit, greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_reference import greedy, our_llm
from homelab_llm.engine.layers.moe import FusedExperts
from homelab_llm.engine.model.loader import load_model, load_model_config
from moe_reference import make_hf_qwen3_next
from test_model_qwen3_5 import last_logits
from test_moe_w4a16_checkpoint import per_expert_state
from test_w4a16_checkpoint import write_checkpoints

# Every row-parallel input (out_proj, o_proj, each down_proj) holds whole groups of 32 on 2 ranks.
SHAPE = dict(intermediate_size=128, linear_value_head_dim=16, linear_key_head_dim=16,
             moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4)
GPTQ = dict(quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=False)
LINEARS = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj",
           "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
           *(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
           *(f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")))
PROMPTS = [[(3 * i + 1) % 300 + 3 for i in range(n)] for n in (70, 9)]


class PerExpert:
    """hf as quantizers see it: experts one tensor each (save_pretrained's layout)."""

    def __init__(self, hf):
        self.hf = hf

    def save_pretrained(self, folder, **kwargs):
        self.hf.save_pretrained(folder, **kwargs)

    def state_dict(self):
        return per_expert_state(self.hf)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next_w4")
    hf = make_hf_qwen3_next(root / "src", seed=5, **SHAPE)
    return write_checkpoints(PerExpert(hf), root, GPTQ, "gptq", 32, True, linears=LINEARS)


def run(folder, tp: int = 1):
    llm = our_llm(folder, tensor_parallel_size=tp, enable_prefix_caching=False)
    try:
        return last_logits(llm, PROMPTS), [c.token_ids for c in llm.generate(PROMPTS, greedy(4))]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tp1(folders):
    return run(folders[0], 1)


def test_w4a16_checkpoint_matches_dequantized(folders, tp1):
    quant_dir, ref_dir = folders
    model = load_model(load_model_config(quant_dir), quant_dir, "auto", torch.float32, "cpu")
    gdn = model.model.layers[0].linear_attn
    assert gdn.in_proj_qkvz.w4 is not None and gdn.in_proj_ba.w4 is not None
    assert model.model.layers[3].self_attn.qkv_proj.w4 is not None
    assert model.model.layers[1].mlp.gate_up_proj.w4 is not None  # the dense mlp_only layer
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == 3 and all(m.w4 is not None and m.w13 is None for m in experts)
    got, ref = tp1[0], run(ref_dir)[0]
    assert float((got - ref).norm() / ref.norm()) < 1e-3


def test_w4a16_tp2_equals_tp1(folders, tp1):
    (l1, t1), (l2, t2) = tp1, run(folders[0], 2)
    assert (l1 - l2).abs().max() <= 1e-3 * l1.abs().max()
    assert t1 == t2
