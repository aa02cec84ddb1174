"""Multi-token prediction (MTP) head of Qwen3.5/3.6 and Qwen3-Next checkpoints (`mtp.*`): one or
more extra decoder layers that guess the token after next from the target model's final hidden
state (after its final norm) and the next token.

At position p, with h_p the target's hidden state and t_{p+1} the token that follows:

    x  = fc(cat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)))   # 2H -> H
    h' = norm(layer(x))                                                             # the MTP hidden
    logits = lm_head(h')                                                            # guesses t_{p+2}

A chain of K drafts feeds h' and the drafted token back in at position p+1, and so on; draft step
k uses layer k % num_layers (vLLM's rule). The embedding and lm_head are the target model's: they
are passed to `forward`, never owned, so their weights load and count once.

Each MTP layer attends like any full-attention layer over its own paged KV (the owning model lists
its attention module with the others, so the runner binds it one more KV layer on the same page
tables). Its entry at position p depends on t_{p+1} as well as on the prefix: spec/mtp_draft.py
writes it only once t_{p+1} is known, and rewrites it when a step recomputes position p.

A family offers MTP (qwen3_5.py does; qwen3_5_moe.py and qwen3_next.py inherit it) by building
`self.mtp = MultiTokenPredictor(...)` when config.mtp_layers > 0 (else None), appending its
layers' attention modules to `attention_layers`, mapping checkpoint names `mtp.*` to it in
`checkpoint_name`, and naming its architecture in spec/mtp.py MTP_ARCHITECTURES. The drafter
(spec/mtp_draft.py) then reads `model.mtp`, `model.model.embed_tokens` and `compute_logits`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from homelab_llm.engine.layers.linear import ReplicatedLinear
from homelab_llm.engine.model.config import ModelConfig


class MultiTokenPredictor(nn.Module):
    """`mtp.*` of a checkpoint. make_layer(i) builds MTP decoder layer i (a full-attention layer
    of the family, forward(hidden, residual, rope) -> (hidden, residual)); make_norm builds
    the family's RMSNorm; rotary is the target's (anything with lookup(positions, dtype))."""

    def __init__(self, config: ModelConfig, make_layer: Callable[[int], nn.Module],
                 make_norm: Callable[[], nn.Module], rotary: nn.Module):
        super().__init__()
        h = config.hidden_size
        self.fc = ReplicatedLinear(2 * h, h, bias=False)  # every rank needs all of x
        self.pre_fc_norm_embedding = make_norm()
        self.pre_fc_norm_hidden = make_norm()
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.mtp_layers))
        self.norm = make_norm()
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                embed: nn.Module, step: int = 0) -> torch.Tensor:
        """input_ids (t_{p+1}), positions (p) [T]; hidden (h_p) [T, H] -> h' [T, H]. Reads the
        forward context (the MTP layer's KV slots and page tables)."""
        x = torch.cat((self.pre_fc_norm_embedding(embed(input_ids)),
                       self.pre_fc_norm_hidden(hidden)), dim=-1)
        x = self.fc(x)
        rope = self.rotary.lookup(positions, x.dtype)
        out, residual = self.layers[step % len(self.layers)](x, None, rope)
        out, _ = self.norm(out, residual)
        return out
