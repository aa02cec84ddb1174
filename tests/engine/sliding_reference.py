"""Tiny random sliding-window checkpoints (transformers 5.x) for the sliding-window tests: Gemma 3
text, Mistral with a window, Qwen2 with use_sliding_window; and a paged harness that frees (and
poisons) every page wholly outside the window the way the engine may."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model_reference import TINY, PagedHarness, hf_config, hf_logits

WINDOW = 8
SLIDING_KINDS = ("gemma3", "mistral", "qwen2")


def sliding_hf_config(kind: str, **overrides: Any):
    import transformers

    if kind == "gemma3":
        kw = dict(TINY, head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24,
                  sliding_window=WINDOW, final_logit_softcapping=30.0, tie_word_embeddings=True,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention"],
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                      "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        kw.update(overrides)
        return transformers.Gemma3TextConfig(**kw)
    if kind == "gpt_oss":
        kw = dict(TINY, head_dim=16, num_hidden_layers=4, sliding_window=WINDOW, num_local_experts=4,
                  num_experts_per_tok=2, intermediate_size=64, max_position_embeddings=128,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 32})
        kw.update(overrides)
        return transformers.GptOssConfig(**kw)
    if kind == "mistral":
        return hf_config("mistral", sliding_window=WINDOW, **overrides)
    if kind == "qwen2":
        # layers 0 keeps full attention (max_window_layers), 1 and 2 slide
        return hf_config("qwen2", use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1, **overrides)
    raise ValueError(kind)


def make_sliding_model(kind: str, folder: Path, seed: int = 0, **overrides: Any):
    """A random fp32 transformers model of `kind`, saved (safetensors) into folder; returned.
    Gemma's norm weights start at 0 (the norm scales by 1 + w): perturbed so a missing +1 shows."""
    import transformers

    torch.manual_seed(seed)
    cfg = sliding_hf_config(kind, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if kind in ("gemma3", "gpt_oss"):
        # Gemma's norms start at 0, gpt-oss's sinks and biases too: perturbed so the test sees them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("sinks"):
                    p.uniform_(-0.5, 0.5)
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return model


class WindowedHarness(PagedHarness):
    """PagedHarness that, after each step, frees every page wholly below the oldest key any
    sliding layer can still see (only valid when every KV layer slides) and fills it with NaN,
    so a read of a freed page shows in the logits. Page-table entries stay: the kernels must not
    read them."""

    def __init__(self, model, window: int, **kw: Any):
        super().__init__(model, **kw)
        self.window = window
        self.freed: dict[str, int] = {}

    def step(self, batch: dict[str, list[int]]) -> torch.Tensor:
        logits = super().step(batch)
        for seq in batch:
            # the next query sits at lengths[seq]; it sees keys > lengths - window
            oldest = max(0, self.lengths[seq] - self.window + 1)
            pages = self.pages[seq]
            for p in range(self.freed.get(seq, 0), oldest // self.page_size):
                for attn in self.model.attention_layers:
                    attn.k_cache[pages[p]] = float("nan")
                    attn.v_cache[pages[p]] = float("nan")
                self.free_pages.append(pages[p])
            self.freed[seq] = max(self.freed.get(seq, 0), oldest // self.page_size)
        return logits

    def held_pages(self, seq: str) -> int:
        return len(self.pages[seq]) - self.freed.get(seq, 0)


def check_long_prompt_and_decode(hf, ours, prompt: list[int], decode: list[int], atol: float) -> None:
    """Prefill in two chunks (the second starts mid-page) then decode one token per step, far past
    the window: logits within atol of transformers' and the same greedy tokens."""
    ref = hf_logits(hf, prompt + decode)
    harness = PagedHarness(ours, page_size=4)
    got = [harness.step({"s": prompt[:13]}), harness.step({"s": prompt[13:]})]
    got += [harness.step({"s": [t]}) for t in decode]
    got_all = torch.cat(got)
    torch.testing.assert_close(got_all, ref, atol=atol, rtol=0)
    assert torch.equal(got_all.argmax(-1), ref.argmax(-1))
