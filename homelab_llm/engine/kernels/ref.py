"""Plain-torch references for the engine's kernels. The CPU path runs these; every Triton kernel
is tested against the function of the same job here.

KV cache layout (one layer): k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim];
for int8 KV also k_scale, v_scale [num_pages, page_size, num_kv_heads] float16, one scale per
token per head. When head_dim is a power of two >= 16, the int8 cache holds each row rotated by the
Walsh-Hadamard matrix H (entries +-1, H @ H = head_dim * I): row x is stored as quantize(x @ H),
and reads back as dequantize(...) @ H / head_dim (`quantize_kv` / `dequantize_kv`). The rotation
spreads RoPE's outlier channels over the whole row, so the per-row int8 step shrinks (measured on
SmolLM2: mean top-1 logprob error vs bf16 KV 0.017 -> 0.010). Attention over the rotated rows
rotates q the same way (q @ H / head_dim) and the output back (out @ H / head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_SCALE_DTYPE = torch.float16
# Below this magnitude a head's values are quantized on a fixed grid: keeps the fp16 scale normal.
MIN_AMAX = 1e-3


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values, fp16 scales [...]), symmetric, per row."""
    amax = x.detach().abs().amax(dim=-1).float().clamp_min(MIN_AMAX)
    scale = (amax / 127.0).to(INT8_SCALE_DTYPE)
    q = torch.round(x.float() / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_per_token_head(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def kv_rotated(head_dim: int) -> bool:
    """Whether the int8 cache stores rows Hadamard-rotated: head_dim a power of two, >= 16 (the
    kernels rotate with tl.dot, whose operands need 16 along each axis)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def kv_rotation(head_dim: int, device: torch.device) -> torch.Tensor | None:
    """The +-1 Walsh-Hadamard matrix [head_dim, head_dim] (float32, symmetric) the int8 cache's
    rows are rotated by, or None when they are stored as they are (see kv_rotated)."""
    if not kv_rotated(head_dim):
        return None
    key = (head_dim, torch.device(device))
    h = _HADAMARD.get(key)
    if h is None:
        # H[i, j] = (-1)^popcount(i & j) (Sylvester), built on the device: no host copy, so a
        # first call inside CUDA-graph capture would not break it (PagePool builds it up front).
        i = torch.arange(head_dim, device=device)
        bits = i[:, None] & i[None, :]
        parity = torch.zeros_like(bits)
        for b in range(head_dim.bit_length() - 1):
            parity ^= (bits >> b) & 1
        h = _HADAMARD[key] = 1.0 - 2.0 * parity.float()
    return h


def rotate_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> x @ H in float32 (x itself as float32 when there is no rotation).
    Exact for every input whose products sum without rounding (H is +-1)."""
    h = kv_rotation(x.shape[-1], x.device)
    return x.float() if h is None else x.float() @ h


def unrotate_kv(x: torch.Tensor) -> torch.Tensor:
    """The inverse of rotate_kv, float32: x @ H / head_dim (H is symmetric)."""
    h = kv_rotation(x.shape[-1], x.device)
    return x.float() if h is None else (x.float() @ h) * (1.0 / x.shape[-1])


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8 cache stores for K or V rows x [..., head_dim]: the rotated rows quantized."""
    return quantize_per_token_head(rotate_kv(x))


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The K or V rows back from the int8 cache (the inverse of quantize_kv, up to rounding)."""
    return unrotate_kv(dequantize_per_token_head(q, scale, torch.float32)).to(dtype)


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative = skip (padding)
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    page_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # (page, slot) indices rather than a flat view: a V cache may be stored dim-major
    # (kernels/common.v_cache_strides), where pages and slots do not flatten into one axis
    at = (slot_mapping // page_size, slot_mapping % page_size)
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None, "int8 KV needs scale tensors"
        kq, ks = quantize_kv(key)
        vq, vs = quantize_kv(value)
        k_cache[at] = kq
        v_cache[at] = vq
        k_scale[at] = ks
        v_scale[at] = vs
    else:
        k_cache[at] = key.to(k_cache.dtype)
        v_cache[at] = value.to(v_cache.dtype)


def gather_kv_ref(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    pages: torch.Tensor,  # [n_pages] page ids of one sequence
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V: [length, Hkv, D] in `dtype`."""
    rows = cache.index_select(0, pages).reshape(-1, *cache.shape[2:])[:length]
    if cache.dtype == torch.int8:
        assert scale is not None
        s = scale.index_select(0, pages).reshape(-1, scale.shape[-1])[:length]
        return dequantize_kv(rows, s, dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    query_start_loc: torch.Tensor,  # [B+1]
    seq_lens: torch.Tensor,  # [B]
    softmax_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_lens_host: list[int] | None = None,
    seq_lens_host: list[int] | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged KV (prefix + new).

    Sequence b's queries are its last q_len positions: query i sits at seq_len - q_len + i and
    sees keys 0..that position. Handles prefill, chunked prefill over a cached prefix, and decode.
    window > 0 (sliding-window layers): query at p sees only keys p - window < j <= p, so pages
    wholly below seq_len - q_len - window + 1 are never read (they may have been freed).
    sinks [Hq] (gpt-oss): a learned per-head logit that joins every softmax denominator and
    contributes no value.
    """
    page_size = k_cache.shape[1]
    if query_lens_host is None:
        starts = query_start_loc.tolist()
        query_lens_host = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    if seq_lens_host is None:
        seq_lens_host = seq_lens.tolist()
    if len(query_lens_host) > 1 and all(n == 1 for n in query_lens_host):
        return _decode_batched(q, k_cache, v_cache, page_table, seq_lens_host, softmax_scale,
                               k_scale, v_scale, window, sinks)
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(query_lens_host, seq_lens_host)):
        if q_len == 0:
            continue
        n_pages = (kv_len + page_size - 1) // page_size
        # A window never reaches below its first query's oldest key: those pages are not read.
        first = max(0, kv_len - q_len - window + 1) // page_size if window > 0 else 0
        pages = page_table[b, first:n_pages].long()
        k = gather_kv_ref(k_cache, k_scale, pages, kv_len - first * page_size, q.dtype)
        v = gather_kv_ref(v_cache, v_scale, pages, kv_len - first * page_size, q.dtype)
        qb = q[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        kb, vb = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, kv_len - first * page_size, D]
        mask = None
        if q_len > 1 or window > 0:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(first * page_size, kv_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window > 0:
                mask = mask & (k_pos > q_pos - window)
        ob = attend_ref(qb, kb, vb, mask, softmax_scale, sinks)
        out[start : start + q_len] = ob.transpose(0, 1)
        start += q_len
    return out


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention, q [..., Hq, Lq, D] over k/v [..., Hkv, Lk, D] (GQA by head groups);
    mask broadcasts to the scores (True = visible). With sinks [Hq], each head's sink logit is
    one more softmax column with no value: the weights of the real keys sum to < 1."""
    gqa = q.shape[-3] != k.shape[-3]
    if sinks is None and gqa and mask is None and q.shape[-2] == 1:
        # One query per head (decode): the query heads of a KV head are its "query rows", so
        # torch's fused CPU kernel (4-D inputs only) runs without expanding K and V per query
        # head: 39 us instead of 135 us per layer at 200 keys on one EPYC core.
        hq, hkv, d = q.shape[-3], k.shape[-3], q.shape[-1]
        grouped = q.reshape(-1, hkv, hq // hkv, d)
        k4, v4 = (t.reshape(-1, hkv, t.shape[-2], d) for t in (k, v))
        return F.scaled_dot_product_attention(grouped, k4, v4, scale=scale).reshape(q.shape)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


def _decode_batched(q, k_cache, v_cache, page_table, seq_lens_host, softmax_scale,
                    k_scale, v_scale, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode (one query per sequence) for the whole batch in one SDPA call: every sequence's pages
    gathered to the longest length, the padding masked. Same result as the per-sequence loop;
    ~10 ops per layer instead of ~10 per sequence, which is what batched CPU decode spends."""
    page_size = k_cache.shape[1]
    longest = max(seq_lens_host)
    lengths = torch.tensor(seq_lens_host, device=q.device)
    if window > 0:
        # Each row reads from its window's first page on (pages below may have been freed).
        n_pages = (min(longest, window) + 2 * page_size - 2) // page_size
        first = (lengths - window).clamp_min(0) // page_size
    else:
        n_pages = (longest + page_size - 1) // page_size
        first = torch.zeros_like(lengths)
    cols = first[:, None] + torch.arange(n_pages, device=q.device)[None, :]
    # Padding entries point at page 0 or clamp to the table's last column: masked below.
    pages = page_table.gather(1, cols.clamp_max(page_table.shape[1] - 1)).long()

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        rows = cache[pages].flatten(1, 2)  # [B, n_pages * page_size, Hkv, D]
        if cache.dtype == torch.int8:
            assert scale is not None
            rows = dequantize_kv(rows, scale[pages].flatten(1, 2), q.dtype)
        return rows.to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    k_pos = first[:, None] * page_size + torch.arange(k.shape[2], device=q.device)[None, :]
    mask = k_pos < lengths[:, None]
    if window > 0:
        mask = mask & (k_pos >= lengths[:, None] - window)
    out = attend_ref(q.unsqueeze(2), k, v, mask[:, None, None, :], softmax_scale, sinks)
    return out.squeeze(2)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same formula in one fused op: a CPU decode step runs 61 norms, each a handful of
        # small ops otherwise.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def qk_norm_ref(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                q_step: int | None = None) -> torch.Tensor:
    """The q heads and the k heads of a fused projection, each RMS-normalized per head with their
    own weight, side by side: [T, q_heads + kv_heads, head_dim]. q_step: columns per q head
    (2 * head_dim when each carries its output gate after the query)."""
    tokens, q_step = qkv.shape[0], q_step or head_dim
    q_size = q_heads * q_step
    q = rms_norm_ref(qkv[:, :q_size].reshape(tokens, q_heads, q_step)[..., :head_dim], q_weight, eps)
    k = rms_norm_ref(qkv[:, q_size:q_size + kv_heads * head_dim].reshape(tokens, kv_heads, head_dim),
                     k_weight, eps)
    return torch.cat((q, k), dim=1)


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H * D] * sigmoid(gate [T, H, D]): gated attention's output gate."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the fused residual add before each norm."""
    summed = x + residual if x.dtype == residual.dtype == torch.float32 else \
        (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps), summed


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP activation: gelu_tanh(gate) * up (two rounded ops in 16-bit dtypes)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_act_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for act "silu" or "gelu_tanh" (elementwise.GATED_ACTS)."""
    return silu_and_mul_ref(gate_up) if act == "silu" else gelu_tanh_and_mul_ref(gate_up)


# --- rotary embedding (neox rotate-half layout) ---------------------------------------------------


def rope_inv_freq(rotary_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32: default, 'linear', or Llama 3 scaling.

    Llama 3 leaves short wavelengths alone, divides long ones by `factor`, and blends smoothly in
    between, so the original context keeps its resolution while positions stretch `factor` times.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    factor = float(rope_scaling["factor"])  # type: ignore[index]
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(rope_scaling.get("low_freq_factor", 1.0))  # type: ignore[union-attr]
        high = float(rope_scaling.get("high_freq_factor", 4.0))  # type: ignore[union-attr]
        old_len = float(rope_scaling.get("original_max_position_embeddings", 8192))  # type: ignore[union-attr]
        wavelen = 2 * torch.pi / inv_freq
        long = wavelen > old_len / low
        short = wavelen < old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(long, inv_freq / factor, torch.where(short, inv_freq, blended))
    from homelab_llm.engine.model.config import UnsupportedModelError

    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported (have: default, linear, llama3)")


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device: torch.device | None = None) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos in the first half of each row, sin in the second."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq.to(device=device, dtype=torch.float32))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D]; rotates the first rotary_dim dims of each head
    (rotary_dim = cos_sin_cache.shape[1]), neox layout: pairs are (i, i + rotary_dim/2)."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half:rot].float()
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        x[..., :half] = out1.to(x.dtype)
        x[..., half:rot] = out2.to(x.dtype)


# --- W4A16 ----------------------------------------------------------------------------------------


def dequantize_w4_ref(w) -> torch.Tensor:
    """W4Weight -> float32 [K, N] in the kernel's (possibly act-order permuted) input order."""
    from homelab_llm.engine.kernels.w4a16_pack import unpack_int4

    q = unpack_int4(w.qweight, dim=0).float()
    g = w.group_size
    return q * w.scales.float().repeat_interleave(g, 0) + w.biases.float().repeat_interleave(g, 0)


def w4a16_matmul_ref(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ dequant(w) -> [..., N] in x's dtype, accumulated in fp32."""
    if w.perm is not None:
        x = x[..., w.perm]
    return (x.float() @ dequantize_w4_ref(w)).to(x.dtype)


# --- sampling -------------------------------------------------------------------------------------


def filter_logits_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [B, V] float32 with filtered tokens at -inf.

    Order as in layers/sampler.py: top-k (ties at the k-th value stay), then top-p over what is
    left (keep a token while the mass strictly above it is <= top_p), then min-p (keep
    p >= min_p * p_max, i.e. scaled logit >= max + log(min_p)). top_k <= 0, top_p >= 1 and
    min_p <= 0 switch a filter off. Greedy rows (temperature 0) are scaled by 1.
    """
    t = torch.where(temperature > 0, temperature.float(), torch.ones_like(temperature, dtype=torch.float32))
    s = logits.float() / t[:, None]
    vocab = s.shape[1]
    out = s.clone()
    for row in range(s.shape[0]):
        x = out[row]
        k = int(top_k[row])
        if 0 < k < vocab:
            x.masked_fill_(x < torch.topk(x, k).values[-1], float("-inf"))
        p = float(top_p[row])
        if p < 1.0:
            vals, order = torch.sort(x, descending=True)
            probs = torch.softmax(vals, dim=-1)
            above = torch.cumsum(probs, dim=-1) - probs
            x[order[above > p]] = float("-inf")
        mp = float(min_p[row])
        if mp > 0.0:
            x.masked_fill_(x < x.max() + torch.log(torch.tensor(mp)), float("-inf"))
    return out


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Token ids [B] int64. Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws token i
    with probability p_i, and needs no normalization or cumulative sum. Greedy rows: argmax."""
    s = filter_logits_ref(logits, temperature, top_k, top_p, min_p)
    race = torch.argmax(s - torch.log(exponentials.float()), dim=-1)
    greedy = torch.argmax(logits.float(), dim=-1)
    return torch.where(temperature > 0, race, greedy)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor) -> None:
    """Grammar masking, in place: for each i, tokens whose bit is 0 in `bitmask[i]` (int32 words,
    bit t % 32 of word t // 32) get -inf in `logits[rows[i]]`. Tokens past the mask's last word
    (a padded logits row) are masked too."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)
    allowed = torch.zeros((bitmask.shape[0], vocab), dtype=torch.bool, device=logits.device)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].to(logits.device, torch.bool)
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed, float("-inf"))
