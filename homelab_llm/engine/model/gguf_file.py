"""One GGUF file: checked metadata, HF tensor names, and dequantized weights.

The file stays memory-mapped (one numpy memmap), so the raw quantized blocks a
linear layer came from stay reachable through `GGUFBlocks` without a second copy in memory.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    import torch

from homelab_llm.engine.model.config import (
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    config_from_gguf,
)
from homelab_llm.engine.model.gguf_reader import GGUFFormatError, read_gguf_header, tensor_data
from homelab_llm.load_progress import LOAD

# Types we dequantize (through gguf.quants). The i-quants and ternary types are left out until a
# test model covers them.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Types a W4A16 GPU path can repack straight from their blocks.
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Large token arrays: not loaded into the metadata dict unless asked for.
_ARRAY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF parameter name (None: a tensor we do not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


@dataclass(frozen=True)
class GGUFBlocks:
    """Where a quantized weight's raw blocks live, so a GPU path can repack them later.

    raw is a view into the file's memmap ([out_features, bytes_per_row] in GGUF row order); row i
    of the HF-ordered weight is raw[row_order[i]] (row_order None: the same order).
    """

    tensor_name: str
    ggml_type: str
    shape: tuple[int, ...]  # logical HF shape (out_features, in_features)
    raw: np.ndarray
    row_order: np.ndarray | None = None


def rope_row_order(out_features: int, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: its rope pairs adjacent rows, HF pairs the halves."""
    head_dim = out_features // num_heads
    return np.arange(out_features).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


class GGUFFile:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such GGUF file")
        try:
            self._meta, tensors, self._mm = read_gguf_header(self.path)
        except (GGUFFormatError, ValueError, OSError) as err:
            raise ModelLoadError(
                f"{self.path}: not a readable GGUF file ({err}); is it truncated or still "
                "downloading?") from None
        size = self.path.stat().st_size
        for t in tensors:
            if t.offset + t.n_bytes > size:
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {t.name} ends at byte "
                    f"{t.offset + t.n_bytes} but the file has {size} bytes")
        self.tensors = {t.name: t for t in tensors}

    def metadata(self, include_arrays: bool = False) -> dict[str, Any]:
        if include_arrays:
            return dict(self._meta)
        out = {k: v for k, v in self._meta.items() if k not in _ARRAY_KEYS}
        out.update({k + ".count": len(self._meta[k]) for k in _ARRAY_KEYS if k in self._meta})
        return out

    def array(self, key: str) -> list[Any] | None:
        return self._meta.get(key)

    def config(self) -> ModelConfig:
        meta = self.metadata()
        if "tokenizer.ggml.tokens.count" in meta:
            meta["tokenizer.ggml.tokens"] = range(meta["tokenizer.ggml.tokens.count"])
        cfg = config_from_gguf(meta, set(self.tensors), str(self.path))
        self.check_tensor_types()
        return cfg

    def has_four_bit_linears(self) -> bool:
        """Whether any linear weight is stored 4-bit (a W4A16 load would keep it 4-bit)."""
        return any(t.type_name in FOUR_BIT_TYPES and len(t.shape) == 2
                   and (hf_name(t.name) or "").endswith("proj.weight")
                   for t in self.tensors.values())

    def check_tensor_types(self) -> None:
        for t in self.tensors.values():
            if t.type_name not in SUPPORTED_TENSOR_TYPES:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name} has type {t.type_name}, which is not "
                    f"supported; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")

    def weights(self, config: ModelConfig, dtype: torch.dtype, keep_quantized: set[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor | None, GGUFBlocks | None]]:
        """(HF name, dequantized tensor in `dtype`, raw blocks record for 4-bit linears).

        Tensors named in keep_quantized come without a dense tensor (None): W4A16 repacks them.
        """
        import torch
        from gguf import GGMLQuantizationType, quants

        permute = config.extra.get("gguf_architecture", "llama") == "llama"
        total, done = len(self._mm), 0  # the file's bytes: progress for /health and the log
        for t in self.tensors.values():
            name = hf_name(t.name)
            if name is None:
                continue
            raw = tensor_data(self._mm, t)
            done += raw.nbytes
            LOAD.weights(done, total, 1, 1, self.path.name)
            order = None
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                order = rope_row_order(t.shape[0], config.num_attention_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                order = rope_row_order(t.shape[0], config.num_key_value_heads)
            if t.name in keep_quantized:
                yield name, None, GGUFBlocks(t.name, t.type_name, t.shape, raw, order)
                continue
            try:
                values = quants.dequantize(raw, GGMLQuantizationType(t.type_id))
            except Exception as err:
                raise ModelLoadError(f"{self.path}: cannot dequantize {t.name} ({err})") from None
            if not values.flags.writeable:  # F32/F16 come back as views of the read-only map
                values = values.copy()
            tensor = torch.from_numpy(np.ascontiguousarray(values))
            if order is not None:
                tensor = tensor[torch.from_numpy(order)]
            blocks = None
            if t.type_name in FOUR_BIT_TYPES and tensor.dim() == 2:
                blocks = GGUFBlocks(t.name, t.type_name, tuple(tensor.shape), raw, order)
            yield name, tensor.to(dtype), blocks


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A GGUFFile, shared while the file is unchanged: parsing the header (with its ~100K vocab
    strings) takes seconds, and config, weights and tokenizer each need it."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        raise ModelLoadError(f"{path}: no such GGUF file") from None
    return _open_cached(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only
    return GGUFFile(path)
