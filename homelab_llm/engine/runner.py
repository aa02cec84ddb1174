"""ModelRunner: one per rank. Loads the model, sizes and binds the KV cache from measured memory
(and, on hybrid models, the Gated DeltaNet state pool before it), turns a scheduled step into batch
tensors and a ForwardContext, and runs the forward. A model that mixes full and sliding attention
gets two page groups (cache/page_groups.py): the sliding layers are bound to their own pool."""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.cache.page_groups import GroupSplit, sliding_group_window, sliding_page_cap
from homelab_llm.engine.cache.page_pool import KVLayout, PagePool
from homelab_llm.engine.cache.state_layout import StateLayout
from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.cache.state_pool import StatePool
from homelab_llm.engine.context import forward_context
from homelab_llm.engine.device import fast_cpu_default
from homelab_llm.engine.graph_capture import Capturer
from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.layers.attention import Attention
from homelab_llm.engine.model.config import ModelConfig
from homelab_llm.engine.model.context_limit import rope_table_rows
from homelab_llm.engine.scheduler import ScheduledSeq
from homelab_llm.engine.spec.config import parse_speculative_config, verify_width
from homelab_llm.engine.step_check import StepBounds, check_plan
from homelab_llm.engine.step_plan import (HostStager, PlanHeader, StepBatch, batch_from_plan, build_plan,
                                          plan_from_lists)

# Without a flag, the CPU path keeps its KV cache to this (as vLLM's CPU backend does by default):
# system RAM is shared with everything else on the box and is not ours to take.
CPU_DEFAULT_KV_BYTES = 1 << 30

_KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "int8": torch.int8}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else _KV_DTYPES[kv_cache_dtype]


@dataclass
class MemorySplit:
    """Bytes on one device, as measured (the /v1/status `devices` entry)."""
    name: str
    total: int = 0
    weights: int = 0
    activations_peak: int = 0
    graphs: int = 0
    kv_cache: int = 0
    state: int = 0  # hybrid models' running states + prefix snapshots
    other: int = 0
    free: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int | str]:
        return {"name": self.name, "total": self.total, "weights": self.weights,
                "activations_peak": self.activations_peak, "graphs": self.graphs,
                "kv_cache": self.kv_cache, "state": self.state, "other": self.other,
                "free": self.free}


