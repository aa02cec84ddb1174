"""The chunked prefill rule (kernels/gdn_chunk.py) against gdn_ref.gated_delta_rule_prefill_ref.

Bounds, as rel_err (max abs error over max(1, max |want|)): fp32 inputs 1e-4 in the interpreter
(fp32 dots; only summation order differs) and 1e-2 on a GPU (fp32 tl.dot runs as tf32 there, 10
mantissa bits, through the triangular solve too). bf16 inputs (w, u, P and the state reads are
bf16-rounded, as in fla) as scaled_err (over max |want| itself: the outputs stay well below 1, so
rel_err would be an absolute bound): output 2e-2 and state 5e-3 in the interpreter, where the
kernels reach 9.0e-3 / 2.2e-3 and decays 10% weak give 3.6e-2 / 1.5e-2 (2e-2 as rel_err let
those through: BENCHMARKS 63.4); 5e-2 / 2e-2 on a GPU. Both second halves are checked with the
same bounds: the fused sequential kernel (split=False) and the state walk + parallel output
kernel (split=True, gdn_chunk_split.py), which round the same operands. Small shapes here; the
`gpu` test runs Qwen3.6-27B's shape on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from homelab_llm.engine.kernels import gdn_ref
from tests.engine.kernels.gdn_inputs import FULL_RULE, rel_err, rule_inputs, scaled_err


def _bound(device: torch.device) -> float:
    """rel_err's bound for fp32 inputs (the module's docstring)."""
    return 1e-2 if device.type == "cuda" else 1e-4


def _bf16_bounds(device: torch.device) -> tuple[float, float]:
    """(output, state) bounds on scaled_err for bf16 inputs (the module's docstring)."""
    return (5e-2, 2e-2) if device.type == "cuda" else (2e-2, 5e-3)


def _check(lens, dims, gen, device, dtype=torch.float32, chunk=None, split=None, solve_rows=None, **kw) -> None:
    from homelab_llm.engine.kernels.gdn_chunk import chunk_gated_delta_rule

    q, k, v, g, beta, cu, state, slots, init = rule_inputs(lens, **dims, gen=gen, dtype=dtype, device=device, **kw)
    want_state = state.clone()
    want = gdn_ref.gated_delta_rule_prefill_ref(q, k, v, g, beta, cu, want_state, slots, init)
    got = chunk_gated_delta_rule(q, k, v, g, beta, cu, state, slots, init, chunk=chunk, split=split,
                                 solve_rows=solve_rows)
    if dtype == torch.float32:
        bound = _bound(device)
        assert rel_err(got, want) <= bound, (lens, rel_err(got, want))
        assert rel_err(state, want_state) <= bound, (lens, rel_err(state, want_state))
    else:
        out_bound, state_bound = _bf16_bounds(device)
        assert scaled_err(got, want) <= out_bound, (lens, scaled_err(got, want))
        assert scaled_err(state, want_state) <= state_bound, (lens, scaled_err(state, want_state))


@pytest.mark.parametrize("lens,dims,kw", [
    ([1, 37, 20], dict(hk=2, hv=6, dk=16, dv=32), {}),                        # GQA 3, crosses chunks
    ([33, 5], dict(hk=2, hv=2, dk=32, dv=16), dict(weak_decay=True)),        # no GQA, long memory
    ([19, 3, 0, 12], dict(hk=1, hv=2, dk=24, dv=40), dict(slots=[0, -1, 3, 2])),  # padded dims, padding row, empty
])
@pytest.mark.parametrize("split", [False, True])
def test_chunk_matches_reference(lens, dims, kw, split, device: torch.device) -> None:
    _check(lens, dims, torch.Generator().manual_seed(0), device, split=split, **kw)


@pytest.mark.parametrize("split,solve_rows", [(False, 16), (True, 16), (True, 64)])
def test_chunk_bf16_and_chunk_64(split, solve_rows, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    _check([70, 9], dict(hk=1, hv=2, dk=16, dv=16), gen, device, dtype=torch.bfloat16, chunk=64, split=split,
           solve_rows=solve_rows)


@pytest.mark.parametrize("split", [False, True])
def test_chunk_no_tokens_sets_live_states(split, device: torch.device) -> None:
    """Only empty sequences: no output rows, a live slot keeps its initial state (has_init) or is
    zeroed, a padding slot is untouched; exact."""
    from homelab_llm.engine.kernels.gdn_chunk import chunk_gated_delta_rule

    q, k, v, g, beta, cu, state, slots, init = rule_inputs([0, 0, 0], 1, 2, 16, 16, torch.Generator().manual_seed(5),
                                                           slots=[2, 0, -1], device=device)
    want = state.clone()
    want[0] = 0  # sequence 1 (slot 0) has no initial state
    got = chunk_gated_delta_rule(q, k, v, g, beta, cu, state, slots, init, split=split)
    assert got.shape == (0, 2, 16) and torch.equal(state, want)


@pytest.mark.parametrize("solve_rows", [16, 32, 64])
def test_chunk_64_correlated_keys(solve_rows, device: torch.device) -> None:
    """Keys sharing one direction, beta 1, slow decay: the triangular solve's hard case (its inverse
    has large entries); the blocked solve (diagonal blocks of 16 or 32 rows, folded by dots) and
    plain forward substitution (64: RDNA3's) must stay at fp32 accuracy."""
    from homelab_llm.engine.kernels.gdn_chunk import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta, cu, state, slots, init = rule_inputs([150, 70], 1, 2, 16, 16, gen, device=device)
    k = k[:1] * 3 + 0.3 * k
    beta, g = torch.ones_like(beta), g * 0.01
    want_state = state.clone()
    want = gdn_ref.gated_delta_rule_prefill_ref(q, k, v, g, beta, cu, want_state, slots, init)
    got = chunk_gated_delta_rule(q, k, v, g, beta, cu, state, slots, init, chunk=64, solve_rows=solve_rows)
    bound = _bound(device)
    assert rel_err(got, want) <= bound and rel_err(state, want_state) <= bound


def test_split_prefill_equals_one_shot(device: torch.device) -> None:
    """Chunked prefill: the state after part one is the initial state of part two."""
    from homelab_llm.engine.kernels.gdn_chunk import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, cu, state, slots, _ = rule_inputs([40], 1, 2, 16, 16, gen, slots=[1], device=device)
    init = torch.tensor([False], device=device)
    s_one = state.clone()
    whole = chunk_gated_delta_rule(q, k, v, g, beta, cu, s_one, slots, init)
    s_two = state.clone()
    parts = []
    for (a, b), has in (((0, 23), False), ((23, 40), True)):
        cu_part = torch.tensor([0, b - a], dtype=torch.int32, device=device)
        parts.append(chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], cu_part, s_two, slots,
                                            torch.tensor([has], device=device)))
    bound = _bound(device)  # other chunk boundaries, so other rounding
    assert rel_err(torch.cat(parts), whole) <= bound
    assert rel_err(s_two, s_one) <= bound
    assert torch.equal(s_two[0], state[0]) and torch.equal(s_two[2:], state[2:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device")
@pytest.mark.parametrize("lens", [[8192], [2048] * 4, [1, 63, 64, 65, 1000, 3000, 17]])
@pytest.mark.parametrize("split,solve_rows", [(False, None), (True, None), (True, 64)])
def test_chunk_full_shape(lens, split, solve_rows) -> None:
    _check(lens, FULL_RULE, torch.Generator().manual_seed(3), torch.device("cuda"), dtype=torch.bfloat16,
           split=split, solve_rows=solve_rows)
