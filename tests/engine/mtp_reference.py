"""Tiny Qwen3.5 hybrids with an MTP head (`mtp.*` tensors added to the safetensors file, which
transformers ignores), and a plain-torch reference of the head's drafts built from transformers'
own pieces (the target's final hidden states, its embedding, a full-attention decoder layer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybrid_reference import GDN_GAIN, make_hf_qwen3_5

FULL_LAYER = 1  # TEXT_SHAPE's first full-attention layer: the MTP layer's shape donor


def _mtp_layer_names(state: dict[str, torch.Tensor], donor: int) -> dict[str, str]:
    """mtp.layers.0.<part> -> model.layers.<donor>.<part> (same structure)."""
    prefix = f"model.layers.{donor}."
    return {"mtp.layers.0." + k[len(prefix):]: k for k in state if k.startswith(prefix)}


@torch.no_grad()
def add_mtp_weights(folder: Path, seed: int, echo: bool = False,
                    donor: int = FULL_LAYER) -> dict[str, torch.Tensor]:
    """Add `mtp.*` to folder's checkpoint and mtp_num_hidden_layers = 1 to its config; returns
    the mtp tensors. Random (std 0.2 around a copy of full-attention layer `donor`) unless `echo`: then
    the head ignores the token, its layer adds nothing (o_proj, down_proj zero) and its norms are
    plain, so h' = h / rms(h) and every draft repeats the token the target model just chose."""
    gen = torch.Generator().manual_seed(seed)
    state = load_file(folder / "model.safetensors")
    h = state["model.embed_tokens.weight"].shape[1]
    mtp = {name: state[src].clone() + 0.2 * torch.randn(state[src].shape, generator=gen)
           for name, src in _mtp_layer_names(state, donor).items()}
    mtp["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.2 * torch.randn(h, generator=gen)
    if echo:
        mtp["mtp.fc.weight"] = torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1)
        for name in mtp:
            if name.endswith(("o_proj.weight", "down_proj.weight", "norm.weight")) and ".layers." in name \
                    or name.startswith(("mtp.pre_fc_norm", "mtp.norm")):
                mtp[name].zero_()
    save_file({**state, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return mtp


def make_mtp_checkpoint(folder: Path, seed: int = 0, echo: bool = False):
    """A tiny Qwen3.5 hybrid with an MTP head: (transformers' model, the mtp tensors). An echo
    head drafts the last token again, so it is accepted where the model repeats tokens: that
    model keeps the default init's weak GDN branch (hybrid_reference.GDN_GAIN), under which a
    tiny model repeats itself."""
    model = make_hf_qwen3_5(folder, seed=seed, gdn_gain=1.0 if echo else GDN_GAIN)
    return model, add_mtp_weights(folder, seed + 1, echo)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def reference_drafts(model, mtp: dict[str, torch.Tensor], tokens: list[int], k: int) -> list[int]:
    return reference_head(model, mtp, tokens, k)[0]


@torch.no_grad()
def reference_head(model, mtp: dict[str, torch.Tensor], tokens: list[int], k: int
                   ) -> tuple[list[int], list[torch.Tensor]]:
    """The head's K drafts after `tokens` (prompt + the token sampled last) and the head's
    output h' each came from, by the formula over the whole sequence at once:
    x_p = fc(cat(norm_e(embed(t_{p+1})), norm_h(h_p))) for p < L-1, then one more row per
    chained draft, each layer run causally over all rows."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    layer = Qwen3_5DecoderLayer(model.config, FULL_LAYER).float().eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({n[len(prefix):]: t for n, t in mtp.items() if n.startswith(prefix)})
    embed = model.model.embed_tokens
    ids = torch.tensor([tokens])
    hidden = model.model(ids[:, :-1]).last_hidden_state[0]  # target h_p, post final norm

    def row(token: int, h: torch.Tensor) -> torch.Tensor:
        e = _norm(embed(torch.tensor([token]))[0], mtp["mtp.pre_fc_norm_embedding.weight"])
        return mtp["mtp.fc.weight"] @ torch.cat((e, _norm(h, mtp["mtp.pre_fc_norm_hidden.weight"])))

    rows = [row(t, hp) for t, hp in zip(tokens[1:], hidden)]
    drafts: list[int] = []
    states: list[torch.Tensor] = []
    for _ in range(k):
        x = torch.stack(rows)[None]
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, model.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        h_last = _norm(out[0, -1], mtp["mtp.norm.weight"])
        states.append(h_last)
        drafts.append(int(model.lm_head(h_last).argmax()))
        rows.append(row(drafts[-1], h_last))
    return drafts, states
