"""The CPU's fast default for a 4-bit model (device.fast_cpu_default): the model runs in fp32,
its 4-bit linears through our AVX2 kernel (kernels/q4_native.py) or, where that does not run,
torch's int4 kernel in bf16 (kernels/w4a16_cpu.py), and its LM head through an int8 copy
(kernels/int8_cpu.py). Applied once, after the weights are loaded.

Per decode token this reads the 4-bit weights and the int8 head instead of an fp32 copy of
everything (SmolLM2-135M: ~100 MB instead of ~540 MB). The exact mode (--dtype float32) never
comes here.

A small model (its 4-bit linears <= w4a16_cpu.DENSE_CACHE_BYTES dense) also keeps a dense copy of
each (fp32: w4a16_cpu.DENSE_DTYPE) for prompt processing, which otherwise dequantizes every
weight on every call.
A Llama-style model (Llama, Mistral, Qwen2, Qwen3) also gets its plan for steps of few new tokens
(model/cpu_decode_layer.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from homelab_llm.engine.kernels import q4_native, w4a16_cpu
from homelab_llm.engine.layers.embedding import ParallelLMHead
from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.model.cpu_decode_layer import CpuDecodePlan
from homelab_llm.engine.model.llama import LlamaModel

log = logging.getLogger("homelab_llm.engine")


def use_cpu_kernels(model: nn.Module) -> None:
    packed = []
    for module in model.modules():
        if isinstance(module, LinearBase) and module.w4 is not None:
            module.compute_w4_in(torch.bfloat16)
            if module.w4.cpu_pack is not None:
                packed.append(module)
    dtype = w4a16_cpu.DENSE_DTYPE
    dense_bytes = sum(dtype.itemsize * m.w4.in_features * m.w4.out_features for m in packed)
    if dense_bytes <= w4a16_cpu.DENSE_CACHE_BYTES:
        for module in packed:
            module.w4.cpu_pack.dense = w4a16_cpu.dequantize_dense(module.w4, dtype)
            # Registered so memory accounting counts it.
            module.register_buffer("w4_cpu_dense", module.w4.cpu_pack.dense, persistent=False)
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        head.quantize_for_cpu()
    decoder = getattr(model, "model", None)
    if isinstance(decoder, LlamaModel):
        decoder.cpu_decode = CpuDecodePlan.build(decoder)
    native = sum(m.w4.cpu_pack.native is not None for m in packed)
    rest = ""
    if native < len(packed):
        reason = q4_native.unavailable_reason() or "act-order or group sizes it does not take"
        rest = f", the rest on torch's int4 kernel ({reason})"
    log.info("CPU 4-bit linears: %d of %d on our AVX2 kernel%s", native, len(packed), rest)
