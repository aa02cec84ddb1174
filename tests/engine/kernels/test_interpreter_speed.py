"""interpreter_speed.install: kernels that call @triton.jit helpers give the same results, and
the helpers' calls inside a launch skip the interpreter's re-patching (it is the point)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.engine.kernels.conftest import HAS_CUDA
from tests.engine.kernels.interpreter_speed import SKIPPED, install

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")


@triton.jit
def _scaled(x, s):
    return x * s + tl.sum(x, axis=0)


@triton.jit
def _twice(x, s):
    return _scaled(x, s) + _scaled(x, 2.0 * s)  # a helper calling a helper


@triton.jit
def _helper_kernel(x_ptr, out_ptr, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _twice(x, s).to(out_ptr.dtype.element_ty))


def test_installed_and_helpers_skip_the_repatch() -> None:
    assert install(), "this Triton's interpreter changed: interpreter_speed no longer applies"
    gen = torch.Generator().manual_seed(3)
    programs, block = 5, 16
    x = torch.randn(programs * block, generator=gen)
    out = torch.empty_like(x)
    before, builtins = SKIPPED[0], (tl.load, tl.store, tl.core.tensor.__add__)
    _helper_kernel[(programs,)](x, out, 0.5, BLOCK=block)
    tiles = x.view(programs, block)
    sums = tiles.sum(dim=1, keepdim=True)
    want = (tiles * 0.5 + sums) + (tiles * 1.0 + sums)
    torch.testing.assert_close(out.view(programs, block), want, rtol=1e-6, atol=1e-5)
    assert SKIPPED[0] - before == programs * 3  # _twice and its two _scaled calls, each program
    # and the language is Triton's own again after the launch
    assert (tl.load, tl.store, tl.core.tensor.__add__) == builtins and tl.core.is_builtin(tl.load)
