"""W4A16 (GPTQ / AutoRound) checkpoints of the Qwen3.5 hybrid family: the in/out projections of
Gated DeltaNet, the gated attention and the MLP load 4-bit; what the checkpoint keeps in 16 bit
(in_proj_b / in_proj_a, the conv, norms, per its extra_config / dynamic rules) stays dense.

Reference: the same model with the dequantized weights as plain fp32 linears (the packer of
test_w4a16_checkpoint.py). Tolerance: relative (Frobenius) logits error < 1e-3 (observed ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_reference import make_hf_qwen3_5
from homelab_llm.engine.model.loader import load_model, load_model_config
from test_w4a16_checkpoint import write_checkpoints

HYBRID_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                  "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[(5 * i + 2) % 300 + 3 for i in range(n)] for n in (70, 9)]
CASES = {
    "autoround-asym-g32-extra-config": dict(
        quant_method="auto-round", bits=4, group_size=32, sym=False, data_type="int",
        packing_format="auto_round",
        extra_config={f"model.layers.{i}.linear_attn.in_proj_{x}": {"bits": 16, "data_type": "float"}
                      for i in (0, 2) for x in ("a", "b")}),
    "gptq-sym-g32-dynamic-z-dense": dict(
        quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=False,
        dynamic={r"-:.*linear_attn\.in_proj_z": {}}),
}


def logits(folder, prompts) -> torch.Tensor:
    from hybrid_reference import our_llm
    from test_model_qwen3_5 import last_logits

    llm = our_llm(folder, enable_prefix_caching=False)
    try:
        return last_logits(llm, prompts)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_qwen3_5(tmp_path_factory.mktemp("hf"), seed=3)


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_w4a16_checkpoint_matches_dequantized(hf, tmp_path, case):
    quant = CASES[case]
    dense = {f"model.layers.{i}.linear_attn.in_proj_z" for i in (0, 2)} if "dynamic" in quant else set()
    linears = HYBRID_LINEARS
    quant_dir, ref_dir = write_checkpoints(hf, tmp_path, quant, "gptq" if "gptq" in case else "gptq_v2",
                                           32, quant.get("sym", False), dense=dense, linears=linears)
    config = load_model_config(quant_dir)
    model = load_model(config, quant_dir, "auto", torch.float32, "cpu")
    layer = model.model.layers[0].linear_attn
    assert layer.in_proj_qkvz.w4 is None if dense else layer.in_proj_qkvz.w4 is not None
    assert layer.in_proj_ba.w4 is None and layer.in_proj_ba.weight is not None
    assert layer.out_proj.w4 is not None and model.model.layers[1].mlp.gate_up_proj.w4 is not None
    assert model.model.layers[1].self_attn.qkv_proj.w4 is not None
    got, ref = logits(quant_dir, PROMPTS), logits(ref_dir, PROMPTS)
    assert float((got - ref).norm() / ref.norm()) < 1e-3


def test_conditional_generation_autoround_checkpoint(tmp_path):
    """The published layout: model.language_model.* quantized, model.visual.* kept as it is."""
    from transformers import Qwen3_5ForConditionalGeneration

    make_hf_qwen3_5(tmp_path / "src", seed=6, conditional=True)
    full = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "src").float().eval()
    quant = CASES["autoround-asym-g32-extra-config"]
    quant = {**quant, "extra_config": {k.replace("model.", "model.language_model.", 1): v
                                       for k, v in quant["extra_config"].items()}}
    # write_checkpoints matches what follows "model.language_model.layers." as "N.module".
    linears = tuple(f"{i}.{name}" for i in range(4) for name in HYBRID_LINEARS)
    quant_dir, ref_dir = write_checkpoints(full, tmp_path, quant, "gptq_v2", 32, False,
                                           linears=linears)
    config = load_model_config(quant_dir)
    model = load_model(config, quant_dir, "auto", torch.float32, "cpu")
    assert model.model.layers[0].linear_attn.in_proj_qkvz.w4 is not None
    got, ref = logits(quant_dir, PROMPTS), logits(ref_dir, PROMPTS)
    assert float((got - ref).norm() / ref.norm()) < 1e-3
