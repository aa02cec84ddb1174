"""The next linear's weights asked into the L2 by the tail of the linear before it.

At one or two rows a decode step is a chain of W4A16 GEMVs (qkv, o_proj, gate_up, down, the
next layer's qkv), each a few to a few tens of MB, with a fixed cost of several us a call beyond
its bytes (docs/BENCHMARKS.md 58.2: the 8B's four GEMVs lose 20 us a layer against the copy
rate): the DRAM idles while a grid ramps up (its first loads a full latency away), while its
last programs reduce and store, and across the small kernels between two GEMVs (rope, attention).
The weights are read-only and the order of the calls is the same every step, so when a GEMV
program has issued all of its own loads it can ask the L2 for a slice of the next GEMV's
words, scales and biases (`prefetch.global.L2`: nothing waits on it). The next grid then starts
on L2 hits.

Which linear comes next is learned from the calls themselves (`observe`): every step makes the
same calls in the same order, so the link from one weight to the weight of the next call, made
on the first pass (the warm-up and the graphs' capture replay it), holds after. A call whose
weights depend on data (MoE experts picked by the router) is never a target, and the link from
a weight changes only when a call observes a different successor (a run switching between two
orders keeps the last one it saw).

Budget (`ArchTiles.l2_next_mb` / `l2_next_bands`, 0 on every arch: on the H100 it lost, BENCHMARKS 60.2;
`HOMELAB_LLM_L2_NEXT=MB[,bands]` overrides it for A/B runs, '' or 0 off): up to MB of the next
weight's bytes; a larger weight gets MB spread over `bands` equal row bands of each tensor (the
first lines of each band), so every K range's first steps (split-K programs, whole-K lane groups)
find theirs in the L2. PTX only (other targets never set it).

An MoE layer's experts are picked by data, but its gate_up programs know their picks: each asks
for its share of its own pick's down-projection expert (`picked_plan`), which the down grid
reads next.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.common import next_pow2
from homelab_llm.engine.kernels.tuning import tiles_for
from homelab_llm.engine.kernels.w4a16_half2 import l2_prefetch
from homelab_llm.engine.kernels.w4a16_pack import W4Weight

ENV = "HOMELAB_LLM_L2_NEXT"
LINE_BYTES = 128


@functools.lru_cache(maxsize=8)
def parse_budget(spec: str) -> tuple[int, int]:
    """(bytes, bands) from the env text: '' or '0' is off."""
    if not spec.strip():
        return 0, 1
    parts = spec.split(",")
    try:
        mb = float(parts[0])
        bands = int(parts[1]) if len(parts) > 1 else 16
    except ValueError:
        raise ValueError(f"{ENV} is MB[,bands], got {spec!r}") from None
    if mb < 0 or bands < 1 or len(parts) > 2:
        raise ValueError(f"{ENV} is MB[,bands] with MB >= 0 and bands >= 1, got {spec!r}")
    return int(mb * (1 << 20)), bands


def budget(device: torch.device | None = None) -> tuple[int, int]:
    """(bytes, bands): ENV where set, else the arch table's (ArchTiles.l2_next_mb)."""
    spec = os.environ.get(ENV)
    if spec is None:
        t = tiles_for(device)
        return int(t.l2_next_mb * (1 << 20)), t.l2_next_bands
    return parse_budget(spec)


@dataclass(frozen=True)
class Region:
    """Lines of one tensor to request: `per_band` lines at the start of each band of `stride`
    lines, `count` in all (a multiple of per_band), the tensor `last` + 1 lines long."""
    count: int
    per_band: int
    stride: int
    last: int


