"""PagePool: the KV cache memory, cut into fixed-size pages, with reference counts.

A page is held by every sequence whose page table lists it and by every radix node that stores at
least one of its tokens; it returns to the free list when the last holder lets go.

A model that mixes full and sliding attention layers (cache/page_groups.py) has two pools: this
one for its full-attention layers, and the sliding layers' own pool in `sliding` (fewer pages,
separate page ids), allocated and bound with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from homelab_llm.engine.kernels.ref import INT8_SCALE_DTYPE, kv_rotation
from homelab_llm.errors import HomelabError


class OutOfPagesError(HomelabError):
    """Raised by alloc when the pool has fewer free pages than asked for."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    page_size: int
    dtype: torch.dtype  # torch.int8 for the quantized cache
    # V stored dim-major within each page ([pages, heads, head_dim, page_size] in memory, seen
    # through a [pages, page_size, heads, head_dim] view): a decode tile's tokens are then the
    # contiguous k values of its P @ V dot (kernels/common.v_cache_strides). The runner asks it
    # for int8 caches on NVIDIA GPUs, or on any GPU with HOMELAB_LLM_KV_V_LAYOUT=dim
    # (dispatch.int8_v_dim_major).
    v_dim_major: bool = False

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    def bytes_per_token(self) -> int:
        """K and V for every layer, plus the per-token-per-head scales when quantized."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_head = self.head_dim * elem
        if self.quantized:
            per_head += torch.empty((), dtype=INT8_SCALE_DTYPE).element_size()
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def bytes_per_page(self) -> int:
        return self.bytes_per_token() * self.page_size


def new_v_cache(shape: tuple[int, int, int, int], layout: KVLayout, device: torch.device) -> torch.Tensor:
    """One layer's zeroed V cache of `shape` [pages, page_size, heads, head_dim]; with
    layout.v_dim_major stored as [pages, heads, head_dim, page_size] and returned permuted."""
    if not layout.v_dim_major:
        return torch.zeros(shape, dtype=layout.dtype, device=device)
    pages, page_size, heads, head_dim = shape
    raw = torch.zeros((pages, heads, head_dim, page_size), dtype=layout.dtype, device=device)
    return raw.permute(0, 3, 1, 2)


class PagePool:
    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        if num_pages < 1:
            raise OutOfPagesError(
                "the KV cache budget holds no page at all: raise --kv-cache-memory-bytes or "
                "--gpu-memory-utilization, or lower --max-model-len")
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = layout.page_size
        self.device = device
        shape = (num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=layout.dtype, device=device)
                         for _ in range(layout.num_layers)]
        self.v_caches = [new_v_cache(shape, layout, device) for _ in range(layout.num_layers)]
        self.k_scales: list[torch.Tensor | None] = [None] * layout.num_layers
        self.v_scales: list[torch.Tensor | None] = [None] * layout.num_layers
        if layout.quantized:
            self.k_scales = [torch.ones(shape[:3], dtype=INT8_SCALE_DTYPE, device=device)
                             for _ in range(layout.num_layers)]
            self.v_scales = [torch.ones(shape[:3], dtype=INT8_SCALE_DTYPE, device=device)
                             for _ in range(layout.num_layers)]
            kv_rotation(layout.head_dim, device)  # built now, before any CUDA-graph capture
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self.sliding: PagePool | None = None  # the sliding page group's pool (mixed models)

    # -- accounting ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def tokens_capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def memory_bytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page()

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.ref_counts[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.ref_counts[p] > 0, f"incref of free page {p}"
            self.ref_counts[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.ref_counts[p] > 0, f"decref of free page {p}"
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self._free.append(p)

    # -- data movement ------------------------------------------------------------------------
    def copy_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy K/V rows (and scales) slot by slot in every layer: used to give a sequence its own
        copy of a partially matched prefix page."""
        if not src_slots:
            return
        src = torch.tensor(src_slots, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.long, device=self.device)
        # (page, slot) pairs, which index any layout (a dim-major V does not flatten)
        src = (src // self.page_size, src % self.page_size)
        dst = (dst // self.page_size, dst % self.page_size)
        for caches in (self.k_caches, self.v_caches, self.k_scales, self.v_scales):
            for cache in caches:
                if cache is None:
                    continue
                cache[dst] = cache[src]
