"""Qwen3.5 / Qwen3.6 hybrid decoder: Gated DeltaNet layers (layers/gated_deltanet.py) with a
gated full-attention layer every few (config.layer_types), each followed by a SwiGLU MLP.

Differences from llama.py, all from the reference (transformers' modeling_qwen3_5.py):
- RMSNorm scales by (1 + weight); the loader stores 1 + weight in float32, so the ordinary norm
  kernels run it (the gated norm inside Gated DeltaNet scales by weight as usual).
- q_proj gives each head its query and then its output gate (2 * head_dim rows per head); the
  attention output is multiplied by sigmoid(gate) before o_proj.
- q/k RMSNorm per head, then RoPE (rotate-half form) on the first partial_rotary_factor of
  head_dim only (on a GPU in the KV store kernel, as for Llama: kv_store.rope_store_kv).
- Checkpoints: `model.language_model.*` (ConditionalGeneration) or `model.*` (CausalLM);
  `model.visual.*` is not ours to load, `mtp.*` (the multi-token prediction head, model/mtp.py)
  only when config.use_mtp (--speculative-config method mtp).

KV pages exist only for the full-attention layers: `attention_layers` lists them in layer order
(then the MTP layers', if built) and the runner binds KV layer slot i to the i-th. `gdn_layers` lists the Gated DeltaNet mixers,
bound to state slots the same way.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from homelab_llm.engine.layers.gated_deltanet import GatedDeltaNet
from homelab_llm.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from homelab_llm.engine.layers.norm import RMSNorm, qk_norm
from homelab_llm.engine.layers.norm_chain import (NormAfter, Prenormed, chained_mlp_norm, chained_next_norm,
                                                  prenormed_linear, rows_of)
from homelab_llm.engine.layers.norm_linear import fuses, norm_then_linear, norm_then_linear_keep
from homelab_llm.engine.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary
from homelab_llm.engine.model.config import LAYER_FULL, LAYER_LINEAR, ModelConfig
from homelab_llm.engine.model.llama import (PACKED_MODULES, LlamaMLP, PreNormDecoder,
                                             attention_after_norm, mlp_after_norm, pre_norm)
from homelab_llm.engine.model.mtp import MultiTokenPredictor
from homelab_llm.engine.model.split_tensor import SplitTensor
from homelab_llm.engine.parallel.state import tp_rank, tp_size

QWEN3_5_PACKED = {
    **PACKED_MODULES,
    "in_proj_z": ("in_proj_qkvz", "z"),
    "in_proj_b": ("in_proj_ba", "b"),
    "in_proj_a": ("in_proj_ba", "a"),
}
# Checkpoint prefixes that hold no text-model weights (MTP's: unless the head is built).
SKIPPED_PREFIXES = ("model.visual.",)
MTP_PREFIXES = ("mtp.", "model.mtp.")


class OffsetRMSNorm(RMSNorm):
    """Qwen3.5's norm: x / rms(x) * (1 + w). The float32 weight holds 1 + w once loaded."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} != {tuple(param.shape)}")
        param.data.copy_(loaded.float() + 1.0)