def region(nbytes: int, fraction: float, bands: int) -> Region:
    lines = max(1, -(-nbytes // LINE_BYTES))
    if fraction >= 1.0:
        return Region(lines, lines, lines, lines - 1)
    stride = -(-lines // bands)
    per = max(1, min(stride, int(stride * fraction)))
    return Region(per * -(-lines // stride), per, stride, lines - 1)


def region_lines(r: Region) -> list[int]:
    """The lines region r requests, in request order (the kernel's arithmetic, for the tests)."""
    return [min((v // r.per_band) * r.stride + v % r.per_band, r.last) for v in range(r.count)]


@dataclass(frozen=True)
class NextPlan:
    """What a grid of `programs` requests of weight `w`: its words, then its scales and biases
    (one region for both: the same shape), `lines` a program (a power of two)."""
    w: W4Weight
    words: Region
    groups: Region
    lines: int

    def kernel_args(self) -> dict:
        return dict(nx_w_ptr=self.w.qweight, nx_s_ptr=self.w.scales, nx_b_ptr=self.w.biases,
                    nx_w_count=self.words.count, nx_w_per=self.words.per_band,
                    nx_w_stride=self.words.stride, nx_w_last=self.words.last,
                    nx_g_count=self.groups.count, nx_g_per=self.groups.per_band,
                    nx_g_stride=self.groups.stride, nx_g_last=self.groups.last,
                    NEXT_LINES=self.lines)


def weight_bytes(w: W4Weight) -> tuple[int, int]:
    return (w.qweight.numel() * w.qweight.element_size(),
            w.scales.numel() * w.scales.element_size())


def plan_for(w: W4Weight, programs: int, cap: int, bands: int) -> NextPlan:
    words, groups = weight_bytes(w)
    fraction = min(1.0, cap / (words + 2 * groups))
    rw, rg = region(words, fraction, bands), region(groups, fraction, bands)
    total = rw.count + 2 * rg.count
    return NextPlan(w, rw, rg, next_pow2(-(-total // max(1, programs))))


class Chain:
    """Links each W4A16 weight to the weight of the call after it (by the qweight's identity;
    weak references: a dropped model's weights are not kept alive)."""

    def __init__(self) -> None:
        self.links: dict[int, weakref.ref] = {}
        self.last: weakref.ref | None = None

    def observe(self, w: W4Weight, target: bool) -> None:
        """A call on w; target: whether its weights are fixed (not picked by data)."""
        if self.last is not None:
            prev = self.last()
            if prev is not None and target:
                self.links[id(prev.qweight)] = weakref.ref(w)
            elif prev is not None:
                self.links.pop(id(prev.qweight), None)
        self.last = weakref.ref(w)

    def next_of(self, w: W4Weight) -> W4Weight | None:
        ref = self.links.get(id(w.qweight))
        return None if ref is None else ref()


CHAINS: dict[torch.device, Chain] = {}


def picked_plan(experts: W4Weight, programs: int, ptx: bool,
                device: torch.device | None = None) -> NextPlan | None:
    """What each pick's `programs` request of its own expert in `experts` (qweight [E, K // 8,
    N]: an MoE layer's down projection, asked for by gate_up's programs, which know their
    picks): one expert's bytes within the budget (None: off or not PTX)."""
    cap, bands = budget(device)
    if not cap or not ptx:
        return None
    one = W4Weight(experts.qweight[0], experts.scales[0], experts.biases[0], experts.group_size)
    return plan_for(one, programs, cap, bands)


def next_plan(w: W4Weight, programs: int, target: bool, device: torch.device, ptx: bool) -> NextPlan | None:
    """Record this call on w and return what its grid requests of the next weight (None: off,
    not PTX, or no successor known yet)."""
    cap, bands = budget(device)
    if not cap or not ptx:
        return None
    chain = CHAINS.setdefault(device, Chain())
    chain.observe(w, target)
    nxt = chain.next_of(w)
    return None if nxt is None else plan_for(nxt, programs, cap, bands)


@triton.jit
def region_line(v, per, stride, last):
    """Line v of a Region as a byte offset (128: LINE_BYTES; a jit function takes no plain global)."""
    return tl.minimum((v // per) * stride + v % per, last).to(tl.int64) * 128


@triton.jit
def prefetch_next(prog, nx_w_ptr, nx_s_ptr, nx_b_ptr, nx_w_count, nx_w_per, nx_w_stride, nx_w_last,
                  nx_g_count, nx_g_per, nx_g_stride, nx_g_last, NEXT_LINES: tl.constexpr):
    """Program prog's NEXT_LINES lines of the next weight (words, then scales, then biases;
    past the end the count wraps around: repeats spread over the lines, not all on one)."""
    v = (prog * NEXT_LINES + tl.arange(0, NEXT_LINES)) % (nx_w_count + 2 * nx_g_count)
    in_w = v < nx_w_count
    u = tl.where(in_w, 0, v - nx_w_count)
    in_s = u < nx_g_count
    u = tl.minimum(tl.where(in_s, u, u - nx_g_count), nx_g_count - 1)
    w_at = nx_w_ptr.to(tl.pointer_type(tl.uint8)) + region_line(tl.where(in_w, v, 0), nx_w_per, nx_w_stride,
                                                                   nx_w_last)
    g_line = region_line(u, nx_g_per, nx_g_stride, nx_g_last)
    s_at = nx_s_ptr.to(tl.pointer_type(tl.uint8)) + g_line
    b_at = nx_b_ptr.to(tl.pointer_type(tl.uint8)) + g_line
    l2_prefetch(tl.where(in_w, w_at, tl.where(in_s, s_at, b_at)))
