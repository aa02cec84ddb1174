"""The CPU's fast default for a 4-bit model (device.fast_cpu_default): the model runs in fp32,
its 4-bit linears through torch's int4 kernel in bf16 (kernels/w4a16_cpu.py) and its LM head
through an int8 copy (kernels/int8_cpu.py). Applied once, after the weights are loaded.

Per decode token this reads the 4-bit weights and the int8 head instead of an fp32 copy of
everything (SmolLM2-135M: ~100 MB instead of ~540 MB). The exact mode (--dtype float32) never
comes here.
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.layers.embedding import ParallelLMHead
from homelab_llm.engine.layers.linear import LinearBase


def use_cpu_kernels(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, LinearBase) and module.w4 is not None:
            module.compute_w4_in(torch.bfloat16)
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        head.quantize_for_cpu()
