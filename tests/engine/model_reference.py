"""Test helpers for the model room: tiny random-weight transformers models saved as safetensors,
and a minimal paged-KV harness that runs our model the way the runner will (caches bound on the
attention layers, one ForwardContext per step), without the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

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



# -- two-rank (gloo) forwards for the TP tests ---------------------------------------------------

def chunked_logits(model, prompt: list[int], decode: list[int]) -> torch.Tensor:
    """Logits of a prompt prefilled in two chunks (the second starts mid-page), then decode steps."""
    harness = PagedHarness(model, page_size=4)
    logits = [harness.step({"s": prompt[:5]}), harness.step({"s": prompt[5:]})]
    logits += [harness.step({"s": [t]}) for t in decode]
    return torch.cat(logits)


def gloo_rank_logits(rank: int, folder: str, init_file: str, out_file: str, prompt: list[int],
                     decode: list[int]) -> None:
    """mp.spawn target: load `folder` as rank `rank` of 2 and run chunked_logits; rank 0 saves
    them. Every rank runs the forward: the collectives need both."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        from homelab_llm.engine.model.loader import load_model, load_model_config

        config = load_model_config(folder)
        model = load_model(config, folder, "auto", torch.float32, "cpu", tp_rank=rank, tp_size=2)
        logits = chunked_logits(model, prompt, decode)
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        dist.destroy_process_group()


def two_rank_logits(folder: Path, work: Path, prompt: list[int], decode: list[int]) -> torch.Tensor:
    """Rank 0's chunked_logits of `folder` loaded over two gloo ranks (spawned and reaped here)."""
    import torch.multiprocessing as mp

    out = work / "rank0.pt"
    mp.spawn(gloo_rank_logits, args=(str(folder), str(work / "rendezvous"), str(out), prompt, decode),
             nprocs=2, join=True)
    return torch.load(out)

@contextmanager
def plan_steps() -> Iterator[list[bool]]:
    """Records, per call of the CPU decode plan (model/cpu_decode_layer.CpuDecodePlan.decode),
    whether it took the step (returned the residual stream, not None)."""
    from homelab_llm.engine.model.cpu_decode_layer import CpuDecodePlan

    taken: list[bool] = []
    real = CpuDecodePlan.decode

    def spy(self, *args: Any, **kwargs: Any):
        out = real(self, *args, **kwargs)
        taken.append(out is not None)
        return out

    with mock.patch.object(CpuDecodePlan, "decode", spy):
        yield taken


def plan_and_general(model, steps: list[dict[str, list[int]]], num_pages: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `steps` (the first through the general path either way: it must exceed the plan's
    rows) once with the model's CPU decode plan off and once on, on fresh caches with the same
    shuffled pages; checks that the plan took every later step (and none when off) and that the
    first step's logits are equal. Returns (the general path's, the plan's) logits of the later
    steps, concatenated."""
    plan = model.model.cpu_decode
    runs = []
    try:
        for use in (None, plan):
            model.model.cpu_decode = use
            harness = PagedHarness(model, num_pages=num_pages, page_size=4)
            harness.free_pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
            with plan_steps() as taken:
                runs.append([harness.step(batch) for batch in steps])
            assert sum(taken) == (0 if use is None else len(steps) - 1)
    finally:
        model.model.cpu_decode = plan
    assert torch.equal(runs[0][0], runs[1][0])
    ref, got = (torch.cat(r[1:]) for r in runs)
    return ref, got


# -- GGUF files for tests ----------------------------------------------------------------------
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias",  # Qwen2
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}


def hf_to_gguf(hf_model, path: Path, qtype: str | None = None, arch: str = "llama",
               raw_override: dict[str, tuple[bytes, str]] | None = None) -> Path:
    """Write a transformers Llama (or Qwen2 / Qwen3 with arch="qwen2" / "qwen3": biases, q / k
    norms, head_dim) as a GGUF the way llama.cpp's converter does (Llama's Q/K rows permuted for
    its rope), 2-D weights quantized to `qtype` if given."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:  # Qwen3: written as llama.cpp does
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(1)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp ships Llama 3.1's scaling as per-frequency divisors (rope_freqs.weight);
        # derive them from transformers' own llama3 frequencies.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        dim = scaled.shape[0] * 2
        base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))

    def permute(t, heads):
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    for name, tensor in hf_model.state_dict().items():
        t = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_LAYER[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                t = permute(t, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                t = permute(t, cfg.num_key_value_heads)
        if raw_override and gname in raw_override:
            data, type_name = raw_override[gname]
            qt = gguf.GGMLQuantizationType[type_name]
            rows = np.frombuffer(data, dtype=np.uint8).reshape(t.shape[0], -1).copy()
            w.add_tensor(gname, rows, raw_dtype=qt)  # byte shape: the writer derives the rest
        elif qtype and t.ndim == 2:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(t), qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_config(folder: Path, **overrides: Any) -> Path:
    """A model_configs-style JSON (HF config.json form) for dummy-weight tests."""
    import json

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", **TINY)
    cfg.pop("initializer_range")
    cfg.update(overrides)
    path = folder / "tiny-llama.json"
    path.write_text(json.dumps(cfg))
    return path
