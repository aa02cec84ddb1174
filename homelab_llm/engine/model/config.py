"""ModelConfig: the shape of a model, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

from homelab_llm.errors import HomelabError

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(HomelabError, ValueError):
    """An architecture, tensor type or config value we cannot run; the message names what we can."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF form: {"rope_type": "llama3", "factor": ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2/2.5)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None  # HF quantization_config, or {"format": "gguf"}
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
