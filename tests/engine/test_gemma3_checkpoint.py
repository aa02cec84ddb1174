"""Gemma 3 as published (Gemma3ForConditionalGeneration, legacy `language_model.model.*` names):
our model is its language model, the vision tower skipped; text-only logits match transformers'
(fp32, 1e-3 absolute on logits of O(10))."""

from __future__ import annotations

import torch

from model_reference import PagedHarness, hf_logits, load_ours

ATOL = 1e-3
PROMPT = [(7 * i + 3) % 200 for i in range(20)]


def test_gemma3_conditional_generation_checkpoint(tmp_path):
    """The published Gemma 3 checkpoints are Gemma3ForConditionalGeneration: our model is its
    language model (the vision tower is skipped); text-only logits match transformers'."""
    import transformers

    from sliding_reference import sliding_hf_config

    torch.manual_seed(0)
    # transformers' multimodal wrapper never applies final_logit_softcapping (its CausalLM does);
    # the published configs leave it unset, so the comparison does too
    text = sliding_hf_config("gemma3", final_logit_softcapping=None)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    mm_tokens_per_image=4, image_token_index=199, boi_token_index=197,
                                    eoi_token_index=198)
    cfg._attn_implementation = "eager"
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, ours = load_ours(tmp_path)
    assert config.architecture == "gemma3" and config.sliding_layers == (0, 1, 3)
    prompt = PROMPT
    want = hf_logits(hf, prompt)
    got = PagedHarness(ours, page_size=4).step({"s": prompt})
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
