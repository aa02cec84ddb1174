"""StateLayout: the shapes and bytes of one sequence's Gated DeltaNet state on one TP rank.

A hybrid model (Qwen3.5/3.6) keeps, per sequence and per GDN layer, two tensors instead of KV pages:
- the conv state: the last `conv_kernel - 1` inputs of the causal depthwise conv, shape
  (W-1, conv_channels_per_rank) in the model dtype, where the channels are q, k and v side by side
  (2 * key_heads * Dk + value_heads * Dv of this rank);
- the recurrent state: one Dk x Dv matrix per value head, shape (value_heads_per_rank, Dk, Dv), in
  `config.state_dtype` (HF `mamba_ssm_dtype`, float32 on Qwen3.5).

Key and value heads split evenly across ranks (with the attention heads); an uneven split is refused.
The state pool (cache/state_pool.py), the memory plan (engine/memory.py) and `plan` all size states
from this one layout, so what `plan` promises is what the pool allocates. Torch-free on purpose.
A model without GDN layers gets an empty layout (no layers, 0 bytes). On a device the states take
(running sequences + snapshot pool) x bytes_per_sequence, reserved before the KV pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from homelab_llm.engine.dtype_sizes import (
    MemoryPlanError, canonical_dtype, dtype_bytes, resolve_model_dtype,
)
from homelab_llm.engine.model.config import ModelConfig


@dataclass(frozen=True)
class StateLayout:
    tp_size: int
    layers: tuple[int, ...]  # model layer indices of the GDN layers, in order
    key_heads_per_rank: int
    value_heads_per_rank: int
    conv_shape: tuple[int, int]  # (W-1, conv channels of this rank)
    conv_dtype: str  # canonical torch name, e.g. "bfloat16"
    recurrent_shape: tuple[int, int, int]  # (value heads of this rank, Dk, Dv)
    recurrent_dtype: str  # canonical torch name, e.g. "float32"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def conv_bytes_per_layer(self) -> int:
        return math.prod(self.conv_shape) * dtype_bytes(self.conv_dtype)

    @property
    def recurrent_bytes_per_layer(self) -> int:
        return math.prod(self.recurrent_shape) * dtype_bytes(self.recurrent_dtype)

    @property
    def bytes_per_sequence(self) -> int:
        """Conv plus recurrent state of one sequence over all GDN layers, on one rank."""
        return self.num_layers * (self.conv_bytes_per_layer + self.recurrent_bytes_per_layer)

    def pending_bytes_per_sequence(self, rows: int) -> int:
        """The pending-row areas of one running slot for verify groups of `rows` rows, over all
        GDN layers (kernels/gdn_pending.PendingRows: d and k in two halves, u and the conv
        inputs once); 0 without speculation (rows 0)."""
        hv, dk, dv = self.recurrent_shape
        floats = rows * (2 * (hv + self.key_heads_per_rank * dk) + hv * dv)
        return self.num_layers * (floats * 4 + rows * self.conv_shape[1] * dtype_bytes(self.conv_dtype))

    def snapshot_count(self, max_num_seqs: int, max_state_snapshots: int | None = None,
                       state_snapshot_memory_bytes: int | None = None,
                       enable_prefix_caching: bool = True) -> int:
        """Slots of the radix cache's snapshot pool (EngineArgs' flags of the same names).

        None/None means two per running sequence (a prompt end and an output end); a byte budget
        holds as many whole snapshots as fit. No GDN layers or no prefix caching: no snapshots.
        """
        if not self.num_layers or not enable_prefix_caching:
            return 0
        if max_state_snapshots is not None:
            return max_state_snapshots
        if state_snapshot_memory_bytes is not None:
            return state_snapshot_memory_bytes // self.bytes_per_sequence
        return 2 * max_num_seqs

    @classmethod
    def for_model(cls, config: ModelConfig, tp_size: int, model_dtype: str) -> StateLayout:
        """The per-rank layout; `model_dtype` may be 'auto' (the checkpoint's dtype)."""
        if tp_size < 1:
            raise MemoryPlanError(f"--tensor-parallel-size must be >= 1, got {tp_size}")
        conv_dtype = canonical_dtype(resolve_model_dtype(config, model_dtype))
        state_dtype = canonical_dtype(config.state_dtype)
        layers = config.linear_attention_layers
        if not layers:
            return cls(tp_size, (), 0, 0, (0, 0), conv_dtype, (0, 0, 0), state_dtype)
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if hk % tp_size or hv % tp_size:
            raise MemoryPlanError(
                f"--tensor-parallel-size {tp_size} does not divide the {hk} linear-attention key "
                f"heads and {hv} value heads; use a size that divides both")
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        hk_rank, hv_rank = hk // tp_size, hv // tp_size
        channels = 2 * hk_rank * dk + hv_rank * dv
        width = config.linear_conv_kernel_dim - 1
        if width < 1 or min(dk, dv, hk, hv) < 1:
            raise MemoryPlanError(
                f"hybrid config is incomplete: linear_conv_kernel_dim {config.linear_conv_kernel_dim}"
                f", key heads {hk} x {dk}, value heads {hv} x {dv} must all be positive")
        return cls(tp_size, layers, hk_rank, hv_rank, (width, channels), conv_dtype,
                   (hv_rank, dk, dv), state_dtype)
