"""Prefill attention tiles A/B on one GPU: the table's tiles against HOMELAB_LLM_PREFILL_TILES
variants, in one run, at an attention shape, bf16 and int8 KV.

    python3 benchmarks/prefill_attention_ab.py [--shape 8b|27b] [--variants "block_m=64;block_m=32"]

Shapes (q heads, KV heads, head_dim): Llama-3.1-8B's (32, 8, 128) and Qwen3.6-27B's
full-attention layers (24, 4, 256), page 16. Cases: a 2,048-token prompt, and a 2,048-token
chunk over 14,336 cached tokens. Prints ms (median of triton.testing.do_bench), TFLOP/s of the
causal attention, the ratio to the table's tiles, and the max |error| against
ref.paged_attention_ref (fp32) of every variant, so a faster wrong variant shows.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from homelab_llm.engine.kernels import ref  # noqa: E402
from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from homelab_llm.engine.kernels.tuning import PREFILL_TILES_ENV, prefill_tiles  # noqa: E402

SHAPES = {"8b": (32, 8, 128), "27b": (24, 4, 256)}
PAGE = 16
CASES = ((2048, 0), (2048, 14336))


def inputs(q_len: int, prefix: int, hq: int, hkv: int, d: int, int8: bool, gen: torch.Generator):
    """(q, k_cache, v_cache, k_scale, v_scale, page_table, query_start_loc, seq_lens) on the GPU,
    the sequence's pages in shuffled order."""
    seq = q_len + prefix
    pages = (seq + PAGE - 1) // PAGE
    k = torch.randn(pages, PAGE, hkv, d, generator=gen).cuda().bfloat16()
    v = torch.randn(pages, PAGE, hkv, d, generator=gen).cuda().bfloat16()
    ks = vs = None
    if int8:
        (k, ks), (v, vs) = ref.quantize_kv(k), ref.quantize_kv(v)
    table = torch.randperm(pages, generator=gen).to(torch.int32).cuda().reshape(1, pages)
    q = torch.randn(q_len, hq, d, generator=gen).cuda().bfloat16()
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    sl = torch.tensor([seq], dtype=torch.int32, device="cuda")
    return q, k, v, ks, vs, table, qsl, sl


def time_case(case: tuple, d: int, variants: list[str]) -> None:
    """One table row per variant for one input case (inputs()'s tuple)."""
    from triton.testing import do_bench

    q, k, v, ks, vs, table, qsl, sl = case
    int8, q_len, prefix = ks is not None, q.shape[0], int(sl[0]) - q.shape[0]
    scale = d ** -0.5
    want = ref.paged_attention_ref(q.float(), k if int8 else k.float(), v if int8 else v.float(),
                                   table, qsl, sl, scale, ks, vs)
    flops = 4 * q.shape[1] * d * (q_len * prefix + q_len * (q_len + 1) // 2)
    base = None
    for spec in variants:
        os.environ[PREFILL_TILES_ENV] = spec
        fn = lambda: paged_prefill_attention(q, k, v, table, qsl, sl, scale, ks, vs,  # noqa: E731
                                             max_query_len=q_len)
        err = (fn().float() - want).abs().max().item()
        ms = do_bench(fn, warmup=20, rep=200, return_mode="median")
        base = base or ms
        print(f"| {'int8' if int8 else 'bf16'} | {q_len} / {prefix} | {spec or 'table'} | {ms:.3f} | "
              f"{flops / ms / 1e9:.1f} | {ms / base:.3f} | {err:.1e} |", flush=True)
    os.environ.pop(PREFILL_TILES_ENV, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    ap.add_argument("--variants", default="block_m=64;block_m=32",
                    help=f"';'-separated {PREFILL_TILES_ENV} values timed beside the table's tiles")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("prefill_attention_ab needs a GPU", file=sys.stderr)
        return 2
    hq, hkv, d = SHAPES[args.shape]
    variants = [""] + [v for v in args.variants.split(";") if v.strip()]
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, shape {args.shape} ({hq}/{hkv}/{d}), table tiles "
          f"{prefill_tiles(dev, d)}")
    print("| KV | q / prefix | tiles | ms | TFLOP/s | x table | max err |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(0)
    for int8 in (False, True):
        for q_len, prefix in CASES:
            time_case(inputs(q_len, prefix, hq, hkv, d, int8, gen), d, variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
