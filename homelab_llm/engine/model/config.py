"""ModelConfig: the shape of a model, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

from dataclasses import dataclass, field
from typing import Any, Mapping

from homelab_llm.errors import HomelabError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_moe",
                           "qwen3_5_moe", "qwen3_next", "gemma3", "gpt_oss")
# Families whose MLP is a mixture of experts (model/qwen3_moe.py, model/qwen3_5_moe.py,
# model/qwen3_next.py).
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss")
# Hybrid (Gated DeltaNet) families (model/qwen3_5.py, model/qwen3_5_moe.py, model/qwen3_next.py).
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LAYER_FULL = "full_attention"
LAYER_LINEAR = "linear_attention"  # Gated DeltaNet
LAYER_SLIDING = "sliding_attention"  # attention over the last sliding_window keys only
# rope_type values the rotary layer implements (HF spelling). "freq_factors" is ours: a GGUF
# Llama 3.x file ships its llama3 scaling pre-computed as the rope_freqs tensor.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")
# Keys each scaled rope_type must carry (the rotary layer reads them).
_ROPE_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                  "original_max_position_embeddings")}
# rope_parameters keys that are not part of the scaling dict. Qwen3.5's mrope keys describe the
# vision positions; text positions are the same on all three axes, which is plain RoPE.
_ROPE_PARAMS_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")

# HF architectures[0] -> our architecture name, for configs without a model_type we know.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
}
# model_type spellings of one family: the multimodal wrapper and its text part.
_MODEL_TYPE_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
                       "gemma3_text": "gemma3"}
# Wrapper keys that describe the whole checkpoint and win over the text part's copy.
_WRAPPER_KEYS = ("quantization_config", "tie_word_embeddings", "torch_dtype", "dtype", "architectures")


class UnsupportedModelError(HomelabError, ValueError):
    """An architecture, tensor type or config value we cannot run; the message names what we can."""


class ModelLoadError(HomelabError, OSError):
    """A model file is missing, truncated or corrupt; the message names the file and the fault."""


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
    # Hybrid (Gated DeltaNet + attention) shape, Qwen3.5/3.6 and Qwen3-Next. layer_types holds one
    # entry per layer, LAYER_FULL or LAYER_LINEAR; empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # share of head_dim that RoPE rotates (0.25 on Qwen3.5)
    attn_output_gate: bool = False  # sigmoid gate on the attention output (q_proj is twice as wide)
    state_dtype: str = "float32"  # recurrent-state dtype (HF mamba_ssm_dtype)
    # Mixture of experts (Qwen3-MoE, Qwen3.5/3.6-MoE, Qwen3-Next). num_experts 0: dense MLPs only.
    # A layer is sparse when num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers (HF's rule); other layers keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert; else one, sigmoid-gated
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Sliding-window attention (Mistral, Qwen2, Gemma 3): a layer whose layer_types entry is
    # LAYER_SLIDING sees only its last sliding_window keys (window_fields).
    sliding_window: int = 0
    rope_local_theta: float = 0.0  # Gemma 3: the sliding layers' RoPE base, unscaled (0: rope_theta)
    query_pre_attn_scalar: float = 0.0  # Gemma 3: softmax scale = its ** -0.5 (0: head_dim)
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    # gpt-oss: learned per-head sink logits, o_proj bias, biased experts with a clamped SwiGLU
    attention_sinks: bool = False
    o_proj_bias: bool = False
    swiglu_alpha: float = 0.0  # 0: plain SiLU experts
    swiglu_limit: float = 0.0
    experts_mxfp4: bool = False  # gpt-oss as published: experts resident in MXFP4, decoded in-kernel

    @property
    def is_hybrid(self) -> bool:
        return LAYER_LINEAR in self.layer_types

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that hold KV pages (all of them on a plain transformer), full or
        sliding-window attention alike."""
        if not self.layer_types:
            return tuple(range(self.num_hidden_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LAYER_FULL, LAYER_SLIDING))

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers (they need only the last sliding_window keys)."""
        if not self.sliding_window:
            return ()
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_SLIDING)

    def layer_window(self, layer: int) -> int:
        """The attention window of layer `layer` in tokens; 0 for full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (they hold a conv and a recurrent state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_LINEAR)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v of a Gated DeltaNet layer side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is a mixture of experts."""
        if not self.is_moe:
            return ()
        step = max(self.decoder_sparse_step, 1)
        return tuple(i for i in range(self.num_hidden_layers)
                     if (i + 1) % step == 0 and i not in self.mlp_only_layers)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def normalize_rope_scaling(scaling: Mapping[str, Any] | None, where: str) -> dict[str, Any] | None:
    """Normalise HF rope_scaling (old "type" or new "rope_type" key); None for plain RoPE."""
    if not scaling:
        return None
    out = dict(scaling)
    rope_type = out.pop("type", None) or out.get("rope_type") or "default"
    if rope_type == "mrope":  # text positions are equal on every mrope axis: plain RoPE
        rope_type = "default"
    out["rope_type"] = rope_type
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    missing = [k for k in _ROPE_REQUIRED_KEYS.get(rope_type, ()) if out.get(k) is None]
    if missing:
        raise ModelLoadError(f"{where}: rope scaling {rope_type!r} needs {', '.join(missing)}")
    factor = out.get("factor")
    if factor is not None and (not isinstance(factor, (int, float)) or not factor >= 1.0):
        raise ModelLoadError(f"{where}: rope scaling factor must be a number >= 1, got {factor!r}")
    return out


def _check_moe_shapes(cfg: ModelConfig, where: str) -> None:
    for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        if getattr(cfg, name) <= 0:
            raise ModelLoadError(f"{where}: {name} must be positive for a mixture-of-experts model, "
                                 f"got {getattr(cfg, name)}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds "
                             f"num_experts ({cfg.num_experts})")


def moe_fields(raw: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig MoE fields of an HF config dict ({} for a dense family). transformers 5
    writes num_experts as num_local_experts; Qwen3.5-MoE / Qwen3-Next always renormalise top-k."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if arch not in MOE_ARCHITECTURES or not experts:
        return {}
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        # gpt-oss: every layer is sparse and intermediate_size is the experts' size
        moe_intermediate_size=int(raw.get("moe_intermediate_size")
                                  or (raw.get("intermediate_size") if arch == "gpt_oss" else 0) or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", arch != "qwen3_moe")),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    )


def _check_shapes(cfg: ModelConfig, where: str) -> ModelConfig:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: architecture {cfg.architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim"):
        if getattr(cfg, name) <= 0:
            raise ModelLoadError(f"{where}: {name} must be positive, got {getattr(cfg, name)}")
    if cfg.is_moe:
        _check_moe_shapes(cfg, where)
    elif cfg.architecture in MOE_ARCHITECTURES:
        raise ModelLoadError(f"{where}: {cfg.architecture} needs num_experts > 0")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelLoadError(
            f"{where}: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})")
    return cfg


# Gemma3TextConfig's defaults: the published configs leave these out of text_config.
_GEMMA3_DEFAULTS = dict(vocab_size=262_208, max_position_embeddings=131_072, rms_norm_eps=1e-6,
                        head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                        bos_token_id=2, eos_token_id=1)
SLIDING_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def family_defaults(raw: Mapping[str, Any], arch: str, where: str) -> dict[str, Any]:
    """raw with a family's implicit values filled in; Gemma 3's per-layer-type rope_parameters
    (transformers 5: {"full_attention": {...}, "sliding_attention": {...}}) flattened to the
    global scaling plus rope_local_base_freq."""
    out = dict(raw)
    if arch != "gemma3":
        return out
    for k, v in _GEMMA3_DEFAULTS.items():
        if out.get(k) is None:
            out[k] = v
    params = out.get("rope_parameters") or {}
    if isinstance(params.get(LAYER_FULL), Mapping):
        local = dict(params.get(LAYER_SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{where}: scaled RoPE on sliding layers is not supported")
        out["rope_local_base_freq"] = float(local.get("rope_theta") or out["rope_local_base_freq"])
        out["rope_parameters"] = dict(params[LAYER_FULL])
        out["rope_theta"] = float(out["rope_parameters"].get("rope_theta") or out["rope_theta"])
    if out.get("attn_logit_softcapping"):
        raise UnsupportedModelError(f"{where}: attn_logit_softcapping is not supported")
    return out


def window_fields(raw: Mapping[str, Any], arch: str, where: str) -> dict[str, Any]:
    """The ModelConfig sliding-window fields of an HF config dict ({} without a window).
    Mistral: every layer slides. Qwen2: only with use_sliding_window, and only layers from
    max_window_layers on (HF's rule). Gemma 3: layer_types, or one full layer in each
    sliding_window_pattern (6)."""
    window = int(raw.get("sliding_window") or 0)
    layers = int(raw["num_hidden_layers"])
    if arch == "qwen2" and not raw.get("use_sliding_window"):
        window = 0
    if arch not in ("mistral", "qwen2", "gemma3", "gpt_oss") or window <= 0:
        return {}
    types = raw.get("layer_types")
    if not types:
        if arch in ("gemma3", "gpt_oss"):
            pattern = int(raw.get("sliding_window_pattern") or (6 if arch == "gemma3" else 2))
            types = [LAYER_FULL if (i + 1) % pattern == 0 else LAYER_SLIDING for i in range(layers)]
        else:
            first = int(raw.get("max_window_layers") or 0) if arch == "qwen2" else 0
            types = [LAYER_SLIDING if i >= first else LAYER_FULL for i in range(layers)]
    bad = sorted({str(t) for t in types} - {LAYER_FULL, LAYER_SLIDING})
    if bad:
        raise UnsupportedModelError(f"{where}: layer type {bad[0]!r} is not supported; "
                                    f"supported: {LAYER_FULL}, {LAYER_SLIDING}")
    if len(types) != layers:
        raise ModelLoadError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu")
    if act not in SLIDING_ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: hidden activation {act!r} is not supported; "
                                    f"supported: {', '.join(SLIDING_ACTIVATIONS)}")
    return dict(
        layer_types=tuple(str(t) for t in types), sliding_window=window,
        rope_local_theta=float(raw.get("rope_local_base_freq") or 0.0),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0.0),
        final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0),
        hidden_act=act,
    )


def checkpoint_quantization(raw: Mapping[str, Any], arch: str) -> Mapping[str, Any] | None:
    """The quantization_config the loader acts on: gpt-oss's published MXFP4 experts are the
    experts' own format (ModelConfig.experts_mxfp4, layers/moe_gptoss.py), not a linear-layer
    quantization, so for them there is none."""
    quant = raw.get("quantization_config")
    if arch == "gpt_oss" and isinstance(quant, Mapping) and str(quant.get("quant_method")).lower() == "mxfp4":
        return None
    return quant


def gpt_oss_fields(raw: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """gpt-oss's attention sinks, o_proj bias and clamped-SwiGLU experts ({} for others)."""
    if arch != "gpt_oss":
        return {}
    quant = raw.get("quantization_config")
    mxfp4 = isinstance(quant, Mapping) and str(quant.get("quant_method")).lower() == "mxfp4"
    return dict(attention_sinks=True, o_proj_bias=bool(raw.get("attention_bias", True)),
                swiglu_alpha=float(raw.get("swiglu_alpha") or 1.702),
                swiglu_limit=float(raw.get("swiglu_limit") or 7.0), experts_mxfp4=mxfp4)


def _text_part(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal wrapper's text_config with the wrapper's checkpoint-wide keys on top (the
    vision tower is not ours to run); a plain config as it is."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        return raw
    merged = dict(text)
    merged.update({k: raw[k] for k in _WRAPPER_KEYS if raw.get(k) is not None})
    merged.setdefault("model_type", raw.get("model_type"))
    for key in ("eos_token_id", "bos_token_id"):  # Gemma 3 names its stop ids on the wrapper only
        if merged.get(key) is None and raw.get(key) is not None:
            merged[key] = raw[key]
    return merged


def _hybrid_fields(raw: Mapping[str, Any], rope_params: Mapping[str, Any], where: str
                   ) -> dict[str, Any]:
    """Qwen3.5/3.6: Gated DeltaNet layers among gated full-attention ones, partial rotary."""
    layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if not layer_types:
        interval = int(raw.get("full_attention_interval") or 4)
        layer_types = [LAYER_LINEAR if (i + 1) % interval else LAYER_FULL for i in range(layers)]
    bad = sorted({str(t) for t in layer_types} - {LAYER_FULL, LAYER_LINEAR})
    if bad:
        raise UnsupportedModelError(
            f"{where}: layer type {bad[0]!r} is not supported; supported: {LAYER_FULL}, {LAYER_LINEAR}")
    if len(layer_types) != layers:
        raise ModelLoadError(f"{where}: layer_types has {len(layer_types)} entries for {layers} layers")
    if str(raw.get("hidden_act") or "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; use silu")
    partial = raw.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 0.25))
    key_heads, value_heads = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
    if key_heads <= 0 or value_heads % key_heads:
        raise ModelLoadError(f"{where}: linear_num_value_heads ({value_heads}) is not a multiple of "
                             f"linear_num_key_heads ({key_heads})")
    return dict(
        layer_types=tuple(str(t) for t in layer_types),
        linear_num_key_heads=int(raw["linear_num_key_heads"]),
        linear_num_value_heads=int(raw["linear_num_value_heads"]),
        linear_key_head_dim=int(raw["linear_key_head_dim"]),
        linear_value_head_dim=int(raw["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim") or 4),
        partial_rotary_factor=float(partial),
        attn_output_gate=bool(raw.get("attn_output_gate", True)),
        state_dtype=str(raw.get("mamba_ssm_dtype") or "float32"),
    )


