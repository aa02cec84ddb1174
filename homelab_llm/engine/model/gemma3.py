"""Gemma 3 text decoder (Gemma3ForCausalLM, and the language model of
Gemma3ForConditionalGeneration), built from llama.py's attention and MLP.

What differs from Llama:
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype first (as Gemma);
- RMSNorm is x_hat * (1 + w) (OffsetRMSNorm), on q and k per head too;
- four norms per layer: input and post-attention around attention, pre- and post-feedforward
  around the MLP; the residual adds the *normed* sublayer output;
- softmax scale query_pre_attn_scalar ** -0.5; GELU-tanh gated MLP;
- sliding layers (config.layer_types) see their last sliding_window keys and use the local RoPE
  base (rope_local_theta, unscaled); full layers the global base and its scaling;
- optional final logit softcapping: cap * tanh(logits / cap).

Checkpoint names: `model.*` (CausalLM), `model.language_model.*` (transformers 5 wrapper) or
`language_model.model.*` (published wrapper); the vision tower and projector are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from homelab_llm.engine.layers.norm import OffsetRMSNorm
from homelab_llm.engine.layers.rotary import RopeTables, RotaryEmbedding
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.llama import (PACKED_MODULES, LlamaAttention, LlamaMLP,
                                             attention_after_norm, mlp_after_norm)
from homelab_llm.engine.model.split_tensor import SplitTensor
from homelab_llm.engine.parallel.state import tp_rank, tp_size

SKIPPED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")
# checkpoint prefix -> ours (the wrapper's language model is our whole model)
RENAMED_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = config.layer_window(layer) > 0
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer, norm=OffsetRMSNorm)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = LlamaMLP(config)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                local: RopeTables, global_: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual before it is added): the next norm adds them (fused). At
        decode sizes on a GPU, as Llama's layer: input_layernorm inside qkv_proj's GEMV, the
        pre-feedforward norm and the GELU-and-mul inside the MLP's (llama.mlp_after_norm); the
        post-sublayer norms stay launches (each needs its whole GEMV output first)."""
        hidden, residual = attention_after_norm(hidden, residual, self.input_layernorm,
                                                self.self_attn, local if self.sliding else global_)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = mlp_after_norm(hidden, residual, self.pre_feedforward_layernorm, self.mlp)
        return self.post_feedforward_layernorm(hidden), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.rope_local_theta or config.rope_theta)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # Gemma multiplies by the factor rounded to the model dtype (sqrt(5376) is 73.5 in bf16);
        # a python float of that value keeps the forward free of tensor creation (CUDA graphs).
        hidden = hidden * float(torch.tensor(self.embed_scale, dtype=hidden.dtype))
        global_ = self.rotary.lookup(positions, hidden.dtype)
        local = self.local_rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, local, global_)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(nn.Module):
    """The CausalLM contract (see llama.LlamaForCausalLM)."""

    packed_modules = PACKED_MODULES
    split_modules: dict[str, SplitTensor] = {}

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.model = Gemma3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_layers: list[Attention] = [layer.self_attn.attn for layer in self.model.layers]
        self.softcap = config.final_logit_softcapping

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor name in our naming, or None for tensors this model does not use."""
        if name.startswith(SKIPPED_PREFIXES):
            return None
        for theirs, ours in RENAMED_PREFIXES:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
