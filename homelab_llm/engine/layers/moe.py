"""The mixture-of-experts MLP: a softmax top-k router, E expert MLPs with stacked weights, and an
optional shared expert behind a sigmoid gate (Qwen3.5-MoE, Qwen3-Next).

Expert weights live in two parameters, as transformers 5 holds them:
  experts.w13 [E, 2 * I_local, H]  gate rows then up rows of this rank's intermediate shard
  experts.w2  [E, H, I_local]
Tensor parallelism splits every expert's intermediate dimension evenly (no expert parallelism):
each rank computes a partial down projection and one all-reduce sums them. A checkpoint stores
the experts one tensor each (`experts.3.gate_proj.weight`) or fused (`experts.gate_up_proj`,
`experts.down_proj`); ExpertPart says which piece a tensor is, and the loader takes either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from homelab_llm.engine.kernels import dispatch
from homelab_llm.engine.kernels.moe_ref import MoeW4
from homelab_llm.engine.kernels.w4a16_pack import W4Weight, integer_zero_points
from homelab_llm.engine.layers.linear import ReplicatedLinear, weights_deferred
from homelab_llm.engine.parallel import state as parallel
from homelab_llm.engine.sharding import even_shard


@dataclass(frozen=True)
class ExpertPart:
    """A checkpoint piece of the stacked expert weights: proj "gate", "up" or "down" of one
    expert, or "gate_up" / "down" of all experts at once (expert None, transformers 5 fused)."""

    proj: str
    expert: int | None = None

    def __str__(self) -> str:
        return f"{self.proj}_proj of expert {self.expert}" if self.expert is not None else self.proj

    def covers(self, num_experts: int) -> list["ExpertPart"]:
        """The per-expert parts that loading this piece fills (itself unless fused)."""
        if self.expert is not None:
            return [self]
        projs = ("gate", "up") if self.proj == "gate_up" else (self.proj,)
        return [ExpertPart(p, e) for e in range(num_experts) for p in projs]


# checkpoint leaf under mlp.experts -> (our stacked parameter, its projection)
_EXPERT_PROJ = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down"),
                "gate_up_proj": ("w13", "gate_up")}


def expert_target(name: str) -> tuple[str, ExpertPart] | None:
    """`...mlp.experts.3.gate_proj.weight` / `...mlp.experts.gate_up_proj` -> (param, part);
    None for a tensor that is not an expert weight."""
    parts = name.split(".")
    if "experts" not in parts:
        return None
    at = parts.index("experts")
    rest = parts[at + 1:]
    if len(rest) == 3 and rest[0].isdigit() and rest[2] == "weight" and rest[1] in _EXPERT_PROJ:
        param, proj = _EXPERT_PROJ[rest[1]]
        return ".".join(parts[:at + 1] + [param]), ExpertPart(proj, int(rest[0]))
    if len(rest) == 1 and rest[0] in ("gate_up_proj", "down_proj"):
        param, proj = _EXPERT_PROJ[rest[0]]
        return ".".join(parts[:at + 1] + [param]), ExpertPart(proj)
    return None


class Router(ReplicatedLinear):
    """hidden -> one logit per expert; a checkpoint of the wrong shape is named precisely."""

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.out_features, self.in_features):
            raise ValueError(f"router weight is {tuple(loaded.shape)}, expected "
                             f"({self.out_features}, {self.in_features}) = (num_experts, "
                             f"hidden_size) from config.json")
        super().weight_loader(param, loaded, shard_id)


class FusedExperts(nn.Module):
    """E gated-SiLU expert MLPs; forward takes the router's picks and returns the weighted sum
    (this rank's partial sum under TP: the caller all-reduces)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dense: bool = True):
        """dense=False: the subclass holds the experts in its own packed format (no w13/w2)."""
        super().__init__()
        self.tp_rank, self.tp_size = parallel.tp_rank(), parallel.tp_size()
        self.inter_start, inter = even_shard(intermediate_size, self.tp_size, self.tp_rank,
                                             "moe_intermediate_size")
        self.num_experts, self.hidden_size, self.intermediate_local = num_experts, hidden_size, inter
        self.w4: MoeW4 | None = None
        if not dense:
            self.w13 = self.w2 = None
            return
        # Deferred (W4A16 loads): meta placeholders, so no dense copy of 4-bit experts exists.
        device = "meta" if weights_deferred() else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, device=device),
                               requires_grad=False)
        self.w13.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def part_ids(self, param_name: str) -> list[ExpertPart]:
        projs = ("gate", "up") if param_name == "w13" else ("down",)
        return [ExpertPart(p, e) for e in range(self.num_experts) for p in projs]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: ExpertPart) -> None:
        """Copy this rank's intermediate slice of one expert's (or all experts') tensor."""
        inter, start = self.intermediate_local, self.inter_start
        full = inter * self.tp_size
        if part.expert is None:  # fused: [E, 2I, H] or [E, H, I]
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"fused expert tensor is {tuple(loaded.shape)}, expected "
                                 f"{self.num_experts} experts on its first dimension")
            for e in range(self.num_experts):
                if part.proj == "gate_up":
                    self.weight_loader(param, loaded[e, :full], ExpertPart("gate", e))
                    self.weight_loader(param, loaded[e, full:], ExpertPart("up", e))
                else:
                    self.weight_loader(param, loaded[e], ExpertPart("down", e))
            return
        if part.proj == "down":
            src, dest = loaded[:, start:start + inter], param.data[part.expert]
            expected = (self.hidden_size, full)
        else:
            offset = 0 if part.proj == "gate" else inter
            src, dest = loaded[start:start + inter], param.data[part.expert, offset:offset + inter]
            expected = (full, self.hidden_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{part}: shape {tuple(loaded.shape)}, expected {expected}")
        dest.copy_(src)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Give deferred (meta) expert weights real storage, to be filled by weight_loader."""
        for name in ("w13", "w2"):
            param = getattr(self, name)
            if param is not None and param.is_meta:
                fresh = nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype),
                                     requires_grad=False)
                fresh.weight_loader = self.weight_loader  # type: ignore[attr-defined]
                setattr(self, name, fresh)

    def set_w4(self, w4: MoeW4) -> None:
        """4-bit experts from now on (stacked W4Weight layouts); the dense parameters go."""
        self.w13 = None  # type: ignore[assignment]
        self.w2 = None  # type: ignore[assignment]
        for which in ("w13", "w2"):
            w = getattr(w4, which)
            w.int_zeros = w.int_zeros or integer_zero_points(w)  # stacking and fusing lose it
            for name in ("qweight", "scales", "biases"):
                self.register_buffer(f"{which}_{name}", getattr(w, name), persistent=False)
        self.w4 = w4

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() move the registered buffers: point the MoeW4 at the moved ones.
        module = super()._apply(fn, recurse)
        if self.w4 is not None:
            self.w4 = MoeW4(*(W4Weight(getattr(self, f"{w}_qweight"), getattr(self, f"{w}_scales"),
                                       getattr(self, f"{w}_biases"), getattr(self.w4, w).group_size,
                                       int_zeros=getattr(self.w4, w).int_zeros)
                              for w in ("w13", "w2")))
        return module

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """shared: (a shared expert's output, its gate [T]) added in (dispatch.fused_moe)."""
        if self.w4 is not None:
            return dispatch.fused_moe(x, self.w4, None, topk_weights, topk_ids, shared=shared)
        return dispatch.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, shared=shared)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ sigmoid-gated shared expert): the MLP of a sparse layer."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert: nn.Module | None = None):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False)
                                   if shared_expert is not None else None)

    def fold_shared(self) -> bool:
        """The shared expert's gate rides in the router's launch and its gated output in the
        experts' combine: one rank (under TP its down projection all-reduces on its own) and
        plain bf16 gates."""
        gate = self.shared_expert_gate
        return (gate is not None and self.experts.tp_size == 1 and gate.w4 is None
                and gate.bias is None and self.gate.w4 is None and self.gate.bias is None)

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                   norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self(norm(x + residual)), x + residual) with the norm inside the router's launch
        (dispatch.router_norm_route: a GPU at decode sizes, a plain bf16 router), else None:
        the caller runs the norm and then this block."""
        if self.gate.w4 is not None or self.gate.bias is not None \
                or not dispatch.router_norm_route(x):
            return None
        if self.shared_expert is None and self.experts.w4 is not None:
            # norm, router and 4-bit experts in one launch where the table takes them
            got = dispatch.moe_block_queue(x, residual, norm.weight, norm.eps, self.gate.weight,
                                           self.top_k, self.renormalize, self.experts.w4)
            if got is not None:
                return self._reduced(got[0]), got[1]
        fold = self.fold_shared()
        weights, ids, shared_w, normed, summed = dispatch.route_gate_topk_norm(
            x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
            self.shared_expert_gate.weight if fold else None)
        return self.mix(normed, weights, ids, shared_w), summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate.w4 is not None or self.gate.bias is not None:
            weights, ids = dispatch.route_topk(self.gate(x), self.top_k, self.renormalize)
            return self.mix(x, weights, ids, None)
        # logits and routing (and the shared expert's gate) in one launch
        fold = self.fold_shared()
        weights, ids, shared_w = dispatch.route_gate_topk(
            x, self.gate.weight, self.top_k, self.renormalize,
            self.shared_expert_gate.weight if fold else None)
        return self.mix(x, weights, ids, shared_w)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            shared_w: torch.Tensor | None) -> torch.Tensor:
        """The picked experts' weighted sum over x (and the shared expert's gated output).
        shared_w: the shared expert's gate weight from the router's launch (fold_shared), which
        the experts' combine adds in; None: the shared expert, if any, is added here."""
        if shared_w is not None:
            return self.experts(x, weights, ids, shared=(self.shared_expert(x), shared_w))
        out = self._reduced(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            # The shared expert's down projection all-reduces itself; the gate is replicated.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over its expert shards, summed over the TP ranks."""
        return parallel.all_reduce(out) if self.experts.tp_size > 1 else out
