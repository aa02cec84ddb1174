"""GPTQ / AWQ mixture-of-experts checkpoints loaded as stacked 4-bit experts (model/w4a16_experts.py).

Checkpoints are written with the test-side packer of test_w4a16_checkpoint.py (from the format
definitions); the reference folder holds the same model with the dequantized weights as plain
fp32 tensors. Tolerance: our fp32 logits vs the reference's, relative (Frobenius) < 1e-4 (the same
dequantized numbers on both sides; observed ~1e-6).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts
from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError
from homelab_llm.engine.model.loader import load_model, load_model_config
from model_reference import PagedHarness
from moe_reference import make_hf_moe
from test_w4a16_checkpoint import quant_tensors, quantize

SHAPE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, mlp_only_layers=[],
             num_hidden_layers=2, num_experts=4)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _is_quantized(name: str) -> bool:
    return name.endswith("_proj.weight") and (".experts." in name or ".self_attn." in name)


def per_expert_state(hf) -> dict[str, torch.Tensor]:
    """hf's state dict with transformers 5's fused expert tensors split per expert, as
    save_pretrained (and every quantizer) writes them."""
    out = {}
    for name, tensor in hf.state_dict().items():
        t = tensor.detach().clone()
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter].contiguous()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            out[name] = t
    return out


def write_pair(hf, root: Path, packing: str, group: int, act_order: bool = False,
               drop: str | None = None) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    quant_dir, ref_dir = root / "quant", root / "ref"
    for d in (quant_dir, ref_dir):
        hf.save_pretrained(d, safe_serialization=True)
    gen = torch.Generator().manual_seed(3)
    quant_state, ref_state = {}, {}
    for name, tensor in per_expert_state(hf).items():
        if not _is_quantized(name):
            quant_state[name] = ref_state[name] = tensor
            continue
        k = tensor.shape[1]
        g_idx = torch.arange(k) // group
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        parts = quantize(tensor, group, False, g_idx)
        parts["g_idx"] = g_idx
        module = name.removesuffix(".weight")
        for suffix, t in quant_tensors(parts, packing).items():
            if f"{module}.{suffix}" != drop:
                quant_state[f"{module}.{suffix}"] = t
        ref_state[name] = parts["dequant"]
    save_file(quant_state, str(quant_dir / "model.safetensors"))
    save_file(ref_state, str(ref_dir / "model.safetensors"))
    cfg = json.loads((quant_dir / "config.json").read_text())
    cfg["quantization_config"] = (
        dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm")
        if packing == "awq" else
        dict(quant_method="gptq", bits=4, group_size=group, sym=False, desc_act=act_order))
    (quant_dir / "config.json").write_text(json.dumps(cfg))
    return quant_dir, ref_dir


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_moe(tmp_path_factory.mktemp("hf"), **SHAPE)


def _logits(folder: Path) -> tuple[torch.Tensor, torch.nn.Module]:
    model = load_model(load_model_config(folder), folder, "auto", torch.float32, "cpu")
    harness = PagedHarness(model, page_size=4)
    out = [harness.step({"s": PROMPT}), harness.step({"s": [7]})]
    return torch.cat(out), model


@pytest.mark.parametrize("packing,group", [("gptq", 32), ("awq", 64)])
def test_quantized_experts_match_the_dequantized_reference(hf, tmp_path, packing, group):
    quant_dir, ref_dir = write_pair(hf, tmp_path, packing, group)
    got, model = _logits(quant_dir)
    want, _ = _logits(ref_dir)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.w4 is not None and m.w13 is None for m in experts)
    assert experts[0].w4.w13.qweight.shape == (4, 128 // 8, 2 * 128)
    assert float((got - want).norm() / want.norm()) < 1e-4
    # GPTQ / AWQ zero points are integers: the stacked experts say so (the left-operand GEMMs'
    # exact form reads it), and a move keeps it
    experts[0].to(torch.device("cpu"))
    assert experts[0].w4.w13.int_zeros and experts[0].w4.w2.int_zeros


def test_missing_expert_qweight_is_named(hf, tmp_path):
    quant_dir, _ = write_pair(hf, tmp_path, "gptq", 32,
                              drop="model.layers.1.mlp.experts.2.down_proj.qweight")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.w2\[down_proj of expert 2\]"):
        _logits(quant_dir)


def test_act_order_experts_are_refused(hf, tmp_path):
    quant_dir, _ = write_pair(hf, tmp_path, "gptq", 32, act_order=True)
    with pytest.raises(UnsupportedModelError, match=r"experts\.0\.\w+_proj: act-order"):
        _logits(quant_dir)


def test_tp_shard_must_hold_whole_groups():
    from homelab_llm.engine.parallel import state as parallel
    from homelab_llm.engine.kernels.w4a16_pack import quantize_rtn
    from homelab_llm.engine.model.w4a16_experts import shard_expert

    parallel.set_parallel_state(1, 2)
    try:
        experts = FusedExperts(2, 128, 192)  # 96 intermediate features per rank
    finally:
        parallel.set_parallel_state(0, 1)
    down = quantize_rtn(torch.randn(128, 192), 64)
    with pytest.raises(UnsupportedModelError, match="cut through its quantization groups of 64"):
        shard_expert(experts, ExpertPart("down", 0), down, "experts.0.down_proj")
    gate = shard_expert(experts, ExpertPart("gate", 0), quantize_rtn(torch.randn(192, 128), 64), "g")
    assert (gate.in_features, gate.out_features) == (128, 96)