def _cpu_memory() -> tuple[int, int]:
    """(total, available) system memory in bytes, from /proc/meminfo."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return 0, 0
    return info.get("MemTotal", 0), info.get("MemAvailable", 0)


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ModelRunner:
    def __init__(self, args: EngineArgs, config: ModelConfig, model_path: str,
                 device: torch.device, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1) -> None:
        from homelab_llm.engine.model.loader import load_model

        self.args = args
        self.config = config
        self.device = device
        self.dtype = dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.page_size = args.page_size
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.model = load_model(config, model_path, args.load_format, dtype, device,
                                tp_rank=tp_rank, tp_size=tp_size, quantization=args.quantization,
                                fast_cpu=fast_cpu_default(args.dtype, device),
                                quantize_lm_head=args.quantize_lm_head)
        weights = sum(t.numel() * t.element_size()
                      for t in list(self.model.parameters()) + list(self.model.buffers()))
        if device.type == "cuda":
            weights = max(weights, torch.cuda.memory_allocated(device) - before)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.memory = MemorySplit(name=name, weights=weights)
        self.pool: PagePool | None = None
        self.graphs = None  # DecodeGraphs once captured
        self.head_graphs = None  # MTP models: HeadGraphs (spec/mtp_graphs.py) once captured
        self.stager = HostStager(device)
        # Rows of the RoPE table (layers/rotary.py sizes it by the same rule).
        self.max_positions = rope_table_rows(config.max_position_embeddings, config.rope_scaling)
        self.failure = None  # one device: nothing dies under it (ParallelRunner sets its own)
        # MTP models (config.use_mtp): the last forward's final hidden states [T, H],
        # and the head's output rows of its last draft step (run_mtp).
        self.last_hidden: torch.Tensor | None = None
        self.mtp_hidden: torch.Tensor | None = None
        self.mtp_tokens: torch.Tensor | None = None  # ... and their argmax tokens
        # Tests inject faults here (e.g. a simulated device error): called with each batch
        # before its forward.
        self.fault_hook: Callable[[StepBatch], None] | None = None
        spec = parse_speculative_config(args.speculative_config)
        self.verify_width = verify_width(spec)
        self.state_pool = self._allocate_states()

    # -- hybrid state -------------------------------------------------------------------------
    def state_slot_counts(self) -> tuple[int, int]:
        """(running slots, snapshot slots) of the state pool; (0, 0) on a plain transformer."""
        if not self.config.is_hybrid:
            return 0, 0
        a = self.args
        return a.max_num_seqs, self.state_layout().snapshot_count(
            a.max_num_seqs, a.max_state_snapshots, a.state_snapshot_memory_bytes, a.enable_prefix_caching)

    def state_layout(self) -> StateLayout:
        return StateLayout.for_model(self.config, self.tp_size, str(self.dtype).removeprefix("torch."))

    def _allocate_states(self) -> StatePool | None:
        """Hybrid models: the state slots, allocated before the KV cache is sized so the KV
        budget sees them as used; bound to the model's GDN layers."""
        if not self.config.is_hybrid:
            return None
        running, snapshots = self.state_slot_counts()
        # Speculation: the verify rows' pending-row areas (kernels/gdn_pending.py).
        pending_rows = self.verify_width if self.verify_width > 1 else 0
        pool = StatePool(self.state_layout(), running + snapshots, self.device, self.dtype, pending_rows, running)
        pending = pool.pending or [None] * len(pool.conv_states)
        for layer, conv, ssm, rows in zip(self.model.gdn_layers, pool.conv_states, pool.ssm_states, pending):
            layer.conv_state, layer.ssm_state, layer.pending = conv, ssm, rows
        self.memory.state = pool.memory_bytes
        return pool

    # -- KV sizing ----------------------------------------------------------------------------
    def kv_groups(self) -> tuple[list[Attention], list[Attention]]:
        """(layers on the main page pool, layers on the sliding page group's pool); the second
        is empty unless the model mixes full and sliding attention (cache/page_groups.py)."""
        layers = self.model.attention_layers
        if not sliding_group_window(self.config):
            return list(layers), []
        return [a for a in layers if not a.window], [a for a in layers if a.window]

    def kv_layout(self, sliding: bool = False) -> KVLayout:
        """The main pool's layout (hybrids: full-attention layers only; mixed models: the
        full-attention layers), or with `sliding` the sliding page group's."""
        layers = self.kv_groups()[1 if sliding else 0]
        dtype = resolve_kv_dtype(self.args.kv_cache_dtype, self.dtype)
        return KVLayout(
            num_layers=len(layers),
            num_kv_heads=self.model.attention_layers[0].num_kv_heads,  # this rank's share
            head_dim=self.config.head_dim,
            page_size=self.page_size,
            dtype=dtype,
            v_dim_major=dispatch.int8_v_dim_major(self.device, dtype),
        )

    def group_split(self) -> GroupSplit | None:
        """Mixed models: how the KV budget divides between the two page groups."""
        window = sliding_group_window(self.config)
        if not window:
            return None
        a = self.args
        return GroupSplit(sliding_page_cap(window, self.page_size, a.max_num_seqs, a.max_num_batched_tokens),
                          self.kv_layout().bytes_per_page(), self.kv_layout(sliding=True).bytes_per_page())

    def kv_bytes_for_pages(self, num_pages: int) -> int:
        """Bytes of `num_pages` main-pool pages and the sliding group's pages that go with them."""
        split = self.group_split()
        return split.bytes_for(num_pages) if split else num_pages * self.kv_layout().bytes_per_page()

    def _new_pool(self, num_pages: int) -> PagePool:
        pool = PagePool(self.kv_layout(), num_pages, self.device)
        split = self.group_split()
        if split is not None:
            pool.sliding = PagePool(self.kv_layout(sliding=True), split.sliding_pages(num_pages), self.device)
        return pool

    def _profile_peak_activations(self) -> int:
        """Run the largest forward a step can make and measure its peak memory beyond weights."""
        n = self.args.max_num_batched_tokens
        pages = -(-n // self.page_size)
        scratch = self._new_pool(pages)
        self.bind_kv(scratch)
        page_table = [list(range(pages))]
        sliding = (list(range(n)), page_table) if scratch.sliding is not None else None
        batch = self.batch_from_plan(*plan_from_lists(
            [0] * n, list(range(n)), list(range(n)), [n], [n], page_table, [n - 1], [0],
            sliding=sliding))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.forward(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.last_hidden = None  # an MTP model's: nothing to draft from a profile run
        self.unbind_kv()
        del scratch
        torch.cuda.empty_cache()
        return peak

    def kv_budget(self) -> int:
        """Bytes for the KV cache on this device: the flag, else measured free memory."""
        m = self.memory
        if self.device.type == "cuda":
            m.activations_peak = self._profile_peak_activations()
            free, total = torch.cuda.mem_get_info(self.device)
            m.total = total
            torch_reserved = torch.cuda.memory_reserved(self.device)
            m.other = max(0, (total - free) - torch_reserved)  # other processes, driver, NCCL
            if self.args.kv_cache_memory_bytes is not None:
                return self.args.kv_cache_memory_bytes
            budget = int(total * self.args.gpu_memory_utilization) - (
                m.weights + m.state + m.activations_peak + self._graph_reserve() + m.other)
            return max(0, budget)
        total, available = _cpu_memory()
        m.total = total
        if self.args.kv_cache_memory_bytes is not None:
            return self.args.kv_cache_memory_bytes
        return int(min(CPU_DEFAULT_KV_BYTES, available * self.args.gpu_memory_utilization * 0.5))

    def pages_for_budget(self, budget: int) -> int:
        split = self.group_split()
        return split.full_pages_for_budget(budget) if split else budget // self.kv_layout().bytes_per_page()

    def allocate_kv(self, budget: int) -> PagePool:
        return self.allocate_pages(self.pages_for_budget(budget))

    def _graph_reserve(self) -> int:
        """Room kept for decode graphs before the KV cache takes the rest (measured after)."""
        if self.eager:
            return 0
        from homelab_llm.engine.memory import graph_bytes

        rows = self.args.max_num_seqs * self.verify_width  # verify graphs: K+1 rows per sequence
        return graph_bytes(self.config, rows, str(self.dtype).removeprefix("torch."), self.tp_size)

    def allocate_pages(self, num_pages: int) -> PagePool:
        self.pool = self._new_pool(num_pages)
        self.bind_kv(self.pool)
        self.memory.kv_cache = self.pool.memory_bytes + (
            self.pool.sliding.memory_bytes if self.pool.sliding is not None else 0)
        self.refresh_memory()
        return self.pool

    @property
    def eager(self) -> bool:
        """No decode graphs: asked for (--enforce-eager)."""
        return self.args.enforce_eager

    def capture_graphs(self, max_model_len: int) -> None:
        """Decode graphs for every padded batch size up to max_num_seqs, and when speculating the
        verify shapes beside them (cuda_graphs.graph_shapes); an MTP model's head gets its own
        (spec/mtp_graphs.py). GPU only."""
        if self.device.type != "cuda" or self.eager:
            return
        from homelab_llm.engine.graph_capture import CudaCapture

        self.install_graphs(max_model_len, CudaCapture(self.device))

    def install_graphs(self, max_model_len: int, capturer: Capturer) -> None:
        """capture_graphs' work with any capturer (tests pass graph_capture.EagerCapture)."""
        from homelab_llm.engine.cuda_graphs import (DecodeGraphs, graph_kv_splits, graph_shapes,
                                                    kv_row_programs)
        from homelab_llm.engine.kernels.tuning import tiles_for

        max_pages = -(-max_model_len // self.page_size)
        shapes = graph_shapes(self.args.max_num_seqs, self.verify_width)
        kv_heads = self.model.attention_layers[0].num_kv_heads
        splits = graph_kv_splits(self.device, kv_heads, max_model_len, self.page_size)
        row_programs = kv_row_programs(self.device, kv_heads)
        self.graphs = DecodeGraphs(self.model, self.device, max(rows for rows, _ in shapes), max_pages,
                                   self.page_size, splits,
                                   sliding=self.pool is not None and self.pool.sliding is not None,
                                   keep_hidden=self.config.use_mtp, capturer=capturer,
                                   row_programs=row_programs,
                                   short_kv_splits=tiles_for(self.device).short_kv_splits)
        self.graphs.capture(shapes)
        self.memory.graphs = self.graphs.memory_bytes
        if self.config.use_mtp:
            from homelab_llm.engine.spec.mtp_graphs import HeadGraphs, head_graph_rows

            sizes = head_graph_rows(self.args.max_num_seqs, self.verify_width)
            self.head_graphs = HeadGraphs(self.model.mtp, self.model.model.embed_tokens,
                                          self.model.compute_logits, self.config.hidden_size, self.dtype,
                                          self.device, max(sizes), max_pages, self.page_size, splits,
                                          self.args.max_num_seqs, capturer, row_programs)
            self.head_graphs.capture(sizes)
            self.memory.graphs += self.head_graphs.memory_bytes

    def release_graphs(self) -> None:
        """Destroy every captured graph (what they captured, collectives included, is let go);
        steps run eagerly afterwards."""
        for graphs in (self.graphs, self.head_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.head_graphs = None

    def memory_splits(self) -> list[MemorySplit]:
        return [self.memory]

    def refresh_memory(self) -> None:
        m = self.memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            m.total, m.free = total, free
        else:
            total, available = _cpu_memory()
            m.total, m.free = total, available
            m.other = max(0, _rss_peak() - m.weights - m.kv_cache - m.state)

    def bind_kv(self, pool: PagePool) -> None:
        main, sliding = self.kv_groups()
        for layers, group in ((main, pool), (sliding, pool.sliding)):
            for i, attn in enumerate(layers):
                assert group is not None
                attn.k_cache, attn.v_cache = group.k_caches[i], group.v_caches[i]
                attn.k_scale, attn.v_scale = group.k_scales[i], group.v_scales[i]
                attn.sliding_group = group is pool.sliding

    def unbind_kv(self) -> None:
        for attn in self.model.attention_layers:
            attn.k_cache = attn.v_cache = attn.k_scale = attn.v_scale = None

    def release(self) -> None:
        """Let go of the device memory this runner holds (decode graphs, KV cache, weights,
        staging buffers) at engine shutdown, so it returns even while something still refers to
        the runner. The runner cannot step afterwards. Idempotent."""
        self.release_graphs()
        if getattr(self, "model", None) is not None:
            self.unbind_kv()
        self.pool = None
        self.state_pool = None
        self.last_hidden = self.mtp_hidden = self.mtp_tokens = None
        self.model = None
        self.stager = HostStager(self.device)  # empty: its pinned buffers and events go

    def shutdown(self) -> None:
        """The Runner protocol's end (runner_protocol.py): one device has nothing else to stop."""
        self.release()

    # -- one step -----------------------------------------------------------------------------
    def step_bounds(self) -> StepBounds:
        assert self.pool is not None, "allocate the KV cache before the first step"
        sliding = self.pool.sliding.num_pages if self.pool.sliding is not None else 0
        return StepBounds(self.max_positions, self.pool.num_pages, self.page_size, sliding)

    def checked_plan(self, scheduled: list[ScheduledSeq], copies: CacheCopies | None = None
                     ) -> tuple[PlanHeader, torch.Tensor]:
        """The step's plan; a sequence whose positions or pages are out of bounds raises
        SequenceFault here, on the host, before any kernel (or another rank) sees it."""
        header, payload = build_plan(scheduled, self.page_size, copies=copies,
                                     verify_width=self.verify_width,
                                     sliding=self.pool is not None and self.pool.sliding is not None)
        check_plan(header, payload, self.step_bounds(), scheduled)
        return header, payload

    def prepare(self, scheduled: list[ScheduledSeq], copies: CacheCopies | None = None) -> StepBatch:
        return self.batch_from_plan(*self.checked_plan(scheduled, copies))

    def batch_from_plan(self, header: PlanHeader, payload: torch.Tensor) -> StepBatch:
        return batch_from_plan(header, payload, self.device, self.page_size, self.stager)

    def patch_inputs(self, batch: StepBatch, plan_rows: list[int], pending_rows: list[int],
                     tokens: torch.Tensor) -> None:
        """Async scheduling: fill the placeholder input ids from the previous step's tokens."""
        from homelab_llm.engine.pending import patch_input_ids

        patch_input_ids(batch, plan_rows, pending_rows, tokens, self.stager)

    @torch.inference_mode()
    def run_mtp(self, plan: tuple[PlanHeader, torch.Tensor], hidden_rows: list[int],
                step: int) -> torch.Tensor:
        """One forward of the MTP head (model/mtp.py) over `plan`: its input hidden states are
        rows of the last forward's (step 0) or of the previous head forward's logits rows; in a
        chain step (step > 0) so are its input tokens (that forward's argmax at the same rows:
        the plan's ids are placeholders, and no draft goes through the host mid-chain).
        Returns the argmax token of each logits row (on the device)."""
        mtp = self.model.mtp
        assert mtp is not None, "the model was built without its MTP head"
        source = self.last_hidden if step == 0 else self.mtp_hidden
        assert source is not None, "no hidden states to draft from"
        batch = self.batch_from_plan(*plan)
        rows = self.stager.upload(torch.tensor(hidden_rows, dtype=torch.long))  # pinned: no sync
        input_ids = batch.input_ids if step == 0 else self.mtp_tokens.index_select(0, rows)
        self.last_hidden = None  # kept only until the head has read it
        graphs = self.head_graphs
        if graphs is not None and graphs.fits(batch.context, batch.num_tokens, batch.logits_indices.numel()):
            self.mtp_hidden, self.mtp_tokens = graphs.run(input_ids, batch.context, source, rows,
                                                          batch.logits_indices, step)
            return self.mtp_tokens
        with forward_context(batch.context):
            out = mtp(input_ids, batch.positions, source.index_select(0, rows),
                      self.model.model.embed_tokens, step)
        self.mtp_hidden = out[batch.logits_indices]
        self.mtp_tokens = self.model.compute_logits(self.mtp_hidden).argmax(dim=-1)
        return self.mtp_tokens

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (float32) for the rows that sample this step."""
        if self.fault_hook is not None:
            self.fault_hook(batch)
        copies = batch.copies
        if copies.kv:
            self.pool.copy_slots(copies.kv.src, copies.kv.dst)
        if copies.sliding_kv:
            assert self.pool.sliding is not None, "sliding copies on a model without that group"
            self.pool.sliding.copy_slots(copies.sliding_kv.src, copies.sliding_kv.dst)
        if copies.state:
            assert self.state_pool is not None, "state copies on a model without GDN layers"
            self.state_pool.copy(copies.state.src, copies.state.dst)
        if self.graphs is not None and self.graphs.fits(batch.context, batch.num_tokens):
            logits = self.graphs.run(batch.input_ids, batch.context, batch.logits_indices)
            self.last_hidden = self.graphs.hidden  # the static rows: read before the next replay
            return logits
        with forward_context(batch.context):
            hidden = self.model(batch.input_ids, batch.positions)
            self.last_hidden = hidden if self.config.use_mtp else None
            if batch.logits_indices.numel() == 0:
                return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            return self.model.compute_logits(hidden[batch.logits_indices])

