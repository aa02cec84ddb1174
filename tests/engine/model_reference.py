"""Test helpers for the model room: tiny random-weight transformers models saved as safetensors,
and a minimal paged-KV harness that runs our model the way the runner will (caches bound on the
attention layers, one ForwardContext per step), without the scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from homelab_llm.engine.context import ForwardContext, forward_context

TINY: dict[str, Any] = dict(
    vocab_size=200, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    # Larger than HF's 0.02 so the logits spread out and a wrong op moves them visibly.
    initializer_range=0.3,
)

KINDS = ("llama", "qwen2", "qwen3", "mistral")


def hf_config(kind: str, **overrides: Any):
    import transformers

    kw = dict(TINY)
    if kind == "llama":
        cls = transformers.LlamaConfig
        kw.update(rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64))
    elif kind == "qwen2":
        cls = transformers.Qwen2Config
        kw.update(rope_parameters=dict(rope_type="default", rope_theta=1e6), tie_word_embeddings=True)
    elif kind == "qwen3":
        cls = transformers.Qwen3Config
        # head_dim explicit and != hidden / heads, as in the real Qwen3 models; YaRN long context.
        kw.update(head_dim=32, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32),
            max_position_embeddings=128)
    elif kind == "mistral":
        cls = transformers.MistralConfig
        kw.update(sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    else:
        raise ValueError(kind)
    kw.update(overrides)
    return cls(**kw)


def make_hf_model(kind: str, folder: Path, seed: int = 0, **overrides: Any):
    """A random fp32 transformers model of `kind`, saved (safetensors) into folder; returned."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **overrides),
                                                          dtype=torch.float32).eval()
    if kind == "qwen3":  # q/k norm weights start at 1: perturb them so the test sees them
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


class PagedHarness:
    """Owns the KV pages of a few sequences and runs steps of new tokens through our model."""

    def __init__(self, model, num_pages: int = 64, page_size: int = 4,
                 kv_dtype: torch.dtype | None = None):
        self.model, self.page_size = model, page_size
        param = next(model.parameters())
        self.device, dtype = param.device, kv_dtype or param.dtype
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.pages: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        for attn in model.attention_layers:
            shape = (num_pages, page_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            if dtype == torch.int8:
                attn.k_scale = torch.zeros(shape[:3], dtype=torch.float16, device=self.device)
                attn.v_scale = torch.zeros(shape[:3], dtype=torch.float16, device=self.device)

    def build_context(self, batch: dict[str, list[int]]) -> tuple[list[int], ForwardContext]:
        ids, positions, slots, q_lens, s_lens, tables = [], [], [], [], [], []
        for seq, new in batch.items():
            start = self.lengths.get(seq, 0)
            pages = self.pages.setdefault(seq, [])
            end = start + len(new)
            while len(pages) * self.page_size < end:
                pages.append(self.free_pages.pop())
            for pos in range(start, end):
                slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            ids += new
            positions += range(start, end)
            q_lens.append(len(new))
            s_lens.append(end)
            tables.append(pages)
            self.lengths[seq] = end
        width = max(len(t) for t in tables)
        dev = self.device
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        ctx = ForwardContext(
            positions=torch.tensor(positions, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                    dtype=torch.int32, device=dev),
            max_query_len=max(q_lens), max_seq_len=max(s_lens), page_size=self.page_size,
            decode_only=all(n == 1 for n in q_lens),
            query_lens_host=q_lens, seq_lens_host=s_lens,
        )
        return ids, ctx

    @torch.no_grad()
    def step(self, batch: dict[str, list[int]]) -> torch.Tensor:
        """Run the new tokens of each sequence; float32 logits for every new token, in order."""
        ids, ctx = self.build_context(batch)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(ids, device=self.device), ctx.positions)
            return self.model.compute_logits(hidden)


def load_ours(path: Path | str, load_format: str = "auto", dtype: torch.dtype = torch.float32):
    from homelab_llm.engine.model.loader import load_model, load_model_config

    config = load_model_config(path, load_format)
    return config, load_model(config, path, load_format, dtype, torch.device("cpu"))
