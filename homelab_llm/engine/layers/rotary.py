"""Rotary position embedding, neox style (rotate the two halves of each head, as HF does).

One table [positions, cos | sin] is built at load time for every position the model may see.
On a GPU each layer rotates q and k in place with the Triton kernel (kernels/dispatch.apply_rope)
reading that table. On the CPU the model gathers cos and a signed sin over the full head once per
forward ([cos, cos] and [-sin, sin]) so each layer's rotation is three ops on q and k together
(x * cos + roll(x) * sin): CPU decode is bound by per-op overhead.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.model.config import UnsupportedModelError
from homelab_llm.engine.model.context_limit import rope_table_rows


class RopeTables(NamedTuple):
    """What every layer of one forward needs: positions and the [positions, cos | sin] table for
    the kernel path, or cos/signed sin [T, 1, head_dim] for the torch path (else None)."""

    positions: torch.Tensor
    table: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None

    @property
    def in_kernel(self) -> bool:
        """The kernel path: rotation reads `table`, and Attention can fuse it with the KV store
        (pass the tables to Attention instead of calling rotate_qk)."""
        return self.cos is None


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, s: dict[str, Any], max_position: int
                   ) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    factor = float(s["factor"])
    original = int(s.get("original_max_position_embeddings") or max_position)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _dynamic_ntk_inv_freq(base: float, dim: int, factor: float, max_position: int,
                         length: int) -> torch.Tensor:
    """Dynamic NTK, fixed at the table's length (as vLLM does: one table, so one base for every
    position): the base grows so the lowest frequency spans `length` positions."""
    base = base * ((factor * length / max_position) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None,
                 freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.base, self.scaling, self.max_position = base, scaling, max_position
        # One row per position the model can address: --max-model-len never exceeds it
        # (model/context_limit.py), so no position of a served request falls outside the table.
        self.length = rope_table_rows(max_position, scaling)
        self.register_buffer("cos_sin", self._table(freq_factors), persistent=False)

    def _table(self, freq_factors: torch.Tensor | None) -> torch.Tensor:
        dim, base, s = self.head_dim, self.base, self.scaling or {}
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        attention_factor = 1.0
        rope_type = s.get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / float(s["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, s)
        elif rope_type == "dynamic":
            inv_freq = _dynamic_ntk_inv_freq(base, dim, float(s["factor"]), self.max_position,
                                             self.length)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(base, dim, s, self.max_position)
        elif rope_type == "freq_factors":
            if freq_factors is None:  # set later by set_freq_factors, from the checkpoint
                freq_factors = torch.ones(dim // 2)
            inv_freq = inv_freq / freq_factors.float().cpu()
        elif rope_type != "default":
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")
        angles = torch.outer(torch.arange(self.length, dtype=torch.float32), inv_freq)
        # YaRN's attention factor scales cos and sin alike, so it lives in the table.
        return torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor

    def set_freq_factors(self, freq_factors: torch.Tensor) -> None:
        """GGUF Llama 3.x: the per-frequency divisors shipped as the rope_freqs tensor."""
        table = self._table(freq_factors).to(self.cos_sin.device, self.cos_sin.dtype)
        self.cos_sin.copy_(table)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """Once per forward, shared by every layer."""
        if dispatch.use_triton(self.cos_sin):
            return RopeTables(positions, self.cos_sin, None, None)
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return RopeTables(positions, self.cos_sin, torch.cat((cos, cos), -1),
                          torch.cat((-sin, sin), -1))


def rotate_qk(qk: torch.Tensor, num_q_heads: int, rope: RopeTables) -> torch.Tensor:
    """qk [T, Hq + Hkv, D] (q heads first) rotated; in place on the kernel path."""
    if rope.cos is None:
        dispatch.apply_rope(qk[:, :num_q_heads], qk[:, num_q_heads:], rope.positions, rope.table)
        return qk
    return apply_rotary(qk, rope.cos, rope.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by full-width cos and signed sin [T, 1, D]; a new tensor.

    With x = [x1, x2]: roll gives [x2, x1], so the result is [x1 cos - x2 sin, x2 cos + x1 sin].
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
