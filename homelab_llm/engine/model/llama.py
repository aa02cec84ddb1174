"""The decoder for Llama, Mistral, Qwen2/2.5 and Qwen3: one pre-norm transformer, switched by
config flags (attention_bias for Qwen2, qk_norm for Qwen3, tie_word_embeddings, rope scaling).

Parameter names follow HF checkpoints, except that q/k/v and gate/up are fused (PACKED_MODULES
says how a checkpoint tensor finds its place in a fused weight).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from homelab_llm.engine.context import get_context
from homelab_llm.engine.kernels.pdl import in_experts_layer
from homelab_llm.engine.layers.activation import GeluTanhAndMul, SiluAndMul
from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from homelab_llm.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from homelab_llm.engine.layers.norm import RMSNorm, qk_norm
from homelab_llm.engine.layers.norm_chain import (NormAfter, Prenormed, chained_mlp_norm, chained_next_norm,
                                                  prenormed_linear, prenormed_mlp, rows_of)
from homelab_llm.engine.layers.norm_linear import fuses, gated_mlp, norm_then_linear
from homelab_llm.engine.layers.rotary import RopeTables, RotaryEmbedding, rotate_qk
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.split_tensor import SplitTensor
from homelab_llm.engine.parallel.state import tp_rank, tp_size

# checkpoint module name -> (our fused module, shard_id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """Layer `layer`'s attention: its window from config.layer_window; `norm` is the q/k norm's
    class (Gemma's (1 + weight) RMSNorm)."""

    def __init__(self, config: ModelConfig, layer: int = 0, norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_heads, heads.kv_heads, d
        self.q_size, self.kv_size = heads.q_heads * d, heads.kv_heads * d
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.o_proj_bias,
                                        input_shard=(heads.q_start * d, self.q_size))
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = norm(d, config.rms_norm_eps)
            self.k_norm = norm(d, config.rms_norm_eps)
        scale = (config.query_pre_attn_scalar or d) ** -0.5
        self.attn = Attention(heads.q_heads, heads.kv_heads, d, scale, config.layer_window(layer))
        if config.attention_sinks:  # gpt-oss: float32 per-head logits, this rank's heads
            self.sinks = nn.Parameter(torch.zeros(heads.q_heads, dtype=torch.float32), requires_grad=False)
            q_start = heads.q_start

            def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
                if loaded.dim() != 1 or loaded.shape[0] != config.num_attention_heads:
                    raise ValueError(f"sinks are {tuple(loaded.shape)}, expected "
                                     f"({config.num_attention_heads},)")
                param.data.copy_(loaded[q_start:q_start + param.shape[0]])

            self.sinks.weight_loader = load_sinks  # type: ignore[attr-defined]
            self.attn.sinks = self.sinks

    def forward(self, hidden: torch.Tensor, rope: RopeTables, o_proj: NormAfter | None = None) -> Any:
        return self.attend(self.qkv_proj(hidden), rope, o_proj)

    def attend(self, qkv: torch.Tensor, rope: RopeTables, o_proj: NormAfter | None = None) -> Any:
        """Everything after the fused q | k | v projection: norms, rotation, attention, o_proj
        (or, given, o_proj with the next norm in its epilogue: layers/norm_chain.Prenormed)."""
        out_proj = o_proj or self.o_proj
        tokens, d = qkv.shape[0], self.head_dim
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, d)
        if self.qk_norm and self.attn.norms_in_store(qkv, rope):  # norms inside the KV store
            q = qkv[:, :self.q_size].view(tokens, self.num_heads, d)
            k = qkv[:, self.q_size:qk_size].view(tokens, self.num_kv_heads, d)
            return self.attn.project(out_proj, q, k, v, rope, qk_norms=(self.q_norm, self.k_norm))
        if self.qk_norm:  # one launch normalizes q's and k's heads, each with its own weight
            qk = qk_norm(qkv, self.num_heads, self.num_kv_heads, d, self.q_norm, self.k_norm)
        else:
            qk = qkv[:, :qk_size].view(tokens, self.num_heads + self.num_kv_heads, d)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if rope.in_kernel:  # the attention rotates q and k in the kernel that stores K/V
            return self.attn.project(out_proj, q, k, v, rope)
        # q and k sit side by side in the fused output: one rotation covers both.
        qk = rotate_qk(qk, self.num_heads, rope)
        return self.attn.project(out_proj, qk[:, : self.num_heads], qk[:, self.num_heads :], v)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.act = GeluTanhAndMul() if gelu else SiluAndMul()
        # The decode GEMVs apply it in an epilogue or prologue (layers/norm_linear.gated_mlp).
        self.gated_act = "gelu_tanh" if gelu else "silu"
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def pre_norm(hidden: torch.Tensor, residual: torch.Tensor | None,
             norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(hidden + residual), hidden + residual), or in the first layer (no residual yet)
    (norm(hidden), hidden): a pre-norm decoder's norm with its residual add."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def attention_after_norm(hidden: torch.Tensor | Prenormed, residual: torch.Tensor | None, norm: RMSNorm,
                         attn: nn.Module, rope, then: tuple[RMSNorm, int] | None = None) -> tuple[Any, torch.Tensor]:
    """(attn(norm(hidden + residual)), hidden + residual) for an attention with a fused qkv_proj
    and attend(qkv, rope[, o_proj]): at decode sizes on a GPU the norm runs inside qkv_proj's GEMV
    (layers/norm_linear.fuses), or, hidden a Prenormed (layers/norm_chain), the linear before it
    left it; else the separate ops. then: (the next norm, its linear's pair block) for o_proj's
    epilogue (norm_chain.mlp_chain_pairs said yes): the attention's output is that norm's
    Prenormed."""
    def attend(qkv: torch.Tensor, residual: torch.Tensor) -> Any:  # other attentions take (qkv, rope)
        return attn.attend(qkv, rope, NormAfter(attn.o_proj, residual, *then)) if then else attn.attend(qkv, rope)

    if isinstance(hidden, Prenormed):
        return attend(prenormed_linear(hidden, attn.qkv_proj), hidden.summed), hidden.summed
    if fuses(hidden, attn.qkv_proj):
        qkv, residual = norm_then_linear(hidden, residual, norm, attn.qkv_proj)
        return attend(qkv, residual), residual
    hidden, residual = pre_norm(hidden, residual, norm)
    out = attn(hidden, rope, NormAfter(attn.o_proj, residual, *then)) if then else attn(hidden, rope)
    return out, residual


