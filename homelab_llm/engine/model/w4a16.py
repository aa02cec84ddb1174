"""W4A16 straight from GGUF blocks: a linear whose every fused part is stored as Q4_0, Q4_1 or
Q4_K keeps 4-bit weights (kernels/w4a16_pack.W4Weight, group 32) and never exists densely on the
device. Other linears (Q6_K, Q8_0, F16 parts: often attn_v and ffn_down in *_K_M files) are
dequantized to the model dtype as usual.
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.model.gguf_file import FOUR_BIT_TYPES, GGUFFile, hf_name


def checkpoint_names(model: nn.Module, module_name: str, module: LinearBase) -> list[str]:
    """HF tensor names fused into `module`'s weight, in part order."""
    parent, _, leaf = module_name.rpartition(".")
    by_part = {sid: ckpt for ckpt, (fused, sid) in model.packed_modules.items() if fused == leaf}
    for ckpt, split in model.split_modules.items():  # one tensor, several parts
        if split.fused == leaf:
            by_part.update({sid: ckpt for sid, _ in split.parts})
    if not by_part:
        return [f"{module_name}.weight"]
    return [f"{parent}.{by_part[sid]}.weight" for sid in module.part_ids()]


def plan_w4a16(model: nn.Module, gguf: GGUFFile) -> dict[str, list[str]]:
    """module name -> its GGUF tensor names, for the linears that can stay 4-bit."""
    by_hf = {hf_name(t.name): t for t in gguf.tensors.values()}
    plan: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        tensors = [by_hf.get(n) for n in checkpoint_names(model, name, module)]
        if all(t is not None and t.type_name in FOUR_BIT_TYPES for t in tensors):
            plan[name] = [t.name for t in tensors]
    return plan


def install_w4(module: LinearBase, device: torch.device | str,
               activation_dtype: torch.dtype | None = None) -> None:
    """Repack this rank's shard of each recorded part and fuse them along the outputs."""
    from homelab_llm.engine.kernels.w4a16_pack import W4Weight, repack_gguf

    parts = []
    for sid in module.part_ids():
        blocks, rows, cols = module.gguf_blocks[sid]
        raw = torch.from_numpy(blocks.raw.copy())  # the map is read-only; 4-bit rows are small
        parts.append(repack_gguf(raw, blocks.ggml_type, blocks.shape, blocks.row_order,
                                 rows, cols, device))
    if len(parts) == 1:
        module.set_w4(parts[0], activation_dtype)
        return
    module.set_w4(W4Weight(torch.cat([p.qweight for p in parts], dim=1),
                           torch.cat([p.scales for p in parts], dim=1),
                           torch.cat([p.biases for p in parts], dim=1), parts[0].group_size),
                  activation_dtype)
