"""Speculative decoding on the real SmolLM2 (n-gram drafts): greedy output equals the run without
speculation, token for token, on a copy-heavy chat and a normal one, single and batched, with the
prefix cache on, and for grammar-constrained requests (json_schema, regex: drafts checked against
the grammar, verify rows masked per position); drafts are accepted (the copy is real), and TP=2
over gloo equals TP=1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_llm.engine.llm import LLM
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.structured.grammar import GrammarSpec, to_grammar
from tests.engine.model_reference import make_hf_model
from tests.engine.test_tensor_parallel import SHAPE, byte_tokenizer

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})
NGRAM_ANY = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 1})  # random weights rarely repeat a 2-gram
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
TEXT = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"


def _chat(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_smollm2_greedy_equals_no_speculation(smollm2_path: Path, dtype: str) -> None:
    """The exact path and the CPU default (4-bit weights, int8 activation blocks where our kernels
    run: a verify row's numbers must not depend on the rows beside it)."""
    kw = dict(device="cpu", dtype=dtype, kv_cache_memory_bytes=64 << 20, max_model_len=512,
              enable_prefix_caching=True)
    plain = LLM(str(smollm2_path), **kw)
    prompts = [_chat(plain, f"Copy this code exactly, then stop:\n\n{TEXT}"),
               _chat(plain, "What is the capital of France? Answer in one sentence.")]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    spec = LLM(str(smollm2_path), speculative_config=NGRAM, **kw)
    spec.engine._async = True  # speculation must switch the run-ahead off by itself
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want  # batched
    assert [o.token_ids for o in spec.generate(prompts[:1], GREEDY)] == want[:1]  # single, cached prefix
    stats = spec.engine.status()["spec_decode"]
    assert stats["accepted_tokens"] >= 6, stats  # the copy is drafted and accepted
    pool = spec.engine.kv.pool
    spec.engine.kv.radix.evict(pool.num_pages)
    assert pool.num_free == pool.num_pages


ROWS = {"type": "array", "minItems": 2, "maxItems": 2, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "score"],
    "properties": {"name": {"enum": ["alpha", "beta", "gamma"]},
                   "score": {"type": "integer", "minimum": 0, "maximum": 9}}}}


@pytest.mark.slow
def test_smollm2_constrained_greedy_equals_no_speculation(smollm2_path: Path) -> None:
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    plain = LLM(str(smollm2_path), **kw)
    prompts = [_chat(plain, 'Copy this JSON exactly: [{"name": "alpha", "score": 3}, '
                            '{"name": "beta", "score": 5}]'),
               _chat(plain, "Say yes or no six times, separated by commas.")]
    params = [SamplingParams(max_tokens=28, temperature=0.0,
                             grammar=to_grammar(GrammarSpec("json_schema", json.dumps(ROWS)))),
              SamplingParams(max_tokens=14, temperature=0.0,
                             grammar=to_grammar(GrammarSpec("regex", r"(yes|no)(, (yes|no)){5}")))]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(str(smollm2_path), speculative_config=NGRAM, **kw)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    text = [plain.tokenizer.decode(ids) for ids in want]
    assert [row["name"] for row in json.loads(text[0])] == ["alpha", "beta"]
    stats = spec.engine.status()["spec_decode"]
    assert stats["drafts"] > 0 and stats["accepted_tokens"] >= 4, stats


def test_tp2_with_ngram_equals_tp1(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, **SHAPE)
    base = [11, 42, 7, 99, 3, 150, 8, 21]
    prompts = [base * 3, [5, 6, 7, 8, 9] * 4 + [5, 6], [77, 78]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=tp, page_size=4,
                  kv_cache_memory_bytes=4 << 20, tokenizer=byte_tokenizer(tmp_path),
                  speculative_config=NGRAM_ANY if tp == 2 else None)
        try:
            outs.append([c.token_ids for c in llm.generate(prompts, params)])
            if tp == 2:
                assert llm.engine.status()["spec_decode"]["drafts"] > 0
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]
