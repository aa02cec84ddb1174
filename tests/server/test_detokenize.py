"""The server's detokenizer (server/detokenize.py) against the engine's own text path: the engine in
token-id mode plus TextOutputs must stream exactly what the engine in text mode streams (deltas,
finish and stop reasons, token counts, logprobs), for any tokens, stop strings, min_tokens and any
number of tokens per step (speculative decoding appends several)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from homelab_llm.engine.output_processor import OutputProcessor
from homelab_llm.engine.outputs import RequestOutput, TokenLogprob
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.sequence import Sequence
from homelab_llm.server.detokenize import TextOutputs
from homelab_llm.server.engine_core import output_row
from tests.server.fake_engine import EOS, OFFSET, FakeTokenizer

PROMPT = [5, 6, 7]
# Bytes of "ab xy" and of "é" (two tokens: 0xC3 0xA9), so stops and split characters both occur.
TOKENS = st.sampled_from([ord(c) + OFFSET for c in "ab xy"] + [0xC3 + OFFSET, 0xA9 + OFFSET, EOS])


def run_engine(tokens: list[int], steps: list[int], params: SamplingParams,
               detokenize: bool) -> list[RequestOutput]:
    """The engine's output processor over `tokens`, `steps[i]` tokens at step i (as _record_many
    appends them: until a stop condition holds), one output per step."""
    proc = OutputProcessor(FakeTokenizer(), (EOS,), max_model_len=1000)
    proc.detokenize = detokenize
    seq = Sequence("r", list(PROMPT), params, 0.0, max_tokens=params.max_tokens or 100)
    proc.start(seq)
    outputs, at = [], 0
    for size in steps:
        for token in tokens[at:at + size]:
            proc.append_token(seq, token, TokenLogprob(token, -1.0))
            if seq.finish_reason is not None:
                break
        at += size
        if (out := proc.make_output(seq)) is not None:
            outputs.append(out)
        if seq.finish_reason is not None or at >= len(tokens):
            break
    return outputs


def through_server(outputs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    text = TextOutputs(FakeTokenizer())
    text.start("r", list(PROMPT), params)
    result = []
    for out in outputs:
        step = text.apply([output_row(out)])
        result += step.outputs
        if result[-1].finished:
            break
    return result


def summary(outputs: list[RequestOutput]) -> list[tuple]:
    return [(o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.stop_reason,
             o.num_output_tokens, [lp.token_id for lp in o.logprobs]) for o in outputs]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(TOKENS, min_size=1, max_size=24),
       steps=st.lists(st.integers(1, 4), min_size=24, max_size=24),
       stop=st.lists(st.sampled_from(["xy", "y", "a b", "é", "bx", "yyy"]), max_size=2),
       include=st.booleans(), min_tokens=st.integers(0, 4), max_tokens=st.integers(1, 30),
       ignore_eos=st.booleans())
def test_server_decoding_equals_the_engines(tokens, steps, stop, include, min_tokens, max_tokens,
                                            ignore_eos) -> None:
    params = SamplingParams(max_tokens=max_tokens, stop=stop, include_stop_str_in_output=include,
                            min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos)
    in_engine = run_engine(tokens, steps, params, detokenize=True)
    token_only = run_engine(tokens, steps, params, detokenize=False)
    assert all(o.new_text == "" for o in token_only)
    decoded = through_server(token_only, params)
    # The token-only engine runs past a stop string (the server cuts it): same text and counts
    # up to where the in-engine path stopped, and one step later at most.
    assert summary(decoded) == summary(in_engine)


def test_a_stop_string_inside_a_multi_token_step_cuts_tokens_and_asks_for_an_abort() -> None:
    params = SamplingParams(max_tokens=50, stop=["xy"])
    text = TextOutputs(FakeTokenizer())
    text.start("r", list(PROMPT), params)
    ids = [ord(c) + OFFSET for c in "abxyab"]
    lps = [TokenLogprob(t, -1.0) for t in ids]
    step = text.apply([output_row(RequestOutput("r", ids, "", num_output_tokens=6, logprobs=lps))])
    (out,) = step.outputs
    assert step.cut == ["r"]  # the engine still holds it
    assert (out.new_text, out.new_token_ids, out.num_output_tokens) == ("ab", ids[:4], 4)
    assert out.finished and out.finish_reason == "stop" and out.stop_reason == "xy"
    assert [lp.token_id for lp in out.logprobs] == ids[:4]
    assert "r" not in text.requests


def test_text_is_kept_only_as_far_back_as_the_longest_stop() -> None:
    text = TextOutputs(FakeTokenizer())
    text.start("r", list(PROMPT), SamplingParams(max_tokens=500, stop=["abc"]))
    for n in range(1, 200):
        text.apply([output_row(RequestOutput("r", [ord("z") + OFFSET], "", num_output_tokens=n))])
    assert len(text.requests["r"].text) <= 2 * len("abc")


class Exploding(FakeTokenizer):
    def token_bytes(self, token_id: int) -> bytes:
        if token_id == ord("!") + OFFSET:
            raise ValueError("no bytes for this token")
        return super().token_bytes(token_id)


def test_a_request_whose_decoding_raises_fails_alone() -> None:
    text = TextOutputs(Exploding())
    for rid in ("bad", "good"):
        text.start(rid, list(PROMPT), SamplingParams(max_tokens=5))
    rows = [output_row(RequestOutput(rid, [ord(c) + OFFSET], "", num_output_tokens=1))
            for rid, c in (("bad", "!"), ("good", "o"))]
    step = text.apply(rows)
    bad, good = step.outputs
    assert bad.finished and bad.finish_reason == "error" and "no bytes" in bad.error
    assert step.cut == ["bad"] and "bad" not in text.requests
    assert good.new_text == "o" and not good.finished
