"""Check and time every Triton kernel at Llama-3.1-8B shapes on one GPU.

    python benchmarks/kernels_bench.py [--quick] [--json out.json]

For each case: compare with the torch reference (max abs error, or relative error for W4A16),
time with triton.testing.do_bench (median), and report achieved GB/s against the device-to-device
copy bandwidth and TFLOP/s against a bf16 matmul, both measured in the same run. The table at the
end is what goes into docs/BENCHMARKS.md (with date, device and command).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from homelab_llm.engine.kernels import ref  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16  # Llama-3.1-8B attention
HIDDEN, INTER = 4096, 14336


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    gbps: float
    tflops: float
    check: str


class PrintedRows(list):
    """Rows print as they are measured, so a run cut short by a timeout still shows them."""

    def append(self, r: Row) -> None:
        super().append(r)
        print(f"  {r.kernel:22s} {r.shape:56s} {r.ms:8.4f} ms  {r.check}", flush=True)


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def peak_copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def peak_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * 8192 ** 3 / ms / 1e9


def paged_kv(seq_lens: list[int], dtype: torch.dtype):
    pages = [(n + PAGE - 1) // PAGE for n in seq_lens]
    total = sum(pages)
    k = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n
    if dtype == torch.int8:
        kq, ks = ref.quantize_kv(k)
        vq, vs = ref.quantize_kv(v)
        return kq, vq, ks, vs, table
    return k.to(dtype), v.to(dtype), None, None, table


def kv_bytes(tokens: int, dtype: torch.dtype) -> int:
    per = HKV * D * (1 if dtype == torch.int8 else 2) + (HKV * 2 if dtype == torch.int8 else 0)
    return 2 * tokens * per


def attention_cases(rows: list[Row], quick: bool) -> None:
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention
    from homelab_llm.engine.kernels.prefill_attention import paged_prefill_attention

    contexts = [512, 4096, 16384] if quick else [512, 2048, 8192, 16384]
    batches = [1, 8, 32] if quick else [1, 4, 16, 32]
    for dtype in (torch.bfloat16, torch.int8):
        tag = "bf16" if dtype == torch.bfloat16 else "int8"
        for ctx in contexts:
            for batch in batches:
                k, v, ks, vs, table = paged_kv([ctx] * batch, dtype)
                q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
                qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                fn = lambda: paged_decode_attention(q, k, v, table, qsl, sl, D ** -0.5, ks, vs, max_seq_len=ctx)  # noqa: E731
                got = fn()
                check = "-"
                if batch <= 4:
                    want = ref.paged_attention_ref(q.float(), k if ks is not None else k.float(),
                                                   v if vs is not None else v.float(), table, qsl, sl, D ** -0.5, ks, vs)
                    check = f"{(got.float() - want).abs().max().item():.1e}"
                ms = bench(fn)
                nbytes = kv_bytes(batch * ctx, dtype) + 2 * q.numel() * 2
                flops = 4 * batch * HQ * D * ctx
                rows.append(Row(f"decode_attn[{tag}]", f"B={batch} ctx={ctx}", ms, nbytes / ms / 1e6,
                                flops / ms / 1e9, check))
                del k, v, ks, vs
    # Prefill/extend: a chunk of new tokens over a cached prefix, one sequence.
    for dtype in (torch.bfloat16, torch.int8):
        tag = "bf16" if dtype == torch.bfloat16 else "int8"
        for q_len, prefix in ([(2048, 0), (2048, 14336)] if quick else [(512, 0), (2048, 0), (4096, 0), (2048, 14336)]):
            seq = q_len + prefix
            k, v, ks, vs, table = paged_kv([seq], dtype)
            q = torch.randn(q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
            qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
            sl = torch.tensor([seq], dtype=torch.int32, device="cuda")
            fn = lambda: paged_prefill_attention(q, k, v, table, qsl, sl, D ** -0.5, ks, vs, max_query_len=q_len)  # noqa: E731
            got = fn()
            want = ref.paged_attention_ref(q.float(), k if ks is not None else k.float(),
                                           v if vs is not None else v.float(), table, qsl, sl, D ** -0.5, ks, vs)
            check = f"{(got.float() - want).abs().max().item():.1e}"
            ms = bench(fn)
            pairs = q_len * prefix + q_len * (q_len + 1) // 2
            rows.append(Row(f"prefill_attn[{tag}]", f"q={q_len} prefix={prefix}", ms,
                            (kv_bytes(seq, dtype) + 4 * q.numel()) / ms / 1e6, 4 * HQ * D * pairs / ms / 1e9, check))


def elementwise_cases(rows: list[Row]) -> None:
    from homelab_llm.engine.kernels import elementwise
    from homelab_llm.engine.kernels.kv_store import store_kv

    for tokens in (32, 4096):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16)
        out, summed = elementwise.add_rms_norm(x, r, w, 1e-5)
        want_out, want_sum = ref.add_rms_norm_ref(x, r, w, 1e-5)
        check = f"{(out.float() - want_out.float()).abs().max().item():.1e}"
        ms = bench(lambda: elementwise.add_rms_norm(x, r, w, 1e-5))
        rows.append(Row("add_rms_norm", f"T={tokens} H={HIDDEN}", ms, 4 * x.numel() * 2 / ms / 1e6, 0.0, check))

        gu = torch.randn(tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        got = elementwise.silu_and_mul(gu)
        check = f"{(got.float() - ref.silu_and_mul_ref(gu.float())).abs().max().item():.1e}"
        ms = bench(lambda: elementwise.silu_and_mul(gu))
        rows.append(Row("silu_and_mul", f"T={tokens} I={INTER}", ms, 3 * tokens * INTER * 2 / ms / 1e6, 0.0, check))

        cache = ref.rope_cos_sin_cache(ref.rope_inv_freq(D, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}), 131072, torch.device("cuda"))
        pos = torch.randint(0, 131072, (tokens,), device="cuda")
        q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
        q2, k2 = q.clone(), k.clone()
        elementwise.apply_rope(q, k, pos, cache)
        ref.apply_rope_ref(q2, k2, pos, cache)
        check = f"{(q.float() - q2.float()).abs().max().item():.1e}"
        ms = bench(lambda: elementwise.apply_rope(q, k, pos, cache))
        rows.append(Row("rope", f"T={tokens}", ms, 2 * (q.numel() + k.numel()) * 2 / ms / 1e6, 0.0, check))

        for dtype in (torch.bfloat16, torch.int8):
            pages = tokens // PAGE + 8
            kc = torch.zeros(pages, PAGE, HKV, D, device="cuda", dtype=dtype)
            vc = torch.zeros_like(kc)
            ks = vs = None
            if dtype == torch.int8:
                ks = torch.zeros(pages, PAGE, HKV, device="cuda", dtype=torch.float16)
                vs = torch.zeros_like(ks)
            key = torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
            val = torch.randn_like(key)
            slots = torch.randperm(pages * PAGE, device="cuda")[:tokens]
            store_kv(key, val, kc, vc, slots, ks, vs)
            kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
            ks2 = None if ks is None else torch.zeros_like(ks)
            vs2 = None if vs is None else torch.zeros_like(vs)
            ref.store_kv_ref(key, val, kc2, vc2, slots, ks2, vs2)
            check = "exact" if torch.equal(kc, kc2) and torch.equal(vc, vc2) else "MISMATCH"
            ms = bench(lambda: store_kv(key, val, kc, vc, slots, ks, vs))
            tag = "bf16" if dtype == torch.bfloat16 else "int8"
            rows.append(Row(f"store_kv[{tag}]", f"T={tokens}", ms,
                            (2 * key.numel() * 2 + kv_bytes(tokens, dtype)) / ms / 1e6, 0.0, check))


def w4a16_cases(rows: list[Row], quick: bool) -> None:
    from homelab_llm.engine.kernels.w4a16 import w4a16_matmul
    from homelab_llm.engine.kernels.w4a16_pack import quantize_rtn

    shapes = [(HIDDEN, 6144, "qkv"), (HIDDEN, 2 * INTER, "gate_up"), (INTER, HIDDEN, "down")]
    ms_list = [1, 16, 256] if quick else [1, 8, 32, 256, 2048]
    for k, n, name in shapes:
        w = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, symmetric=True)
        dense = ref.dequantize_w4_ref(w).to(torch.bfloat16)
        for m in ms_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = w4a16_matmul(x, w)
            want = x.float() @ dense.float()
            rel = ((got.float() - want).norm() / want.norm()).item()
            ms = bench(lambda: w4a16_matmul(x, w))
            ms_dense = bench(lambda: x @ dense)
            nbytes = k * n // 2 + 4 * (k // 128) * n + 2 * m * (k + n)
            rows.append(Row(f"w4a16[{name}]", f"M={m} K={k} N={n} (bf16 {ms_dense:.3f} ms)", ms,
                            nbytes / ms / 1e6, 2 * m * k * n / ms / 1e9, f"rel {rel:.1e}"))


def sampling_cases(rows: list[Row]) -> None:
    from homelab_llm.engine.kernels.sampling import sample

    vocab = 128256
    for batch, label, kw in ((1, "temp", {}), (32, "temp", {}), (32, "top_k=50,top_p=0.9", {"k": 50, "p": 0.9})):
        logits = torch.randn(batch, vocab, device="cuda") * 3
        t = torch.full((batch,), 0.8, device="cuda")
        k = torch.full((batch,), kw.get("k", 0), dtype=torch.int32, device="cuda")
        p = torch.full((batch,), kw.get("p", 1.0), device="cuda")
        mp = torch.zeros(batch, device="cuda")
        seeds = torch.arange(batch, device="cuda")
        noise = torch.empty(batch, vocab, device="cuda").exponential_()
        got = sample(logits, t, k, p, mp, seeds, seeds, exponentials=noise)
        want = ref.sample_ref(logits, t, k, p, mp, noise)
        check = "exact" if torch.equal(got, want) else f"{(got != want).sum().item()} differ"
        ms = bench(lambda: sample(logits, t, k, p, mp, seeds, seeds))
        rows.append(Row(f"sample[{label}]", f"B={batch} V={vocab}", ms, batch * vocab * 4 / ms / 1e6, 0.0, check))


def step_sampling_cases(rows: list[Row]) -> None:
    """The sampler with and without host-known modes (modes unknown: every search pass launches).
    The previous one-program-per-row sampler measured 121 us for greedy at B=1 and 2.5 ms for
    top-k + top-p at B=32 (docs/BENCHMARKS.md); git history has it."""
    from homelab_llm.engine.kernels.sampling import SampleModes, sample

    vocab = 128256
    cases = [(1, "greedy", 0.0, 0, 1.0), (1, "temp", 0.8, 0, 1.0), (32, "greedy", 0.0, 0, 1.0),
             (32, "temp", 0.8, 0, 1.0), (32, "top_k=50,top_p=0.9", 0.8, 50, 0.9),
             (32, "top_p=0.95", 0.8, 0, 0.95), (32, "top_k=1000", 0.8, 1000, 1.0)]
    for batch, label, temp, top_k, top_p in cases:
        logits = torch.randn(batch, vocab, device="cuda") * 3
        t = torch.full((batch,), temp, device="cuda")
        k = torch.full((batch,), top_k, dtype=torch.int32, device="cuda")
        p = torch.full((batch,), top_p, device="cuda")
        mp = torch.zeros(batch, device="cuda")
        seeds = torch.arange(batch, device="cuda")
        noise = torch.empty(batch, vocab, device="cuda").exponential_()
        modes = SampleModes.of([temp] * batch, [top_k] * batch, [top_p] * batch, vocab)
        want = ref.sample_ref(logits, t, k, p, mp, noise)
        got = sample(logits, t, k, p, mp, seeds, seeds, exponentials=noise, modes=modes)
        check = "exact" if torch.equal(got, want) else f"{(got != want).sum().item()} differ"
        new = bench(lambda: sample(logits, t, k, p, mp, seeds, seeds, modes=modes))
        every = bench(lambda: sample(logits, t, k, p, mp, seeds, seeds))  # modes unknown: all passes
        shape = f"B={batch} V={vocab} no modes {every:.4f} ms"
        rows.append(Row(f"sample[{label}]", shape, new, batch * vocab * 4 / new / 1e6, 0.0, check))


def step_decode_cases(rows: list[Row]) -> None:
    """Decode attention at batch 1: one split writes the output (one kernel) vs split + merge."""
    from homelab_llm.engine.kernels.decode_attention import paged_decode_attention

    for ctx in (40, 512, 4096, 32768):
        kc, vc, ks, vs, table = paged_kv([ctx], torch.bfloat16)
        q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(2, dtype=torch.int32, device="cuda")
        sl = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
        want = ref.paged_attention_ref(q.float(), kc.float(), vc.float(), table, qsl, sl, D ** -0.5)
        timings = []
        for splits in (1, 2, None):
            fn = lambda: paged_decode_attention(q, kc, vc, table, qsl, sl, D ** -0.5, num_splits=splits, max_seq_len=ctx)  # noqa: E731
            err = (fn().float() - want).abs().max().item()
            timings.append(f"{splits or 'auto'}: {bench(fn) * 1e3:.1f} us ({err:.0e})")
        auto = bench(lambda: paged_decode_attention(q, kc, vc, table, qsl, sl, D ** -0.5, max_seq_len=ctx))
        rows.append(Row("decode_attn[splits]", f"B=1 ctx={ctx}", auto, kv_bytes(ctx, torch.bfloat16) / auto / 1e6,
                        0.0, "; ".join(timings)))


def step_rope_cases(rows: list[Row]) -> None:
    """RoPE + KV store: two launches (apply_rope, store_kv) vs one (rope_store_kv)."""
    from homelab_llm.engine.kernels.elementwise import apply_rope
    from homelab_llm.engine.kernels.kv_store import rope_store_kv, store_kv

    table_cs = ref.rope_cos_sin_cache(ref.rope_inv_freq(D, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), 131072, torch.device("cuda"))
    for tokens in (1, 32, 4096):
        for dtype in (torch.bfloat16, torch.int8):
            pages = tokens // PAGE + 8
            caches = [torch.zeros(pages, PAGE, HKV, D, device="cuda", dtype=dtype) for _ in range(4)]
            scales = [torch.zeros(pages, PAGE, HKV, device="cuda", dtype=torch.float16) if dtype == torch.int8
                      else None for _ in range(4)]
            qkv = torch.randn(tokens, HQ + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
            pos = torch.randint(0, 131072, (tokens,), device="cuda")
            slots = torch.randperm(pages * PAGE, device="cuda")[:tokens]

            def unfused(qkv=qkv, pos=pos, slots=slots, c=caches, s=scales):
                q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
                apply_rope(q, k, pos, table_cs)
                store_kv(k, v, c[0], c[1], slots, s[0], s[1])

            def fused(qkv=qkv, pos=pos, slots=slots, c=caches, s=scales):
                q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
                rope_store_kv(q, k, v, pos, table_cs, c[2], c[3], slots, s[2], s[3])

            a, b = qkv.clone(), qkv.clone()
            unfused(qkv=a)
            fused(qkv=b)
            same = torch.equal(a[:, :HQ], b[:, :HQ]) and torch.equal(caches[0], caches[2]) and \
                torch.equal(caches[1], caches[3])
            old, new = bench(unfused), bench(fused)
            tag = "bf16" if dtype == torch.bfloat16 else "int8"
            nbytes = 2 * qkv.numel() * 2 + kv_bytes(tokens, dtype)
            rows.append(Row(f"rope_store_kv[{tag}]", f"T={tokens} unfused {old:.4f} ms", new, nbytes / new / 1e6,
                            0.0, "=unfused" if same else "DIFFERS from unfused"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--only", choices=["attention", "elementwise", "w4a16", "sampling", "step"],
                        help="one section (step: the decode step's small kernels, old vs new)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA/HIP GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    import triton

    from homelab_llm.engine.kernels.tuning import arch_name

    dev = torch.device("cuda")
    copy_gbps, mm_tflops = peak_copy_gbps(), peak_matmul_tflops()
    print(f"# {torch.cuda.get_device_name()} ({arch_name(dev)}), torch {torch.__version__}, triton "
          f"{triton.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    print(f"# measured: copy {copy_gbps:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    rows: list[Row] = PrintedRows()
    sections = {"attention": lambda: attention_cases(rows, args.quick),
                "elementwise": lambda: elementwise_cases(rows), "w4a16": lambda: w4a16_cases(rows, args.quick),
                "sampling": lambda: sampling_cases(rows),
                # The decode step's small kernels, old path next to new in the same run (issue #4).
                "step:rope": lambda: step_rope_cases(rows), "step:decode": lambda: step_decode_cases(rows),
                "step:sampling": lambda: step_sampling_cases(rows)}
    for name, section in sections.items():
        if args.only and name.split(":")[0] != args.only:
            continue
        section()
    print()
    print("| kernel | shape | ms (median) | GB/s | % copy BW | TFLOP/s | % bf16 mm | check |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tf = f"{r.tflops:.1f} | {100 * r.tflops / mm_tflops:.0f}%" if r.tflops else "- | -"
        print(f"| {r.kernel} | {r.shape} | {r.ms:.4f} | {r.gbps:.0f} | {100 * r.gbps / copy_gbps:.0f}% | {tf} | {r.check} |")
    if args.json:
        args.json.write_text(json.dumps({"copy_gbps": copy_gbps, "matmul_tflops": mm_tflops,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
