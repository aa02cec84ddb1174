"""Tiny model files for the scan tests: GGUF files (gguf's writer), HF folders (safetensors
written from numpy) and a Hub cache layout with blobs and snapshot symlinks. Shapes are small
so every file is a few KB; the element counts are known, so parameter totals are checkable."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def dense_shapes() -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of a tiny Llama (untied lm_head)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN),
                                          "model.norm.weight": (HIDDEN,),
                                          "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                   p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER)}
    return shapes


DENSE_PARAMS = sum(math.prod(s) for s in dense_shapes().values())


def llama_config(**overrides: Any) -> dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
            "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16", **overrides}


def write_hf(folder: Path, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def dense_hf(folder: Path, **overrides: Any) -> Path:
    tensors = {n: np.zeros(s, np.float16) for n, s in dense_shapes().items()}
    return write_hf(folder, llama_config(**overrides), tensors)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ = {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "gemm", "zero_point": True}
AUTOROUND = {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
             "packing_format": "auto_round:auto_gptq"}


def quantized_hf(folder: Path, quant: dict[str, Any] = GPTQ) -> Path:
    """4-bit: every layer linear as an int32 qweight plus scales/qzeros (GPTQ layout [in/8, out],
    AWQ [in, out/8]); embeddings, norms and lm_head stay fp16."""
    awq = quant["quant_method"] == "awq"
    tensors: dict[str, np.ndarray] = {}
    for name, shape in dense_shapes().items():
        module = name.removesuffix(".weight")
        if len(shape) == 2 and "layers" in name:
            out_f, in_f = shape
            groups = max(in_f // 128, 1)
            tensors[module + ".qweight"] = np.zeros((in_f, out_f // 8) if awq else (in_f // 8, out_f), np.int32)
            tensors[module + ".scales"] = np.zeros((groups, out_f), np.float16)
            tensors[module + ".qzeros"] = np.zeros((groups, out_f // 8), np.int32)
            if not awq:
                tensors[module + ".g_idx"] = np.zeros((in_f,), np.int32)
        else:
            tensors[name] = np.zeros(shape, np.float16)
    return write_hf(folder, llama_config(quantization_config=quant), tensors)


NUM_EXPERTS, TOP_K = 4, 2


def moe_hf(folder: Path) -> tuple[Path, int, int]:
    """A Mixtral-shaped folder (not supported by the engine): returns (folder, total, active)."""
    tensors = {n: np.zeros(s, np.float16) for n, s in dense_shapes().items() if ".mlp." not in n}
    expert = 0
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.block_sparse_moe.gate.weight"] = np.zeros((NUM_EXPERTS, HIDDEN), np.float16)
        for e in range(NUM_EXPERTS):
            for w, shape in (("w1", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER)), ("w3", (INTER, HIDDEN))):
                tensors[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] = np.zeros(shape, np.float16)
                expert += math.prod(shape)
    total = sum(t.size for t in tensors.values())
    dense = total - expert
    config = llama_config(model_type="mixtral", architectures=["MixtralForCausalLM"],
                          num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    return write_hf(folder, config, tensors), total, dense + expert * TOP_K // NUM_EXPERTS


def write_gguf(path: Path, arch: str = "llama", experts: int = 0) -> Path:
    """A tiny GGUF (F32 tensors); arch other than llama/qwen2/qwen3 is one the engine refuses.
    experts > 0 adds qwen3moe-style stacked expert tensors (ffn_*_exps) with top-2 routing."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(TOP_K)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)  # llama.cpp's own mapping
    for name, shape in dense_shapes().items():
        gname = names.get_name(name, try_suffixes=(".weight",))
        if experts and ".mlp." in name:  # stacked experts: ffn_gate -> ffn_gate_exps
            gname = gname.replace(".weight", "_exps.weight")
            shape = (experts, *shape)
        w.add_tensor(gname, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hub_cache(root: Path, repo_id: str, make: Any, revision: str = "0123456789abcdef") -> Path:
    """huggingface_hub's layout: files in blobs/, snapshots/<rev>/ holds symlinks to them."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    staging = make(root / "staging" / repo_id)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(staging.iterdir()):
        blob = repo / "blobs" / f"blob-{f.name}"
        f.rename(blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snap
