"""Small engines for the engine tests: a tiny random-weight Llama (fast) and the real SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from homelab_llm.engine.llm import LLM

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_config(tmp: Path, overrides: dict[str, Any] | None = None) -> Path:
    path = tmp / "tiny.json"
    path.write_text(json.dumps({**TINY_LLAMA, **(overrides or {})}))
    return path


def tiny_llm(tmp: Path, **engine_args: Any) -> LLM:
    defaults: dict[str, Any] = dict(load_format="dummy", device="cpu", dtype="float32",
                                    page_size=4, kv_cache_memory_bytes=1 << 20, seed=0)
    defaults.update(engine_args)
    return LLM(str(write_config(tmp)), **defaults)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 320) -> list[list[int]]:
    """n prompts of mixed lengths, token ids clear of bos/eos."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_all_pages_free(engine) -> None:
    """No request holds a KV page: after evicting the prefix cache every page is free."""
    pool = engine.kv.pool
    if engine.kv.radix is not None:
        engine.kv.radix.evict(pool.num_pages)
    assert pool.num_free == pool.num_pages, (pool.num_free, pool.num_pages)
