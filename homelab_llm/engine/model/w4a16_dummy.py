"""Random packed 4-bit weights for `--load-format dummy --quantization w4a16`: lets a GPU
benchmark run a Llama-3.1-8B or Qwen3-32B shape in W4A16 with no checkpoint, with the memory and
bandwidth of the real thing.

Every linear gets symmetric group-128 int4 weights (the common GPTQ/AutoRound setting; 64 or 32
where the input size is not a multiple of 128), drawn on its own device from a generator seeded
by its name and rank, so a run is repeatable. The weights have roughly the dense dummy's spread
(loader.DUMMY_STD). Embeddings and lm_head stay dense (the loader's dense dummy fill), and so do
the Gated DeltaNet's in_proj_b / in_proj_a (one column per value head: real AutoRound checkpoints
keep them 16-bit, and engine/gdn_memory.py plans them so).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from homelab_llm.engine.parallel.state import tp_rank
from homelab_llm.engine.kernels.w4a16_pack import SUPPORTED_GROUP_SIZES, W4Weight
from homelab_llm.engine.kernels.moe_ref import MoeW4
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.layers.moe import FusedExperts, Router

DUMMY_GROUP_SIZE = 128
# Uniform nibbles minus 8 have std ~4.6: this scale gives weights of std ~0.02.
_BASE_SCALE = 0.02 / 4.6
# Linears that 4-bit checkpoints leave dense, by the last part of their module name.
DENSE_LINEARS = ("in_proj_ba", "fc")  # fc: the MTP head's input projection (model/mtp.py)


def _group_for(in_features: int) -> int | None:
    for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if g <= DUMMY_GROUP_SIZE and in_features % g == 0:
            return g
    return None


def random_w4(in_features: int, out_features: int, group_size: int, gen: torch.Generator,
              device: torch.device, lead: tuple[int, ...] = ()) -> W4Weight:
    """Symmetric int4 (zero 8) with per-group scales in [0.5, 1.5) x the base scale; `lead`
    prepends dimensions (experts stacked: lead=(E,))."""
    # Every bit pattern of an int32 word is 8 valid nibbles.
    qweight = torch.randint(-(2 ** 31), 2 ** 31, (*lead, in_features // 8, out_features),
                            generator=gen, device=device, dtype=torch.int64).to(torch.int32)
    groups = in_features // group_size
    scales = (torch.rand(*lead, groups, out_features, generator=gen, device=device) + 0.5) * _BASE_SCALE
    scales = scales.half()
    return W4Weight(qweight, scales, (-8.0 * scales.float()).half(), group_size, int_zeros=True)


@torch.no_grad()
def fill_dummy_w4(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Give every deferred linear random 4-bit weights (or, if no group size fits its input, a
    real dense placeholder for the dense dummy fill that follows)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            _fill_experts(name, module, device, seed)
            continue
        if not isinstance(module, LinearBase):
            continue
        group = _group_for(module.in_features)
        dense = isinstance(module, Router) or name.rsplit(".", 1)[-1] in DENSE_LINEARS
        if group is None or dense:  # 4-bit checkpoints keep routers (and in_proj_ba) dense
            module.materialize(device, dtype)
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + zlib.crc32(f"{name}.w4@{tp_rank()}".encode()))
        module.set_w4(random_w4(module.in_features, module.out_features, group, gen, device),
                      dtype)


def _fill_experts(name: str, experts: FusedExperts, device: torch.device, seed: int) -> None:
    """Stacked random 4-bit experts (gate_up [H, 2I] and down [I, H] per expert)."""
    e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_local
    groups = (_group_for(h), _group_for(i))
    if None in groups:
        raise ValueError(f"{name}: no 4-bit group size divides hidden {h} / expert width {i}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + zlib.crc32(f"{name}.w4@{tp_rank()}".encode()))
    experts.set_w4(MoeW4(random_w4(h, 2 * i, groups[0], gen, device, lead=(e,)),
                         random_w4(i, h, groups[1], gen, device, lead=(e,))))
