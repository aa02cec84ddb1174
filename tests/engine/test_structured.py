"""Structured outputs below the server: grammar building and its errors, the bitmask reference
against a per-token loop, and a matcher over the byte tokenizer (fill, advance, drafts, rollback,
the </think> gate)."""

from __future__ import annotations

import json

import pytest
import torch

from homelab_llm.engine.kernels import ref
from homelab_llm.engine.structured.grammar import GrammarError, GrammarSpec, to_grammar
from homelab_llm.engine.structured.matcher import GrammarState, compile_grammar, mask_words
from homelab_llm.engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer()  # ids 0-255 are the bytes; 257 is EOS


def state(spec: GrammarSpec, after_think: bool = False) -> GrammarState:
    return GrammarState.start(TOK, to_grammar(spec), after_think)


def allowed(st: GrammarState) -> set[int]:
    mask = torch.empty((1, mask_words(TOK.vocab_size)), dtype=torch.int32)
    st.fill(mask, 0)
    logits = torch.zeros((1, TOK.vocab_size))
    ref.apply_token_bitmask_ref(logits, mask, torch.tensor([0]))
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def feed(st: GrammarState, text: str) -> str:
    out = ""
    for b in text.encode():
        assert b in allowed(st), (out, chr(b))
        out += chr(b)
        st.advance(b, out)
    return out


def test_bitmask_reference_matches_a_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 100, 5  # 100 is not a multiple of 32: the last word is partly used
    bits = torch.randint(0, 2, (batch, mask_words(vocab) * 32), generator=gen)
    words = torch.zeros((batch, mask_words(vocab)), dtype=torch.int64)
    for w in range(mask_words(vocab)):
        for b in range(32):
            words[:, w] |= bits[:, w * 32 + b] << b
    mask = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same bits as int32
    logits = torch.randn((7, vocab), generator=gen)
    rows = torch.tensor([6, 0, 3, 4, 1])
    expect = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(vocab):
            if not bits[i, t]:
                expect[row, t] = float("-inf")
    ref.apply_token_bitmask_ref(logits, mask, rows)
    assert torch.equal(logits, expect)  # exact: only -inf is written


@pytest.mark.parametrize("spec, needle", [
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", json.dumps({"type": "strnig"})), "JSON schema.*strnig"),
    (GrammarSpec("regex", "a(b"), "regex"),
    (GrammarSpec("choice", "[]"), "non-empty"),
    (GrammarSpec("grammar", "start: foo"), "grammar"),
    (GrammarSpec("grammar", "root ::= \"a\" undefined_rule"), "grammar"),
    (GrammarSpec("tool_call", "[]"), "at least one tool"),
    (GrammarSpec("xml"), "unknown constraint"),
])
def test_bad_constraints_name_the_problem(spec: GrammarSpec, needle: str) -> None:
    with pytest.raises(GrammarError, match=needle):
        compile_grammar(TOK, to_grammar(spec))


def test_json_schema_mask_follows_the_schema() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    st = state(GrammarSpec("json_schema", json.dumps(schema)))
    assert allowed(st) == {ord("{")}
    feed(st, '{"n":')
    assert ord("x") not in allowed(st) and ord("7") in allowed(st)
    feed(st, "42}")
    assert st.finished and allowed(st) == {ByteTokenizer.EOS}


def test_padded_logits_rows_mask_the_padding() -> None:
    st = state(GrammarSpec("choice", json.dumps(["a"])))
    mask = torch.empty((1, mask_words(TOK.vocab_size + 100)), dtype=torch.int32)
    st.fill(mask, 0)
    logits = torch.zeros((1, TOK.vocab_size + 100))
    ref.apply_token_bitmask_ref(logits, mask, torch.tensor([0]))
    assert torch.nonzero(logits[0] == 0).flatten().tolist() == [ord("a")]


def test_choice_and_regex() -> None:
    st = state(GrammarSpec("choice", json.dumps(["yes", "no"])))
    assert allowed(st) == {ord("y"), ord("n")}
    feed(st, "no")
    assert allowed(st) == {ByteTokenizer.EOS}
    st = state(GrammarSpec("regex", r"[0-9]{3}-[a-z]"))
    feed(st, "123-")
    assert allowed(st) == set(range(ord("a"), ord("z") + 1))


def test_tool_call_grammar_forces_a_named_call() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    st = state(GrammarSpec("tool_call", json.dumps(tools)))
    text = feed(st, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>')
    assert st.finished and json.loads(text.split("\n")[1])["name"] == "get_weather"


def test_draft_check_and_rollback_for_speculative_decoding() -> None:
    st = state(GrammarSpec("choice", json.dumps(["abc", "abd"])))
    assert st.check_draft([ord(c) for c in "abx"]) == 2  # x is refused; state unchanged
    assert allowed(st) == {ord("a")}
    feed(st, "ab")
    st.rollback(2)
    assert allowed(st) == {ord("a")}


def test_grammar_waits_for_the_end_of_reasoning() -> None:
    st = state(GrammarSpec("choice", json.dumps(["ok"])), after_think=True)
    assert len(allowed(st)) == TOK.vocab_size  # free while thinking
    text = ""
    for ch in "hmm</think>":
        text += ch
        st.advance(ord(ch), text)
    assert allowed(st) == {ord("o")}


def test_sampler_masks_constrained_rows_only() -> None:
    from homelab_llm.engine.layers.sampler import Sampler
    from homelab_llm.engine.sampling_params import SamplingParams
    from homelab_llm.engine.sequence import Sequence

    grammar = to_grammar(GrammarSpec("choice", json.dumps(["q"])))
    rows = []
    for i, constrained in enumerate((True, False, True)):
        params = SamplingParams(temperature=0.0, grammar=grammar if constrained else None)
        s = Sequence(f"r{i}", [1, 2], params, 0.0, max_tokens=4)
        s.grammar = GrammarState.start(TOK, grammar, False) if constrained else None
        rows.append(s)
    logits = torch.zeros((3, TOK.vocab_size))
    logits[:, ord("z")] = 10.0  # what the model wants; the grammar allows only "q"
    assert Sampler(TOK.eos_token_ids)(logits, rows).token_ids == [ord("q"), ord("z"), ord("q")]
