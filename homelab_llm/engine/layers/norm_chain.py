"""A pre-norm decoder's RMSNorms and its SiLU-and-mul inside the few-row W4A16 linears around
them (kernels/w4a16_epilogue.py): at batch 3-64 on the left-operand kernel a decode step then
launches no norm or act-and-mul between the first layer's input norm and the final norm.

The linear before a norm (o_proj, a Gated DeltaNet's out_proj, down_proj: row-parallel at TP
1, no bias) adds the residual and leaves the norm's input as a `Prenormed`: s * norm_weight in
the next linear's pair order, each row's 1 / rms, and s, the residual after it. The linear
after the norm (qkv_proj, in_proj_qkvz, gate_up) takes it with the scale applied to its dot;
a gate | up projection also stores act(gate) * up in the down projection's pair order. The
layers pass a Prenormed where they passed the hidden rows (llama.attention_after_norm /
mlp_after_norm take either). Where the norm keeps its launch (tensor parallelism: it follows
an all-reduce) a gated MLP still takes its act-and-mul in gate_up's epilogue
(act_epilogue_mlp).

`chain_pairs` says where it applies. It is off unless HOMELAB_LLM_NORM_CHAIN=1 (timed on an
H100: no gain at the 8B's batch 8, 11% lost at the 27B's; docs/BENCHMARKS.md 41); the code and
its tests stay for the A/B and for other GPUs' tables. HOMELAB_LLM_NORM_CHAIN=act keeps the
norms' launches and chains only the act-and-mul (act_epilogue_mlp at TP 1 too).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from homelab_llm.engine.layers.linear import LinearBase
from homelab_llm.engine.layers.norm import RMSNorm

# "1" turns the chain on, "act" only gate_up's act-and-mul epilogue. Off by default: on an H100
# (docs/BENCHMARKS.md 41) the chain bought nothing at the 8B's batch 8 (2,149.5 -> 2,147.6
# tok/s) and cost the 27B's 11% (695.5 -> 620.2); "act" alone gained nothing either (45.1).
CHAIN_ENV = "HOMELAB_LLM_NORM_CHAIN"


def chain_enabled() -> bool:
    return os.environ.get(CHAIN_ENV, "0") == "1"


def act_chain_enabled() -> bool:
    return os.environ.get(CHAIN_ENV, "0") in ("1", "act")


@dataclasses.dataclass(frozen=True)
class Prenormed:
    """A norm's output as the linear before it left it: y = s * norm_weight [M, H] in the next
    linear's pair order, rstd [M] fp32 each row's 1 / rms, summed = s [M, H] (the residual after
    the norm's add, k order)."""

    y: torch.Tensor
    rstd: torch.Tensor
    summed: torch.Tensor


def chain_pairs(rows: torch.Tensor, producer: LinearBase, consumer: LinearBase) -> int:
    """The consumer's pair block (its K step) where the producer's launch for these rows (any
    [M, *] tensor in the activations' dtype and device) can form the norm between them and the
    consumer take it: both W4A16 on the few-row kernel's pair-order tiles, the producer at TP 1
    with no bias (its output is whole and is the sum's left term); 0 where they keep the
    separate launches."""
    if not chain_enabled() or producer.w4 is None or consumer.w4 is None:
        return 0
    if producer.bias is not None or getattr(producer, "tp_size", 1) != 1:
        return 0
    m = rows.shape[0]
    if not producer.rows_pairs_block(m, rows):
        return 0
    return consumer.rows_pairs_block(m, rows)


def rows_of(hidden: torch.Tensor | Prenormed) -> torch.Tensor:
    """The hidden rows' stand-in for route checks: the tensor, or a Prenormed's summed rows."""
    return hidden.summed if isinstance(hidden, Prenormed) else hidden


@dataclasses.dataclass
class NormAfter:
    """A row-parallel W4A16 linear (chain_pairs said yes) with the next norm in its epilogue: in
    the linear's place where a caller hands it rows (the attention's project), it returns the
    Prenormed of norm(x W + residual) for a consumer whose pair block is `pairs`."""

    linear: LinearBase
    residual: torch.Tensor
    norm: RMSNorm
    pairs: int

    def rows_pairs_block(self, m: int, like: torch.Tensor) -> int:
        return self.linear.rows_pairs_block(m, like)

    def rows_take_mma_pairs(self, m: int, like: torch.Tensor) -> bool:
        return False  # its epilogue kernel reads x in pair order

    def __call__(self, x: torch.Tensor, paired: bool = False) -> Prenormed:
        """x in the linear's pair order (paired), or in k order, reordered here (a mixed step's
        rows, whose kernels before the linear write k order)."""
        from homelab_llm.engine.kernels.pair_order import rows_in_pair_order
        from homelab_llm.engine.kernels.w4a16_chain import norm_out_dot

        if not paired:
            x = rows_in_pair_order(x, self.linear.rows_pairs_block(x.shape[0], x))
        return Prenormed(*norm_out_dot(x, self.linear.w4, self.residual, self.norm.weight, self.norm.eps,
                                       self.pairs))


def prenormed_linear(pre: Prenormed, linear: LinearBase) -> torch.Tensor:
    """linear(norm's output) from the Prenormed the linear before the norm left (+ bias)."""
    from homelab_llm.engine.kernels.w4a16_chain import paired_dot

    out = paired_dot(pre.y, linear.w4, pre.rstd)
    return out if linear.bias is None else out + linear.bias


def act_chain_pairs(rows: torch.Tensor, gate_up: LinearBase, down: LinearBase) -> int:
    """down's pair block where gate_up's launch for these rows can store act(gate) * up in it
    (both W4A16 on the few-row kernel's pair-order tiles, gate_up without bias, its column
    blocks pairing gate and up features); 0 where the act-and-mul keeps its own launch."""
    from homelab_llm.engine.kernels.w4a16_chain import act_pairs_fit

    if not act_chain_enabled() or gate_up.w4 is None or down.w4 is None or gate_up.bias is not None:
        return 0
    m = rows.shape[0]
    pairs = down.rows_pairs_block(m, rows)
    return pairs if pairs and act_pairs_fit(m, gate_up.w4, rows.device) else 0


def mlp_chain_pairs(rows: torch.Tensor, o_proj: LinearBase, gate_up: LinearBase, down: LinearBase) -> int:
    """gate_up's pair block where o_proj's launch for these rows can form the norm before a gated
    MLP and the MLP run chained (prenormed_mlp): gate_up's act-and-mul in its epilogue, in the
    pair order down reads (act_chain_pairs); 0 where the MLP keeps its separate launches."""
    pairs = chain_pairs(rows, o_proj, gate_up)
    return pairs if pairs and act_chain_pairs(rows, gate_up, down) else 0


def chained_mlp_norm(rows: torch.Tensor, producer: LinearBase, norm: RMSNorm,
                     mlp: torch.nn.Module) -> tuple[RMSNorm, int] | None:
    """(norm, gate_up's pair block) for the producer's epilogue (a NormAfter) where the gated MLP
    after `norm` (gate_up_proj, down_proj, gated_act: llama.LlamaMLP) runs chained for these rows
    (mlp_chain_pairs); None where it does not (experts, other routes)."""
    if getattr(mlp, "gated_act", None) is None:
        return None
    pairs = mlp_chain_pairs(rows, producer, mlp.gate_up_proj, mlp.down_proj)
    return (norm, pairs) if pairs else None


def chained_next_norm(rows: torch.Tensor, mlp: torch.nn.Module, mlp_chained: bool,
                      next_input: tuple[RMSNorm, LinearBase] | None) -> tuple[RMSNorm, int] | None:
    """(the next layer's input norm, its linear's pair block) for the down projection's epilogue
    where this layer's MLP runs chained and the next layer takes a Prenormed (next_input: its
    input norm and the linear after it, set by the model), else None."""
    if not mlp_chained or next_input is None:
        return None
    norm, linear = next_input
    pairs = chain_pairs(rows, mlp.down_proj, linear)
    return (norm, pairs) if pairs else None


def act_epilogue_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, gate_up: LinearBase,
                     down: LinearBase, act: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(down(act(gate) * up of gate_up(norm(x + residual))), x + residual) where the norm keeps its
    own launch (after a tensor-parallel all-reduce; Gemma's pre-feedforward norm) but the MLP can
    run chained: the norm writes gate_up's pair order, gate_up's epilogue the act-and-mul in
    down's (no act-and-mul launch; GELU-tanh in the kernel too). None where it cannot."""
    from homelab_llm.engine.kernels import dispatch, elementwise
    from homelab_llm.engine.kernels.w4a16_chain import paired_dot

    down_pairs = act_chain_pairs(x, gate_up, down)
    pairs = down_pairs and dispatch.w4a16_pairs_block(x, gate_up.w4)
    if not pairs:
        return None
    paired, summed, _ = elementwise.norm_rows(x, residual, norm.weight, norm.eps, pairs)
    h = paired_dot(paired, gate_up.w4, act=act, act_pairs=down_pairs)
    return down(h, paired=True), (x if summed is None else summed)


def prenormed_mlp(pre: Prenormed, gate_up: LinearBase, down: LinearBase, act: str,
                  then: NormAfter | None = None) -> torch.Tensor | Prenormed:
    """down(act(gate) * up of gate_up(norm's output)) from a Prenormed, where mlp_chain_pairs said
    yes: the act-and-mul in gate_up's epilogue, stored in down's pair order. then: down with the
    next norm in its epilogue (a NormAfter over down): a Prenormed."""
    from homelab_llm.engine.kernels.w4a16_chain import paired_dot

    pairs = down.rows_pairs_block(pre.y.shape[0], pre.y)
    h = paired_dot(pre.y, gate_up.w4, pre.rstd, act=act, act_pairs=pairs)
    return then(h, paired=True) if then is not None else down(h, paired=True)
