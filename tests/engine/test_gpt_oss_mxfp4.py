"""gpt-oss as published: MXFP4 experts (`*_blocks` + `*_scales`, quant_method mxfp4) kept resident
in MXFP4. The dequantization matches transformers' own; a tiny MXFP4 checkpoint gives the logits of
the transformers model holding the dequantized experts (fp32, 1e-3); its experts load as uint8
codes (no dense copy), and two tensor-parallel ranks (each a K slice of whole 32-groups of the down
projection) give the one-rank logits (1e-4: only the all-reduce order differs)."""

from __future__ import annotations

import json

import pytest
import torch

from homelab_llm.engine.kernels.moe_gptoss_ref import dequantize_mxfp4_ref
from model_reference import hf_logits, load_ours
from sliding_reference import make_sliding_model

PROMPT = [(5 * i + 2) % 200 for i in range(30)]


def _random_mxfp4(gen: torch.Generator, rows: tuple[int, ...], cols: int):
    blocks = torch.randint(0, 256, (*rows, cols // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(117, 123, (*rows, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_dequantization_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(torch.Generator().manual_seed(0), (3, 40), 96)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = dequantize_mxfp4_ref(blocks, scales, torch.float32).transpose(1, 2)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4_ref(blocks, scales[..., :1], torch.float32)


def _mxfp4_checkpoint(tmp_path):
    """A tiny gpt-oss whose experts are random MXFP4 codes: (the transformers model holding the
    dequantized experts, the folder of the published-layout checkpoint)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = make_sliding_model("gpt_oss", tmp_path / "bf16")
    cfg = hf.config
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for proj, rows, cols in (("gate_up_proj", 2 * cfg.intermediate_size, cfg.hidden_size),
                                     ("down_proj", cfg.hidden_size, cfg.intermediate_size)):
                blocks, scales = _random_mxfp4(gen, (cfg.num_local_experts, rows), cols)
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                tensors[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                tensors[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    for name, value in hf.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = value.contiguous()
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    raw = json.loads((tmp_path / "bf16" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(raw))
    return hf, folder


def test_mxfp4_checkpoint_matches_transformers(tmp_path) -> None:
    from model_reference import PagedHarness

    hf, folder = _mxfp4_checkpoint(tmp_path)
    config, ours = load_ours(folder)
    assert config.quantization is None and config.experts_mxfp4
    experts = ours.model.layers[0].mlp.experts
    assert experts.w13 is None and experts.gate_up_proj_blocks.dtype == torch.uint8
    harness = PagedHarness(ours, page_size=4)
    got = torch.cat([harness.step({"s": PROMPT[:17]}), harness.step({"s": PROMPT[17:]})])
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), atol=1e-3, rtol=0)


def test_mxfp4_two_ranks_match_one(tmp_path) -> None:
    from model_reference import chunked_logits, two_rank_logits

    _, folder = _mxfp4_checkpoint(tmp_path)
    _, single = load_ours(folder)
    expected = chunked_logits(single, PROMPT, [35, 89, 79])
    got = two_rank_logits(folder, tmp_path, PROMPT, [35, 89, 79])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
