"""Programmatic dependent launch (PDL): a decode step's next kernel starts while this one drains.

A batch-1 decode step is a chain of ~230 small kernels (the 8B W4A16 step: 2.4 ms, ~10 us a
kernel), and every boundary costs the same: the next grid is launched only once this one has
completed and its writes are flushed, and its programs then wait a full memory round trip for
their first bytes. On sm_90 and later a launch attribute (programmatic stream serialization)
lets the next grid be launched as soon as every program of the running one has signalled, and
the `griddepcontrol` instructions order the rest:

  pdl_wait(PDL)   blocks until the previous grid has completed with its writes visible. Every
                  program of a PDL kernel runs it before it reads anything another kernel
                  writes, before it writes anything, and before any early return: the next
                  grid's wait covers only this grid, so this grid must not complete before the
                  one it follows (that is what makes the chain transitive).
  pdl_start(PDL)  lets the next grid launch once every program of this one has run it. In mode
                  EARLY kernels run it right after their wait (`pdl_enter`), so at most one grid
                  waits ahead of the running one; in mode LATE a GEMV runs it after its K loop
                  (`pdl_late`) and the other kernels by exiting.

What a program may do before its wait: read what no kernel of the step writes, which for a GEMV
is its weights. The W4A16 decode GEMV issues its first K step's words there (they overlap the
previous kernel's tail when it is launched early).

Which kernels are launched early is measured per arch (BENCHMARKS 21.1; 12.3 and 14.2 gave it to
the W4A16 GEMV alone and lost): on sm_90 every kernel but the dense and W4A16 GEMVs (the bf16
MoE experts' excepted), which still let their successors launch early but start plainly
themselves (ArchTiles.pdl_plain: their grids lost 2-9% launched into a busy GPU; an early
grid's programs pack onto the few SMs a draining grid frees, BENCHMARKS 35.2). The 1-2 row
W4A16 GEMVs of an experts layer's attention (in_experts_layer) are the exception: launched
early they gain (the 30B-A3B W4A16 at batch 1: +3.7%).

Host side: `pdl_args(device)` gives a kernel launch both the constexpr and the launch option
({} where PDL is off, so the kernels compile and run exactly as without it). On by the arch
table (`ArchTiles.pdl`: sm_90, where it was measured); HOMELAB_LLM_PDL=0 turns it off, =1 (early)
or =2 (late) on for any NVIDIA device of compute capability 9.0 or later (sm_120 is such a
device; RDNA and sm_80 have no such launch). The interpreter and CPU never take it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from homelab_llm.engine.kernels.tuning import arch_name, tiles_for

try:  # Triton 3.3+; older ones run without PDL (the names are only read when PDL is on)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:
    HAVE_GDC = False

ENV = "HOMELAB_LLM_PDL"
# kernel families launched plainly, comma-separated (overrides ArchTiles.pdl_plain): "h2" (the
# 1-2 row W4A16 GEMV on outputs of at most tuning.THIN_N columns), "h2_wide" (wider ones), "dot"
# (W4A16 at 3-64 rows), "dense" (the bf16 GEMV), "moe" (the bf16 and MXFP4 expert GEMVs of a
# decode step), "moe_w4" (the 4-bit ones), "router" (the MoE router), "rest" (the others),
# "h2_experts_layer" (the 1-2 row W4A16 GEMVs of an experts layer's attention: in_experts_layer),
# "mma" (the 2-8 row mma.sync kernel, w4a16_mma.py)
PLAIN_ENV = "HOMELAB_LLM_PDL_PLAIN"
FAMILIES = ("h2", "h2_wide", "dot", "dense", "moe", "moe_w4", "router", "rest", "h2_experts_layer", "mma")
OFF, EARLY, LATE = 0, 1, 2  # the modes: where a program lets the next grid launch


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous grid, then (mode EARLY) let the next one launch: the first
    statement of a PDL kernel that has nothing to read ahead of its inputs."""
    pdl_wait(PDL)
    pdl_start(PDL == 1)  # EARLY


@triton.jit
def pdl_late(PDL: tl.constexpr):
    """Mode LATE: let the next grid launch from here (a GEMV: after its K loop, before the
    split-K epilogue); kernels without this call trigger it by exiting."""
    pdl_start(PDL == 2)  # LATE


# tuning table keys of NVIDIA devices of compute capability 9.0 and later (Hopper, Blackwell)
PDL_ARCHS = ("sm90", "sm120")


def pdl_mode(device: torch.device) -> int:
    """The PDL mode of kernels launched on `device` (the env switch read on every call)."""
    forced = os.environ.get(ENV, "")
    if forced not in ("", "0", "1", "2"):
        raise ValueError(f"{ENV}={forced!r}: expected 0 (off), 1 (early) or 2 (late)")
    arch = arch_name(device)  # "interpret" on the CPU and in the interpreter, "gfx1100" on HIP
    if forced == "0" or not HAVE_GDC or arch not in PDL_ARCHS:
        return OFF
    return int(forced) if forced else tiles_for(device).pdl


_scope = threading.local()  # experts_layer: in_experts_layer calls open in this thread


def in_experts_layer(fn: Callable[..., object], *args: object) -> object:
    """fn(*args), the attention of a layer whose MLP is an experts block, with the 1-2 row W4A16
    GEMVs it launches (qkv, o_proj) in family "h2_experts_layer", which sm_90 launches early:
    Qwen3-30B-A3B W4A16 batch 1 445.5 -> 461.8 tok/s, where a dense model's 1-2 row GEMVs lose
    launched early (Llama-3.1-8B 478 -> 460-469; docs/BENCHMARKS.md 35.2)."""
    _scope.experts_layer = getattr(_scope, "experts_layer", 0) + 1
    try:
        return fn(*args)
    finally:
        _scope.experts_layer -= 1


def pdl_args(device: torch.device, family: str = "rest") -> dict:
    """Keyword arguments for a PDL kernel's launch: its PDL constexpr (the mode) and Triton's
    launch_pdl option, or nothing where PDL is off. A family launched plainly (ArchTiles.pdl_plain)
    keeps the constexpr, so it still lets the next grid launch early, but starts only once the
    previous grid has completed (its wait then returns at once)."""
    mode = pdl_mode(device)
    if mode == OFF:
        return {}
    if getattr(_scope, "experts_layer", 0) and family in ("h2", "h2_wide"):
        family = "h2_experts_layer"
    env = os.environ.get(PLAIN_ENV)
    plain = tiles_for(device).pdl_plain if env is None else tuple(f for f in env.split(",") if f)
    if any(f not in FAMILIES for f in plain):
        raise ValueError(f"{PLAIN_ENV}={env!r}: families are {', '.join(FAMILIES)}")
    return {"PDL": mode, "launch_pdl": family not in plain}
