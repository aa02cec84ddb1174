"""The memory plan: weights, activations, graphs and KV cache per device, in bytes.

One arithmetic for two users: `homelab-llm plan` (before anything is loaded) and the engine runner
(which sizes the KV pool from *measured* free memory but uses `kv_bytes_per_token` for the page
size, so both agree on what one token costs). Torch-free on purpose: `plan` must not import torch.

Sharding uses the engine's own rule and helpers (sharding.py): KV heads go to ranks in whole
groups with their query heads (replicated when there are more ranks than KV heads), the MLP
intermediate dim splits evenly, the vocab into padded ceil(vocab / tp) slices; norms are replicated.

Hybrid models (Gated DeltaNet + attention, Qwen3.5/3.6): only the full-attention layers hold KV
pages; the GDN layers' parameters and prefill working memory come from engine/gdn_memory.py, and
each device reserves (max_num_seqs running + the snapshot pool) x the per-sequence state of
cache/state_layout.py before the KV cache gets the rest. With an attention output gate, q_proj is
twice as wide (query and gate).

Models that mix full and sliding attention (Gemma 3, gpt-oss) keep two KV page groups
(cache/page_groups.py): the budget splits by the rule the runner uses (`GroupSplit`), so
num_pages / tokens_capacity / kv_bytes_per_token are the full-attention group's (the context the
cache holds, and what one more token of it costs) and kv_cache_bytes counts both groups.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from homelab_llm.engine.cache.page_groups import GroupSplit, sliding_group_window, sliding_page_cap
from homelab_llm.engine.cache.state_layout import StateLayout
from homelab_llm.engine.dtype_sizes import MemoryPlanError, dtype_bytes, resolve_model_dtype
from homelab_llm.engine.gdn_memory import (gdn_activation_bytes, gdn_linears, gdn_param_count,
                                           gdn_small_param_bytes)
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.context_limit import model_max_positions, rope_table_rows
from homelab_llm.engine.sharding import (HeadShard, ShardingError, check_tp_size, head_shard,
                                         padded_shard)

# int8 KV stores one fp16 scale per token per KV head, for K and for V (kernels/ref.py).
INT8_KV_SCALE_BYTES = 2
# W4A16 as the engine stores it (kernels/w4a16_pack.py): 4-bit weights plus an fp16 scale and an
# fp16 bias per group of input rows per output column. GGUF Q4 blocks repack into groups of 32.
W4A16_GROUP_SIZE = 128
GGUF_GROUP_SIZE = 32
# Sequence lengths whose concurrency `plan` reports (plus max_model_len).
CONCURRENCY_LENGTHS = (8192, 32768, 131072)


def check_tp_shapes(config: ModelConfig, tp_size: int) -> None:
    """The splits the engine accepts (sharding.py); anything else is a user error with the numbers."""
    try:
        check_tp_size(config, tp_size)
    except ShardingError as exc:
        raise MemoryPlanError(str(exc)) from None


def _heads(config: ModelConfig, tp_size: int, tp_rank: int) -> HeadShard:
    return head_shard(config.num_attention_heads, config.num_key_value_heads, tp_size, tp_rank)


def _check_tp(tp_size: int, tp_rank: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise MemoryPlanError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str, model_dtype: str,
                       tp_size: int, tp_rank: int = 0, num_layers: int | None = None) -> int:
    """Bytes one token's K and V occupy on one device, over every KV layer (full or sliding
    attention; `num_layers` to count only some)."""
    _check_tp(tp_size, tp_rank)
    heads = _heads(config, tp_size, tp_rank).kv_heads
    if kv_cache_dtype == "int8":
        per_head = config.head_dim * 1 + INT8_KV_SCALE_BYTES
    else:
        dtype = resolve_model_dtype(config, model_dtype) if kv_cache_dtype == "auto" else kv_cache_dtype
        per_head = config.head_dim * dtype_bytes(dtype)
    # MTP heads (config.use_mtp) are one more full-attention KV layer each.
    layers = len(config.full_attention_layers) + config.mtp_layers if num_layers is None else num_layers
    return 2 * layers * heads * per_head


@dataclass(frozen=True)
class KVGroups:
    """One device's KV cost: per token of the main page group, and on mixed models the split
    between it and the sliding group (None otherwise)."""
    per_token: int
    split: GroupSplit | None

    def pages_for(self, free: int, page_size: int) -> int:
        return self.split.full_pages_for_budget(free) if self.split else free // (self.per_token * page_size)

    def bytes_for(self, pages: int, page_size: int) -> int:
        return self.split.bytes_for(pages) if self.split else pages * page_size * self.per_token


def kv_groups(config: ModelConfig, kv_cache_dtype: str, model_dtype: str, tp_size: int, tp_rank: int,
              page_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> KVGroups:
    """The KV page groups of one device, as the runner builds them."""
    window = sliding_group_window(config)
    if not window:
        return KVGroups(kv_bytes_per_token(config, kv_cache_dtype, model_dtype, tp_size, tp_rank), None)
    sliding = len(config.sliding_layers)
    full = kv_bytes_per_token(config, kv_cache_dtype, model_dtype, tp_size, tp_rank,
                              len(config.full_attention_layers) - sliding)
    slide = kv_bytes_per_token(config, kv_cache_dtype, model_dtype, tp_size, tp_rank, sliding)
    cap = sliding_page_cap(window, page_size, max_num_seqs, max_num_batched_tokens)
    return KVGroups(full, GroupSplit(cap, full * page_size, slide * page_size))


def quantization_method(config: ModelConfig, quantization: str | None) -> str | None:
    """The weight format the linear layers end up in: None (model dtype) or 'w4a16'.

    An explicit --quantization wins; otherwise a 4-bit GPTQ/AWQ/AutoRound config is detected.
    GGUF files are counted at the model dtype: the loader dequantizes them unless told w4a16.
    """
    if quantization:
        if quantization.lower() not in ("w4a16",):
            raise MemoryPlanError(f"--quantization {quantization!r} is not supported; use w4a16")
        return "w4a16"
    q = config.quantization or {}
    method = str(q.get("quant_method", q.get("format", ""))).lower().replace("_", "-")
    if method in ("gptq", "awq", "auto-round", "autoround") and int(q.get("bits", 4)) == 4:
        return "w4a16"
    return None


def _w4a16_group_size(config: ModelConfig) -> int:
    q = config.quantization or {}
    if q.get("format") == "gguf":
        return GGUF_GROUP_SIZE
    try:
        group = int(q.get("group_size", W4A16_GROUP_SIZE) or W4A16_GROUP_SIZE)
    except (TypeError, ValueError):
        group = W4A16_GROUP_SIZE
    return group if group > 0 else W4A16_GROUP_SIZE  # -1 (one group per column) ~ large groups


def _linear_bytes(in_features: int, out_features: int, dtype_size: int, method: str | None,
                  group_size: int) -> int:
    if method == "mxfp4":  # gpt-oss experts: 4-bit codes and a one-byte scale per 32 weights
        return in_features * out_features // 2 + in_features * out_features // 32
    if method == "w4a16":
        groups = math.ceil(in_features / group_size)
        packed = in_features * out_features // 2
        scales_and_biases = groups * out_features * 2 * 2  # fp16 each
        return packed + scales_and_biases
    return in_features * out_features * dtype_size


def weight_bytes(config: ModelConfig, dtype: str, quantization: str | None,
                 tp_size: int, tp_rank: int = 0, quantize_lm_head: bool = False) -> int:
    """Parameter bytes resident on one device (embeddings and lm_head vocab-split too);
    quantize_lm_head (--quantize-lm-head): the head as a 4-bit copy (ParallelLMHead.quantize_w4:
    an untied head's 16-bit weight goes, a tied one's stays for the embedding)."""
    _check_tp(tp_size, tp_rank)
    size = dtype_bytes(resolve_model_dtype(config, dtype))
    method = quantization_method(config, quantization)
    group = _w4a16_group_size(config)
    h, d = config.hidden_size, config.head_dim
    check_tp_shapes(config, tp_size)
    heads = _heads(config, tp_size, tp_rank)
    q_heads, kv_heads = heads.q_heads, heads.kv_heads
    inter = config.intermediate_size // tp_size

    qkv_out = ((2 if config.attn_output_gate else 1) * q_heads + 2 * kv_heads) * d
    common = (
        _linear_bytes(h, 2 * inter, size, method, group)        # gate_up (column-parallel)
        + _linear_bytes(inter, h, size, method, group)          # down (row-parallel)
        + 2 * h * size                                          # input / post-attention norms
    )
    attention = (
        _linear_bytes(h, qkv_out, size, method, group)          # qkv (column-parallel)
        + _linear_bytes(q_heads * d, h, size, method, group)    # o_proj (row-parallel)
    )
    if config.attention_bias:
        attention += qkv_out * size
    if config.qk_norm:
        attention += 2 * d * size
    layout = StateLayout.for_model(config, tp_size, dtype)
    gdn = sum(_linear_bytes(p.in_features, p.out_features, size, method if p.quantized else None,
                            group) for p in gdn_linears(config, layout))
    gdn += gdn_small_param_bytes(config, layout, size)
    layers = (len(config.full_attention_layers) * (attention + common)
              + layout.num_layers * (gdn + common))
    if config.mtp_layers:  # MTP head: fc (2H -> H, model dtype), 3 norms, its attention layers
        layers += (config.mtp_layers * (attention + common) + 2 * h * h * size + 3 * h * size)
    vocab = padded_shard(config.vocab_size, tp_size, 0)[1]
    embed = vocab * h * size  # embeddings and lm_head stay in the model dtype under w4a16
    lm_head = 0 if config.tie_word_embeddings else embed
    if quantize_lm_head:
        lm_head = _linear_bytes(h, vocab, size, "w4a16", next((g for g in (128, 64, 32) if h % g == 0), 32))
    total = layers + embed + lm_head + h * size  # + final norm
    return total + moe_weight_delta(config, size, method, group, tp_size)


# -- mixture of experts (layers/moe.py): every expert resident, each one's width split over ranks
# (sharding.required_splits refuses a width the ranks do not divide) --

def _gated_mlp_bytes(hidden: int, inter_local: int, size: int, method: str | None, group: int) -> int:
    return (_linear_bytes(hidden, 2 * inter_local, size, method, group)
            + _linear_bytes(inter_local, hidden, size, method, group))


def moe_layer_mlp_bytes(config: ModelConfig, size: int, method: str | None, group: int,
                        tp_size: int) -> int:
    """One sparse layer's MLP on one rank: the router (replicated, model dtype), all experts'
    shards, and the shared expert with its gate."""
    h = config.hidden_size
    total = config.num_experts * h * size
    expert_method = "mxfp4" if config.experts_mxfp4 else method
    total += config.num_experts * _gated_mlp_bytes(h, config.moe_intermediate_size // tp_size,
                                                   size, expert_method, group)
    if config.has_shared_expert:
        total += _gated_mlp_bytes(h, config.shared_expert_intermediate_size // tp_size, size,
                                  method, group) + h * size
    return total


def moe_weight_delta(config: ModelConfig, size: int, method: str | None, group: int,
                     tp_size: int) -> int:
    """What the sparse layers add over the dense-MLP count weight_bytes starts from."""
    if not config.is_moe:
        return 0
    dense = _gated_mlp_bytes(config.hidden_size, config.intermediate_size // tp_size, size, method, group)
    sparse = len(config.moe_layers) + config.mtp_layers  # an MoE family's MTP layers are sparse too
    return sparse * (moe_layer_mlp_bytes(config, size, method, group, tp_size) - dense)


def moe_activation_bytes(config: ModelConfig, tokens: int, size: int, tp_size: int) -> int:
    """A sparse MLP's transient peak: per (token, pick) slot the expert activation and output row,
    fp32 router logits/probabilities, and the sort buffers (kernels/fused_moe.py)."""
    if not config.is_moe:
        return 0
    slots = tokens * config.num_experts_per_tok
    inter = config.moe_intermediate_size // tp_size
    return (slots * (inter + config.hidden_size) * size + 2 * tokens * config.num_experts * 4
            + 3 * (slots + config.num_experts * 64) * 4 + 2 * tokens * config.hidden_size * size)


@dataclass(frozen=True)
class ParameterCount:
    total: int  # every parameter (all experts)
    active: int  # those one token reads: all but the experts it was not routed to


def parameter_count(config: ModelConfig) -> ParameterCount:
    """Parameters of the whole model and those active per token (k of E experts per layer).
    Embedding rows count in both (as model cards count them). Hybrids: attention (q_proj twice
    as wide with an output gate) on the full-attention layers, Gated DeltaNet on the others."""
    h, d = config.hidden_size, config.head_dim
    q_rows = (2 if config.attn_output_gate else 1) * config.num_attention_heads * d
    attn = h * (q_rows + 2 * config.num_key_value_heads * d)
    attn += config.num_attention_heads * d * h + 2 * h
    if config.qk_norm:
        attn += 2 * d
    mixers = len(config.full_attention_layers) * attn
    if config.is_hybrid:
        mixers += len(config.linear_attention_layers) * (gdn_param_count(config) + 2 * h)
    dense_mlp = 3 * h * config.intermediate_size
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + h
    total = active = mixers + embed
    sparse = set(config.moe_layers)
    expert = 3 * h * config.moe_intermediate_size
    shared = (3 * h * config.shared_expert_intermediate_size + h) if config.has_shared_expert else 0
    for layer in range(config.num_hidden_layers):
        if layer in sparse:
            total += config.num_experts * (h + expert) + shared
            active += config.num_experts * h + config.num_experts_per_tok * expert + shared
        else:
            total += dense_mlp
            active += dense_mlp
    return ParameterCount(total, active)


def parameter_fields(config: ModelConfig) -> dict[str, int]:
    """/v1/status engine-config keys: parameters and active_parameters (per token)."""
    count = parameter_count(config)
    return {"parameters": count.total, "active_parameters": count.active}


def rope_table_bytes(config: ModelConfig) -> int:
    """The RoPE cos/sin table every rank keeps as a float32 buffer (layers/rotary.py): one row of
    head_dim values (the rotated share of it under partial rotary) per position the model
    addresses (model/context_limit.py)."""
    length = rope_table_rows(config.max_position_embeddings, config.rope_scaling)
    return length * int(config.head_dim * config.partial_rotary_factor) * 4


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, dtype: str,
                     tp_size: int, max_num_seqs: int = 256) -> int:
    """Peak transient memory of one forward of `max_num_batched_tokens` tokens (an estimate).

    Counts the live tensors at the widest point of a layer (residual, normed input, qkv, attention
    output, gate_up and its activation; on hybrids also a GDN layer's, see gdn_memory.py) plus
    float32 logits for the sampled rows, gathered over the vocab. The engine measures the real
    peak with a profile run; this is for planning.
    """
    _check_tp(tp_size, 0)
    size = dtype_bytes(resolve_model_dtype(config, dtype))
    t = max(int(max_num_batched_tokens), 1)
    h, d = config.hidden_size, config.head_dim
    heads = _heads(config, tp_size, 0)
    q, kv = heads.q_heads * d, heads.kv_heads * d
    inter = -(-config.intermediate_size // tp_size)
    gate = q if config.attn_output_gate else 0  # the gate rides in q_proj and is applied after
    attention_phase = 2 * h + (q + gate + 2 * kv) + q + gate + h
    mlp_phase = 2 * h + 2 * inter + inter + h
    hidden = max(t * max(attention_phase, mlp_phase) * size,
                 moe_activation_bytes(config, t, size, tp_size))
    if config.is_hybrid:
        layout = StateLayout.for_model(config, tp_size, dtype)
        hidden = max(hidden, gdn_activation_bytes(config, layout, t, size))
    rows = min(t, max(int(max_num_seqs), 1))
    vocab_shard = padded_shard(config.vocab_size, tp_size, 0)[1]
    # local shard + gathered logits + one float32 working copy in the sampler (softmax/top-p)
    logits = rows * (vocab_shard + 2 * config.vocab_size) * 4
    return hidden + logits


def graph_capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured as CUDA/HIP graphs: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    return sizes or [1]


# Per captured graph: kernel parameter blocks and the private pool's fragmentation (an estimate;
# vLLM and SGLang logs show ~1-4 MiB per graph for 7-32B models).
GRAPH_OVERHEAD_BYTES = 2 << 20


def graph_bytes(config: ModelConfig, max_num_seqs: int, dtype: str, tp_size: int,
                enforce_eager: bool = False) -> int:
    """Memory held by captured decode graphs: one pool sized for the largest batch plus overhead,
    batches of up to 8 counted twice (where the arch has short_kv_splits, cuda_graphs.py captures
    them again for short contexts; planned on every arch, the plan knowing none). An MTP model
    (config.use_mtp) adds its head's graphs in the same pool (spec/mtp_graphs.py): their overhead,
    the hidden-state rows each decode/verify graph keeps as a static output ([rows, hidden], model
    dtype: about one row per captured row) and the head's static input."""
    if enforce_eager:
        return 0
    sizes = graph_capture_sizes(max_num_seqs)
    pool = activation_bytes(config, max(sizes), dtype, tp_size, max_num_seqs=max(sizes))
    mtp = 0
    if config.mtp_layers:
        row = config.hidden_size * dtype_bytes(dtype)
        mtp = (sum(sizes) + max(sizes)) * row + len(sizes) * config.mtp_layers * GRAPH_OVERHEAD_BYTES
    short = sum(1 for s in sizes if s <= 8)
    return pool + (len(sizes) + short) * GRAPH_OVERHEAD_BYTES + mtp


# Memory outside torch's allocator: CUDA/HIP context, cuBLAS/hipBLASLt workspaces, and with TP the
# NCCL/RCCL channel buffers. Subtracted from the budget before the KV cache gets the rest.
NON_TORCH_BYTES = 400 << 20
NON_TORCH_TP_EXTRA_BYTES = 256 << 20


@dataclass(frozen=True)
class DevicePlan:
    rank: int
    total_bytes: int
    budget_bytes: int  # total * gpu_memory_utilization
    weights_bytes: int  # parameters
    buffers_bytes: int  # non-parameter tensors loaded with the model (RoPE table)
    activation_bytes: int
    graph_bytes: int
    state_bytes: int  # hybrids: (running sequences + snapshot pool) x state_bytes_per_sequence
    other_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    num_pages: int
    tokens_capacity: int
    state_bytes_per_sequence: int = 0  # GDN conv + recurrent state of one sequence, this device


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    tensor_parallel_size: int
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    page_size: int
    max_model_len: int
    per_device: list[DevicePlan]
    kv_bytes_per_token: int  # on the device that holds the most KV heads (rank 0)
    tokens_capacity: int  # the smallest device's: a token needs a page on every rank
    state_bytes_per_sequence: int = 0  # per device (heads split evenly); 0 without GDN layers
    state_snapshots: int = 0  # the prefix cache's snapshot pool, in sequences' worth of state
    # speculation on a hybrid: each running sequence's pending verify rows (kernels/gdn_pending.py)
    verify_bytes_per_sequence: int = 0
    max_concurrency: dict[str, int] = field(default_factory=dict)  # seq len -> full-length seqs
    warnings: list[str] = field(default_factory=list)
    sliding: dict[str, Any] = field(default_factory=dict)  # sliding_window_figures; {} without
    parameters: int = 0  # the whole model's (parameter_count), all experts
    active_parameters: int = 0  # those one token reads (MoE: fewer than parameters)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def max_concurrency(num_pages: int, page_size: int, seq_len: int, sliding_pages: int = 0,
                    window: int = 0) -> int:
    """How many sequences of seq_len tokens fit at once (each rounds up to whole pages); with a
    sliding page group (window > 0), each also holds its window's pages there."""
    pages = max(math.ceil(seq_len / page_size), 1)
    fit = num_pages // pages
    if window:
        fit = min(fit, sliding_pages // min(pages, math.ceil(window / page_size) + 1))
    return fit


def plan(config: ModelConfig, *, gpu_memory_bytes: int, tensor_parallel_size: int = 1,
         kv_cache_dtype: str = "auto", dtype: str = "auto", quantization: str | None = None,
         gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
         max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, page_size: int = 16,
         enforce_eager: bool = False, enable_prefix_caching: bool = True,
         max_state_snapshots: int | None = None,
         state_snapshot_memory_bytes: int | None = None,
         num_speculative_tokens: int = 0, quantize_lm_head: bool = False) -> MemoryPlan:
    """Split each device's budget into weights, activations, graphs, state, other, and KV (the
    rest). The snapshot flags and quantize_lm_head mean what EngineArgs' fields of the same names mean;
    num_speculative_tokens: K of --speculative-config (hybrids keep K+1 pending verify rows per
    running slot, kernels/gdn_pending.py; an MTP head is counted when config.use_mtp, spec/mtp.py)."""
    tp = tensor_parallel_size
    _check_tp(tp, 0)
    if gpu_memory_bytes <= 0:
        raise MemoryPlanError("--gpu-memory must be positive, e.g. 24GiB")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise MemoryPlanError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    check_tp_shapes(config, tp)
    dtype = resolve_model_dtype(config, dtype)
    max_len = max_model_len or model_max_positions(config)
    method = quantization_method(config, quantization)
    budget = int(gpu_memory_bytes * gpu_memory_utilization)
    activation = activation_bytes(config, max_num_batched_tokens, dtype, tp, max_num_seqs)
    graphs = graph_bytes(config, max_num_seqs, dtype, tp, enforce_eager)  # runner.eager
    other = NON_TORCH_BYTES + (NON_TORCH_TP_EXTRA_BYTES if tp > 1 else 0)
    buffers = rope_table_bytes(config)
    layout = StateLayout.for_model(config, tp, dtype)
    snapshots = layout.snapshot_count(max_num_seqs, max_state_snapshots,
                                      state_snapshot_memory_bytes, enable_prefix_caching)
    pending = layout.pending_bytes_per_sequence(num_speculative_tokens + 1 if num_speculative_tokens else 0)
    state = (max_num_seqs + snapshots) * layout.bytes_per_sequence + max_num_seqs * pending  # the runner's rule
    warnings: list[str] = []
    weights = [weight_bytes(config, dtype, method, tp, rank, quantize_lm_head) for rank in range(tp)]
    groups = [kv_groups(config, kv_cache_dtype, dtype, tp, rank, page_size, max_num_seqs,
                        max_num_batched_tokens) for rank in range(tp)]
    per_token = [g.per_token for g in groups]
    # Every rank allocates the same number of pages (a token needs its page on every rank), so
    # the tightest rank decides; ranks with fewer KV heads then use fewer bytes for them.
    free = [max(budget - w - buffers - activation - graphs - state - other, 0) for w in weights]
    num_pages = min(g.pages_for(f, page_size) for f, g in zip(free, groups))
    split = groups[0].split
    sliding_pages = split.sliding_pages(num_pages) if split else 0
    for rank in range(tp):
        if free[rank] == 0:
            states = f", sequence states ({state / 1e9:.2f} GB)" if state else ""
            warnings.append(f"device {rank}: weights ({weights[rank] / 1e9:.2f} GB){states} and "
                            f"working memory do not fit in the {budget / 1e9:.2f} GB budget; no "
                            "room for KV cache")
    devices = [DevicePlan(rank, gpu_memory_bytes, budget, weights[rank], buffers, activation,
                          graphs, state, other, groups[rank].bytes_for(num_pages, page_size),
                          per_token[rank], num_pages, num_pages * page_size,
                          layout.bytes_per_sequence) for rank in range(tp)]
    capacity = num_pages * page_size
    if 0 < capacity < max_len:
        warnings.append(f"the KV cache holds {capacity} tokens, less than one "
                        f"--max-model-len {max_len} sequence")
    lengths = sorted({*CONCURRENCY_LENGTHS, max_len})
    concurrency = {str(n): max_concurrency(num_pages, page_size, n, sliding_pages,
                                           sliding_group_window(config)) for n in lengths}
    sliding = sliding_window_figures(config, kv_bytes_per_token(config, kv_cache_dtype, dtype, tp),
                                     devices[0].kv_cache_bytes, page_size, lengths)
    if split:  # the engine's page groups decide what fits, not the bytes alone
        sliding.update(sliding_group_pages=sliding_pages, max_concurrency=concurrency)
    return MemoryPlan(
        model=config.name, tensor_parallel_size=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        quantization=method, page_size=page_size, max_model_len=max_len, per_device=devices,
        kv_bytes_per_token=devices[0].kv_bytes_per_token, tokens_capacity=capacity,
        state_bytes_per_sequence=layout.bytes_per_sequence, state_snapshots=snapshots,
        verify_bytes_per_sequence=pending, max_concurrency=concurrency, warnings=warnings, sliding=sliding,
        **parameter_fields(config),
    )


# -- sliding-window layers (Gemma 3, Mistral, Qwen2 windows) -------------------------------------

def windowed_kv_bytes(config: ModelConfig, kv_bytes_per_token_all_layers: int, seq_len: int,
                      page_size: int) -> int:
    """KV bytes one seq_len-token sequence needs on a device when every sliding layer holds only
    its window: a window of W keys starting anywhere in a page spans ceil(W / page) + 1 pages;
    full-attention layers hold every page."""
    layers = config.full_attention_layers
    per_layer_token = kv_bytes_per_token_all_layers // max(len(layers), 1)
    pages = math.ceil(seq_len / page_size)
    sliding = len(config.sliding_layers)
    window_pages = min(pages, math.ceil(config.sliding_window / page_size) + 1)
    return per_layer_token * page_size * ((len(layers) - sliding) * pages + sliding * window_pages)


def sliding_window_figures(config: ModelConfig, kv_bytes_per_token_all_layers: int,
                           kv_cache_bytes: int, page_size: int, lengths: list[int]) -> dict[str, Any]:
    """For a model with sliding layers: per-sequence KV bytes with the sliding layers capped at
    the window vs uncapped, and how many sequences of each length the KV budget holds capped.
    `engine_caps`: the engine gives those pages back (every KV layer sliding, or a mixed model's
    sliding page group: `plan` then sets `sliding_group_pages` and the groups' concurrency)."""
    if not config.sliding_layers:
        return {}
    capped = {str(n): windowed_kv_bytes(config, kv_bytes_per_token_all_layers, n, page_size)
              for n in lengths}
    full = {str(n): math.ceil(n / page_size) * page_size * kv_bytes_per_token_all_layers for n in lengths}
    return {
        "window": config.sliding_window,
        "sliding_layers": len(config.sliding_layers),
        "full_layers": len(config.full_attention_layers) - len(config.sliding_layers),
        "engine_caps": (config.sliding_layers == config.full_attention_layers
                        or bool(sliding_group_window(config))),
        "sliding_group_pages": 0,
        "kv_bytes_per_sequence": capped,
        "kv_bytes_per_sequence_uncapped": full,
        "max_concurrency": {n: kv_cache_bytes // b if b else 0 for n, b in capped.items()},
    }