def config_from_hf(raw: Mapping[str, Any], name: str = "", where: str = "config.json") -> ModelConfig:
    """An HF config.json dict -> ModelConfig (Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3.5/3.6,
    Qwen3-MoE, Qwen3.5/3.6-MoE, Qwen3-Next, Gemma 3, gpt-oss)."""
    raw = _text_part(raw)
    arch = str(raw.get("model_type") or "").lower()
    arch = _MODEL_TYPE_ALIASES.get(arch, arch)
    if arch not in SUPPORTED_ARCHITECTURES:
        archs = raw.get("architectures") or []
        arch = _HF_ARCHITECTURES.get(archs[0] if archs else "", arch or (archs[0] if archs else "?"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: model_type {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    raw = family_defaults(raw, arch, where)
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        # transformers >= 5 moves rope_theta and the scaling dict into rope_parameters.
        rope_params = dict(raw.get("rope_parameters") or {})
        rope_theta = float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling = raw.get("rope_scaling") or {k: v for k, v in rope_params.items()
                                              if k not in _ROPE_PARAMS_NOT_SCALING}
        hybrid = _hybrid_fields(raw, rope_params, where) if arch in HYBRID_ARCHITECTURES else {}
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            # All-MoE families (Qwen3.5-MoE) have no dense MLP size: the experts' stands in.
            intermediate_size=int(raw.get("intermediate_size") or raw["moe_intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=normalize_rope_scaling(scaling, where),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and its config does not say so.
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3", *HYBRID_ARCHITECTURES),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_tuple(raw.get("eos_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            quantization=checkpoint_quantization(raw, arch),
            name=name or str(raw.get("_name_or_path") or ""),
            extra={k: raw[k] for k in ("sliding_window", "use_sliding_window") if k in raw},
            **hybrid,
            **moe_fields(raw, arch),
            **window_fields(raw, arch, where),
            **gpt_oss_fields(raw, arch),
        )
    except HomelabError:
        raise
    except KeyError as err:
        raise ModelLoadError(f"{where}: required key {err.args[0]!r} is missing") from None
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{where}: bad value ({err})") from None
    return _check_shapes(cfg, where)


# GGUF general.architecture -> ours. Mistral GGUFs are written as "llama".
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    """GGUF metadata (key -> python value) and the file's tensor names -> ModelConfig."""
    gguf_arch = str(meta.get("general.architecture", "?"))
    arch = _GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        raise UnsupportedModelError(
            f"{where}: GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(_GGUF_ARCHITECTURES)}")

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(f"{gguf_arch}.{suffix}", default)
        if value is None:
            raise ModelLoadError(f"{where}: GGUF metadata key {gguf_arch}.{suffix} is missing")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; we need one value
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"{where}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{gguf_arch}.vocab_size") or (len(tokens) if tokens else 0))
    scaling: dict[str, Any] | None = None
    scaling_type = meta.get(f"{gguf_arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_names:
        scaling = {"rope_type": "freq_factors"}
    elif scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        original = meta.get(f"{gguf_arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(
            f"{where}: rope scaling type {scaling_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id")]
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(meta.get(f"{gguf_arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        torch_dtype="bfloat16",
        quantization={"format": "gguf", "file_type": meta.get("general.file_type")},
        name=str(meta.get("general.name") or ""),
        extra={"gguf_architecture": gguf_arch},
    )
    return _check_shapes(cfg, where)


def read_json(path: Path) -> dict[str, Any]:
    """A model folder's JSON file (config, tokenizer config...), or a ModelLoadError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None


# Where older quantizers put quantization_config when config.json does not carry it.
QUANT_CONFIG_FILES = ("quantization_config.json", "quantize_config.json")


def read_hf_config(folder: Path) -> dict[str, Any]:
    """An HF folder's config.json as a dict, with quantization_config filled in from the side
    file older quantizers write (AutoGPTQ's quantize_config.json does not name its method)."""
    raw = read_json(folder / "config.json")
    if not raw.get("quantization_config"):
        for fname in QUANT_CONFIG_FILES:
            if (folder / fname).is_file():
                quant = read_json(folder / fname)
                quant.setdefault("quant_method", "gptq")
                raw["quantization_config"] = quant
                break
    return raw
