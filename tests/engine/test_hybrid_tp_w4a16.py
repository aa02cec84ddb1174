"""A W4A16 (AutoRound) Qwen3.5 hybrid checkpoint over two gloo ranks equals one rank: the 4-bit
Gated DeltaNet projections are cut per part by heads (column-parallel q|k|v|z) and on whole
quantization groups (row-parallel out_proj)."""

from __future__ import annotations

from hybrid_reference import greedy, make_hf_qwen3_5, our_llm
from test_model_qwen3_5 import last_logits
from test_w4a16_checkpoint import write_checkpoints
from test_w4a16_qwen3_5 import CASES, HYBRID_LINEARS

# Every row-parallel input a multiple of the group (32) on each of two ranks.
SHAPE = dict(intermediate_size=128, linear_value_head_dim=16, linear_key_head_dim=16)
PROMPTS = [[(3 * i + 1) % 300 + 3 for i in range(n)] for n in (70, 9)]


def run(folder, tp: int):
    llm = our_llm(folder, tensor_parallel_size=tp, enable_prefix_caching=False)
    try:
        return last_logits(llm, PROMPTS), [c.token_ids for c in llm.generate(PROMPTS, greedy(4))]
    finally:
        llm.shutdown()


def test_w4a16_hybrid_tp2_equals_tp1(tmp_path):
    hf = make_hf_qwen3_5(tmp_path / "src", seed=7, **SHAPE)
    quant_dir, _ = write_checkpoints(hf, tmp_path, CASES["autoround-asym-g32-extra-config"],
                                     "gptq_v2", 32, False, linears=HYBRID_LINEARS)
    l1, t1 = run(quant_dir, 1)
    l2, t2 = run(quant_dir, 2)
    assert (l1 - l2).abs().max() <= 1e-3 * l1.abs().max()
    assert t1 == t2