class PartialRotary(nn.Module):
    """RoPE over the first rotary_dim features of each head (rotate-half form, as the reference)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.table = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings,
                                     config.rope_theta, config.rope_scaling)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """Once per forward: on a GPU the table itself (the KV store kernel rotates), else cos and
        signed sin [T, 1, rotary_dim] for `rotate`."""
        return self.table.lookup(positions, dtype)

    def rotate(self, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        """x [T, H, D] with its first rotary_dim features rotated (the torch path); a new tensor."""
        assert rope.cos is not None and rope.sin is not None
        rd = self.rotary_dim
        return torch.cat((apply_rotary(x[..., :rd], rope.cos, rope.sin), x[..., rd:]), dim=-1)


class GatedAttention(nn.Module):
    """At decode on a GPU: qkv_proj, the q/k norms (q read past each head's gate, k straight
    from the projection) and the rotation inside the KV store (Attention with the rope tables;
    where the cache layout keeps rope and store apart, one q/k norm launch first), attention
    with the sigmoid gate (read from the projection) in its merge, o_proj."""

    def __init__(self, config: ModelConfig, rotary: PartialRotary):
        super().__init__()
        d = config.head_dim
        self.gated = config.attn_output_gate
        self.q_step = 2 * d if self.gated else d  # projection columns per query head
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          q_rows_per_head=self.q_step)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, d
        self.q_rows = self.qkv_proj.q_size
        self.kv_size = heads.kv_heads * d
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.attention_bias,
                                        input_shard=(heads.q_start * d, heads.q_heads * d))
        self.q_norm = OffsetRMSNorm(d, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(heads.q_heads, heads.kv_heads, d, d ** -0.5)

    def forward(self, hidden: torch.Tensor, rope: RopeTables, o_proj: NormAfter | None = None) -> Any:
        return self.attend(self.qkv_proj(hidden), rope, o_proj)

    def attend(self, qkv: torch.Tensor, rope: RopeTables, o_proj: NormAfter | None = None) -> Any:
        """Everything after the fused projection: norms, rotation, attention, gate, o_proj (or,
        given, o_proj with the next norm in its epilogue: layers/norm_chain.Prenormed)."""
        out_proj = o_proj or self.o_proj
        tokens, d, h = qkv.shape[0], self.head_dim, self.num_heads
        v = qkv[:, self.q_rows + self.kv_size:].view(tokens, self.num_kv_heads, d)
        # The output gate stays in the projection's output: a strided view, no copy.
        gate = qkv[:, :self.q_rows].view(tokens, h, self.q_step)[..., d:] if self.gated else None
        if self.attn.norms_in_store(qkv, rope):  # q/k norms inside the KV store's launch
            q = qkv[:, :self.q_rows].view(tokens, h, self.q_step)[..., :d]
            k = qkv[:, self.q_rows:self.q_rows + self.kv_size].view(tokens, self.num_kv_heads, d)
            return self.attn.project(out_proj, q, k, v, rope, gate, qk_norms=(self.q_norm, self.k_norm))
        qk = qk_norm(qkv, h, self.num_kv_heads, d, self.q_norm, self.k_norm, self.q_step)
        if rope.in_kernel:  # rotated in the kernel that stores K/V (q in place)
            return self.attn.project(out_proj, qk[:, :h], qk[:, h:], v, rope, gate)
        qk = self.rotary.rotate(qk, rope)
        return self.attn.project(out_proj, qk[:, :h], qk[:, h:], v.contiguous(), gate=gate)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, rotary: PartialRotary,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.is_linear = layer_type == LAYER_LINEAR
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config, rotary)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        # (the next layer's input norm, its first projection: qkv_proj or in_proj_qkvz), set by the
        # model: that layer takes a Prenormed (norm_chain.chained_next_norm; a tuple: not
        # registered as submodules)
        self.next_input: tuple[OffsetRMSNorm, Any] | None = None

    def forward(self, hidden, residual, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """At decode sizes on a GPU the input norm runs inside the first projection's GEMV: the
        attention layers' qkv_proj (as Llama's), a Gated DeltaNet layer's W4A16 in_proj_qkvz,
        whose prologue also stores the normalized rows for in_proj_ba; the MLP's norm inside its
        GEMVs (llama.mlp_after_norm). At batch 3-64 on the few-row W4A16 kernel the norms and a
        dense MLP's act-and-mul run inside the linears around them (layers/norm_chain: hidden may
        be a Prenormed), but for a Gated DeltaNet's bf16 in_proj_ba, whose GEMV normalizes the
        summed rows in its prologue."""
        rows = rows_of(hidden)
        out_proj = self.linear_attn.out_proj if self.is_linear else self.self_attn.o_proj
        then = chained_mlp_norm(rows, out_proj, self.post_attention_layernorm, self.mlp)
        if not self.is_linear:
            hidden, residual = attention_after_norm(hidden, residual, self.input_layernorm,
                                                    self.self_attn, rope, then)
        else:
            gdn = self.linear_attn
            if isinstance(hidden, Prenormed):  # in_proj_ba's GEMV normalizes s in its prologue
                qkvz, residual = prenormed_linear(hidden, gdn.in_proj_qkvz), hidden.summed
                ba = norm_then_linear(residual, None, self.input_layernorm, gdn.in_proj_ba)[0]
            elif gdn.in_proj_qkvz.w4 is not None and fuses(hidden, gdn.in_proj_qkvz):
                qkvz, residual, normed = norm_then_linear_keep(hidden, residual, self.input_layernorm,
                                                               gdn.in_proj_qkvz)
                ba = gdn.in_proj_ba(normed)
            else:
                normed, residual = pre_norm(hidden, residual, self.input_layernorm)
                qkvz, ba = gdn.in_proj_qkvz(normed), gdn.in_proj_ba(normed)
            hidden = gdn.mix(qkvz, ba, NormAfter(out_proj, residual, *then) if then else None)
        return mlp_after_norm(hidden, residual, self.post_attention_layernorm, self.mlp,
                              chained_next_norm(rows, self.mlp, then is not None, self.next_input))


class Qwen3_5Model(PreNormDecoder):
    def __init__(self, config: ModelConfig,
                 make_mlp: Callable[[ModelConfig, int], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = PartialRotary(config)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, t, self.rotary, make_mlp(config, i) if make_mlp else None)
            for i, t in enumerate(config.layer_types))
        for layer, after in zip(self.layers, list(self.layers)[1:]):
            first = after.linear_attn.in_proj_qkvz if after.is_linear else after.self_attn.qkv_proj
            layer.next_input = (after.input_layernorm, first)
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    """The CausalLM contract (see llama.py), plus gdn_layers for the runner's state pool."""

    packed_modules = QWEN3_5_PACKED

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        # Checkpoint tensors that hold several parts of one fused weight, split as they load.
        self.split_modules = self.checkpoint_splits(config)
        self.model = Qwen3_5Model(config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        layers = list(self.model.layers)
        self.mtp: MultiTokenPredictor | None = None
        if config.mtp_layers:
            self.mtp = MultiTokenPredictor(config, self.make_mtp_layer, self.make_norm, self.model.rotary)
            layers += list(self.mtp.layers)
        self.attention_layers: list[Attention] = [l.self_attn.attn for l in layers if not l.is_linear]
        self.gdn_layers: list[GatedDeltaNet] = [l.linear_attn for l in layers if l.is_linear]

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        """The MLP of decoder layer `layer`; the MoE variant (qwen3_5_moe.py) overrides this."""
        return LlamaMLP(config)

    def make_mtp_layer(self, index: int) -> nn.Module:
        """MTP layer `index`: a full-attention decoder layer with this family's MLP, built as
        decoder layer `index`'s (the checkpoints' MTP layers of MoE families hold experts)."""
        config = self.config
        return Qwen3_5DecoderLayer(config, LAYER_FULL, self.model.rotary, self.make_mlp(config, index))

    def make_norm(self) -> nn.Module:
        return OffsetRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    @staticmethod
    def checkpoint_splits(config: ModelConfig) -> dict[str, SplitTensor]:
        """Qwen3.5 stores Gated DeltaNet's q|k|v as one tensor, parts one after another
        (Qwen3-Next overrides this: its tensors interleave per key head)."""
        kd, vd = config.linear_key_dim, config.linear_value_dim
        return {"in_proj_qkv": SplitTensor("in_proj_qkvz", (("q", kd), ("k", kd), ("v", vd)))}

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor name in our naming, or None for tensors this model does not use."""
        if name.startswith(SKIPPED_PREFIXES):
            return None
        if name.startswith(MTP_PREFIXES):
            return None if self.mtp is None else name.removeprefix("model.")
        return name.replace("model.language_model.", "model.", 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