def mlp_after_norm(hidden: torch.Tensor | Prenormed, residual: torch.Tensor, norm: RMSNorm,
                   mlp: nn.Module, then: tuple[RMSNorm, int] | None = None) -> tuple[Any, torch.Tensor]:
    """(mlp(norm(hidden + residual)), hidden + residual): a gated MLP at decode sizes with its norm
    and act-and-mul inside the GEMVs (layers/norm_linear.gated_mlp), or, hidden a Prenormed, inside
    the linears around them (layers/norm_chain.prenormed_mlp); an experts block with its
    norm inside its launches where it says so (layers/moe.SparseMoeBlock.after_norm), anything
    else through the separate ops. then (a Prenormed hidden only): (the next norm, its linear's
    pair block) for down_proj's epilogue: the output is that norm's Prenormed."""
    if isinstance(hidden, Prenormed):
        down = NormAfter(mlp.down_proj, hidden.summed, *then) if then else None
        return prenormed_mlp(hidden, mlp.gate_up_proj, mlp.down_proj, mlp.gated_act, down), hidden.summed
    fused = None
    if isinstance(mlp, LlamaMLP):
        fused = gated_mlp(hidden, residual, norm, mlp.gate_up_proj, mlp.down_proj, mlp.gated_act)
    elif hasattr(mlp, "after_norm"):
        fused = mlp.after_norm(hidden, residual, norm)
    if fused is not None:
        return fused
    hidden, residual = norm(hidden, residual)
    return mlp(hidden), residual


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP; `mlp` is any [T, H] -> [T, H] module (dense or experts).

    At decode sizes on a GPU (layers/norm_linear.fuses) each norm and its residual add run inside
    the next projection's GEMV: input_layernorm in qkv_proj's, post_attention_layernorm in a
    dense SiLU MLP's gate_up_proj, and its SiLU-and-mul in gate_up_proj's epilogue (bf16) or
    down_proj's prologue (W4A16); an experts block takes it in where it can (mlp_after_norm)."""

    def __init__(self, config: ModelConfig, mlp: nn.Module | None = None, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        # an experts layer's attention GEMVs launch early under PDL (pdl.in_experts_layer)
        self.experts = not isinstance(self.mlp, LlamaMLP)
        # (the next layer's input norm, its qkv_proj): set by the model where that layer takes a
        # Prenormed (layers/norm_chain; a tuple, so not registered as submodules)
        self.next_input: tuple[RMSNorm, QKVParallelLinear] | None = None

    def forward(self, hidden, residual, rope: RopeTables) -> tuple[Any, torch.Tensor]:
        rows = rows_of(hidden)
        then = chained_mlp_norm(rows, self.self_attn.o_proj, self.post_attention_layernorm, self.mlp)
        args = (hidden, residual, self.input_layernorm, self.self_attn, rope, then)
        hidden, residual = in_experts_layer(attention_after_norm, *args) if self.experts \
            else attention_after_norm(*args)
        return mlp_after_norm(hidden, residual, self.post_attention_layernorm, self.mlp,
                              chained_next_norm(rows, self.mlp, then is not None, self.next_input))


class PreNormDecoder(nn.Module):
    """The forward every decoder here shares: embed, one rotary lookup for all layers, the
    pre-norm layers (each adds the residual inside its norms), the final norm. Subclasses build
    embed_tokens, rotary (anything with lookup(positions, dtype)), layers and norm."""

    embed_tokens: nn.Module
    rotary: nn.Module
    layers: nn.ModuleList
    norm: nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.run_layers(self.embed_tokens(input_ids), positions)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layers and the final norm over embeddings `hidden`."""
        rope = self.rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaModel(PreNormDecoder):
    def __init__(self, config: ModelConfig,
                 make_mlp: Callable[[ModelConfig, int], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One table shared by every layer, looked up once per forward.
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, make_mlp(config, i) if make_mlp else None, i)
            for i in range(config.num_hidden_layers))
        for layer, after in zip(self.layers, list(self.layers)[1:]):
            layer.next_input = (after.input_layernorm, after.self_attn.qkv_proj)  # norm_chain.chained_next_norm
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A model/cpu_decode_layer.CpuDecodePlan, set by model/cpu_kernels.use_cpu_kernels when
        # the CPU default applies: steps of few new tokens then take its few-op path.
        self.cpu_decode: Any = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        plan = self.cpu_decode
        if plan is not None and hidden.shape[0] <= plan.max_rows and plan.current(self):
            summed = plan.decode(hidden, positions, get_context())
            if summed is not None:
                return self.norm(summed)
        return self.run_layers(hidden, positions)


class LlamaForCausalLM(nn.Module):
    """The CausalLM contract: model(input_ids, positions) -> hidden; compute_logits(hidden)."""

    packed_modules = PACKED_MODULES
    split_modules: dict[str, SplitTensor] = {}  # none: see qwen3_5.py

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor name in our naming (None: not ours to load)."""
        return name

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.model = LlamaModel(config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_layers: list[Attention] = [layer.self_attn.attn for layer in self.model.layers]

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        """The MLP of decoder layer `layer`; families with experts override this."""
        return LlamaMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size]; reads the forward context."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head.compute_logits(hidden)


CausalLM = LlamaForCausalLM
