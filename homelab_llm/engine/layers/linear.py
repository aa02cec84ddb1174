"""Tensor-parallel linear layers. Each owns its weight_loader, so sharding sits beside the layer.

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums. With one rank both are a plain
nn.Linear. Weights are [out_features, in_features] as in HF checkpoints.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from homelab_llm.engine.parallel.state import all_reduce, tp_rank, tp_size
from homelab_llm.engine.sharding import even_shard, head_shard
from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.kernels.w4a16_pack import integer_zero_points

_defer_weights = False


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear weights built inside are placeholders on the meta device (no memory): the loader
    then either materializes each one or gives it a 4-bit weight instead (W4A16)."""
    global _defer_weights
    previous, _defer_weights = _defer_weights, True
    try:
        yield
    finally:
        _defer_weights = previous


def weights_deferred() -> bool:
    """Inside deferred_weights(): layers with large weights build them on the meta device."""
    return _defer_weights


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        device = "meta" if _defer_weights else None
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # Set instead of `weight` for W4A16: kernels.w4a16_pack.W4Weight, its tensors registered
        # as buffers so .to() and memory accounting see them.
        self.w4: Any = None
        self.w4_activation_dtype: torch.dtype | None = None
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        # shard_id -> (GGUF blocks record, HF rows this rank took, HF cols this rank took); kept for
        # a later W4A16 repack without re-reading the file.
        self.gguf_blocks: dict[Any, tuple[Any, slice, slice]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, act_in: str | None = None,
                paired: bool = False, pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if pairs is not None:  # x's rows already as the mma kernel's pairs (rows_take_mma_pairs)
            out = dispatch.w4a16_prepared_matmul(pairs, self.w4, x.dtype)
        elif paired:  # x in the pair order rows_pairs_block gave (written so by its producer)
            out = dispatch.w4a16_paired_matmul(x, self.w4)
        elif act_in:  # x is a gated MLP's gate | up: its activation first (in the GEMV's prologue)
            out = dispatch.w4a16_act_matmul(x, self.w4, act_in) if self.w4 is not None else \
                dispatch.linear(dispatch.gated_act(x, act_in), self.weight)
        elif self.w4 is None:
            return dispatch.linear(x, self.weight, bias)
        else:
            out = dispatch.w4a16_matmul(x, self.w4)
        return out if bias is None else out + bias

    def rows_pairs_block(self, m: int, like: torch.Tensor) -> int:
        """The K step in whose pair order (kernels/pair_order.py) this linear wants m rows that a
        kernel is yet to write in like's dtype and device: a W4A16 weight on the few-row kernel's
        tiles that read x so (dispatch.w4a16_rows_pairs_block); 0 for k order."""
        return dispatch.w4a16_rows_pairs_block(m, like, self.w4) if self.w4 is not None else 0

    def rows_take_mma_pairs(self, m: int, like: torch.Tensor) -> bool:
        """m rows that a kernel is yet to write in like's dtype and device may be handed over as
        the W4A16 mma kernel's pairs (kernels/w4a16_mma.empty_pairs; forward(x, pairs=)): the
        route takes them there (dispatch.w4a16_rows_mma)."""
        return self.w4 is not None and dispatch.w4a16_rows_mma(m, like, self.w4)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Give a deferred (meta) weight real storage, to be filled by weight_loader."""
        if self.weight is not None and self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty(self.weight.shape, device=device, dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def set_w4(self, w4: Any, activation_dtype: torch.dtype | None = None) -> None:
        """Use a 4-bit weight (W4Weight, [in, out] groups) from now on; the dense weight goes.
        activation_dtype: what the 4-bit matmuls compute in. bf16 on the CPU also repacks the
        weight once for torch's int4 kernel (kernels/w4a16_cpu.py); fp32 uses the exact
        reference and needs no copy."""
        if (w4.in_features, w4.out_features) != (self.in_features, self.out_features):
            raise ValueError(f"4-bit weight is {w4.in_features}x{w4.out_features}, this layer "
                             f"{self.in_features}x{self.out_features}")
        w4.int_zeros = w4.int_zeros or integer_zero_points(w4)  # the repacks set it; parts joined lose it
        self.weight = None
        for name in ("qweight", "scales", "biases", "perm"):
            self.register_buffer(f"w4_{name}", getattr(w4, name), persistent=False)
        self.w4 = w4
        self.w4_activation_dtype = activation_dtype
        self._attach_cpu_pack()

    def compute_w4_in(self, dtype: torch.dtype) -> None:
        """Compute the 4-bit matmuls in `dtype` from now on, whatever the activations' dtype
        (bf16: the CPU kernel; model/cpu_kernels.py sets it on an fp32 model)."""
        self.w4_activation_dtype = dtype
        self._attach_cpu_pack()

    def _attach_cpu_pack(self) -> None:
        from homelab_llm.engine.kernels import w4a16_cpu

        wanted = self.w4_activation_dtype == torch.bfloat16 and w4a16_cpu.supports(self.w4)
        pack = w4a16_cpu.repack_for_cpu(self.w4) if wanted else None
        self.w4.cpu_pack = pack
        # Registered so memory accounting counts them (they are as large as qweight).
        self.register_buffer("w4_cpu_packed", None if pack is None else pack.packed, persistent=False)
        self.register_buffer("w4_cpu_scales_and_zeros",
                             None if pack is None else pack.scales_and_zeros, persistent=False)
        self.register_buffer("w4_cpu_native", None if pack is None or pack.native is None
                             else pack.native.blocks, persistent=False)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() move the registered buffers; point the W4Weight at the moved ones and
        # redo the CPU repack for the new device (a no-op off the CPU).
        module = super()._apply(fn, recurse)
        if self.w4 is not None:
            self.w4 = type(self.w4)(self.w4_qweight, self.w4_scales, self.w4_biases,
                                    self.w4.group_size, self.w4_perm, int_zeros=self.w4.int_zeros)
            self._attach_cpu_pack()
        return module

    def part_ids(self) -> list[Any]:
        """shard_ids of the checkpoint tensors fused into this weight, in output order."""
        return [None]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        rows, cols, dest = self.shard_slices(param, shard_id)
        src = loaded[rows] if loaded.dim() == 1 else loaded[rows, cols]
        if tuple(src.shape) != tuple(dest.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit this layer's weight")
        dest.copy_(src)

    def shard_slices(self, param: nn.Parameter, shard_id: Any) -> tuple[slice, slice, torch.Tensor]:
        """(rows, cols of the full checkpoint tensor this rank keeps, destination view)."""
        return slice(None), slice(None), param.data

    def record_gguf_blocks(self, blocks: Any, shard_id: Any = None) -> None:
        rows, cols, _ = self.shard_slices(self.weight, shard_id)
        self.gguf_blocks[shard_id] = (blocks, rows, cols)


ReplicatedLinear = LinearBase


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.out_start, out_local = even_shard(out_features, self.tp_size, self.tp_rank,
                                               "output features")
        super().__init__(in_features, out_local, bias)

    def shard_slices(self, param, shard_id):
        n = param.shape[0]
        return slice(self.out_start, self.out_start + n), slice(None), param.data


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matmul (gate and up). shard_id = index of the part,
    or its name when `part_names` are given (Gated DeltaNet's q, k, v, z)."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool = False,
                 part_names: list[str] | None = None):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.parts = [even_shard(o, self.tp_size, self.tp_rank, "output features")
                      for o in out_features]
        self.part_names = part_names
        super().__init__(in_features, sum(size for _, size in self.parts), bias)

    def part_ids(self) -> list[Any]:
        return list(self.part_names) if self.part_names else list(range(len(self.parts)))

    def shard_slices(self, param, shard_id):
        index = self.part_names.index(shard_id) if self.part_names else shard_id
        offset = sum(size for _, size in self.parts[:index])
        start, size = self.parts[index]
        return slice(start, start + size), slice(None), param.data.narrow(0, offset, size)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matmul; shard_id is "q", "k" or "v". Output: [q | k | v]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, q_rows_per_head: int | None = None):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.head_dim = head_dim
        # A query head may carry more rows than head_dim: Qwen3.5's q_proj gives each head its
        # query and its output gate side by side (2 * head_dim rows, split after the matmul).
        self.q_rows = q_rows_per_head or head_dim
        self.heads = head_shard(num_heads, num_kv_heads, self.tp_size, self.tp_rank)
        self.q_size = self.heads.q_heads * self.q_rows
        self.kv_size = self.heads.kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def part_ids(self) -> list[Any]:
        return ["q", "k", "v"]

    def shard_slices(self, param, shard_id):
        d, h = self.head_dim, self.heads
        if shard_id == "q":
            qd = self.q_rows
            rows, offset, size = slice(h.q_start * qd, (h.q_start + h.q_heads) * qd), 0, self.q_size
        elif shard_id in ("k", "v"):
            rows = slice(h.kv_start * d, (h.kv_start + h.kv_heads) * d)
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size = self.kv_size
        else:
            raise ValueError(f"QKV shard_id must be q, k or v, got {shard_id!r}")
        return rows, slice(None), param.data.narrow(0, offset, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; output all-reduced. `input_shard` overrides the even
    split (o_proj takes the uneven q-head shard of its attention)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 input_shard: tuple[int, int] | None = None):
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.in_start, in_local = input_shard or even_shard(
            in_features, self.tp_size, self.tp_rank, "input features")
        super().__init__(in_local, out_features, bias)

    def forward(self, x: torch.Tensor, act_in: str | None = None, paired: bool = False,
                pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x @ W (+ bias), all-reduced; act_in ("silu" or "gelu_tanh"): x is [gate | up] and the
        input act(gate) * up; paired: x in the pair order rows_pairs_block gave; pairs: x's rows
        as the mma kernel's pairs, written by their producer (rows_take_mma_pairs; x gives the
        output's dtype only)."""
        # The bias is added once, on rank 0, so the all-reduce sums it exactly once.
        out = self._matmul(x, self.bias if self.tp_rank == 0 else None, act_in, paired, pairs)
        return all_reduce(out) if self.tp_size > 1 else out

    def shard_slices(self, param, shard_id):
        if param.dim() == 1:  # bias: replicated
            return slice(None), slice(None), param.data
        n = param.shape[1]
        return slice(None), slice(self.in_start, self.in_start + n), param.data
