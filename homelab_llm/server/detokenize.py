"""The server's half of the engine split (vLLM v1's): the engine process sends token ids only, one
message per step (engine/output_processor.py with detokenize off); here, in the HTTP process, each
request's tokens are decoded incrementally, stop strings are matched and cut, and text that may
still grow into a stop string is held back (engine/stop_text.py: the same rule as the engine's).

Invariants:
- An output leaves here exactly as the in-engine path would have produced it: the same text
  deltas, finish_reason, stop_reason, and a token count (and logprobs) that end with the token
  that completed a stop string; tokens the engine made after that one are dropped.
- A request cut by a stop string is reported in `StepText.cut`: the engine still holds it and the
  caller aborts it there (at most one step late).
- A request whose decoding raises fails alone: an error output, and it is aborted in the engine.
- The engine finishes with reason "stop" only on a token id (EOS, stop_token_ids), whose text is
  never shown, so that last token is not decoded.
- Only a tail of each request's text is kept: what is not yet handed out, plus as many characters
  before it as the longest stop string (a match may start there)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.stop_text import cut_at_stop, find_stop, releasable_end
from homelab_llm.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("homelab_llm.server")


@dataclass
class RequestText:
    """One request's decoding state."""

    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    lookback: int  # the longest stop string: characters kept before `emitted`
    text: str = ""  # a tail of the output text (see the module docstring)
    emitted: int = 0  # index into `text`: what is before it was handed out


@dataclass
class StepText:
    """One engine step's outputs with their text, and the requests to abort in the engine."""

    outputs: list[RequestOutput] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)


class TextOutputs:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestText] = {}

    def start(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        lookback = max((len(s) for s in params.stop), default=0)
        self.requests[request_id] = RequestText(detokenizer, params, lookback)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def apply(self, rows: list[tuple]) -> StepText:
        """The engine's rows (engine_core.output_row) as outputs with text."""
        step = StepText()
        for row in rows:
            out = RequestOutput(*row)
            state = self.requests.get(out.request_id)
            if state is None:  # aborted here already: the client drops it
                step.outputs.append(out)
                continue
            try:
                cut = decode(state, out)
            except Exception as err:  # noqa: BLE001 - this request fails, the others go on
                log.exception("decoding the output of %s failed", out.request_id)
                cut = not out.finished
                out = RequestOutput(out.request_id, [], "", finished=True, finish_reason="error",
                                    finish_time=time.monotonic(),
                                    error=f"decoding the output failed: {type(err).__name__}: {err}")
            if out.finished:
                del self.requests[out.request_id]
            if cut:
                step.cut.append(out.request_id)
            step.outputs.append(out)
        return step


def decode(state: RequestText, out: RequestOutput) -> bool:
    """Fill `out` (in place) with its text delta, cutting it at a stop string; returns whether
    the engine still holds a request that has ended here."""
    p = state.params
    tokens = out.new_token_ids
    count = len(tokens) - (1 if out.finish_reason == "stop" and tokens else 0)
    stop: str | None = None
    if p.stop:
        first = out.num_output_tokens - len(tokens) + 1  # the output position of tokens[0]
        for i in range(count):
            state.text += state.detokenizer.push(tokens[i:i + 1])
            if first + i >= p.min_tokens and (hit := find_stop(state.text, p.stop, state.emitted)):
                state.text = cut_at_stop(state.text, hit[0], hit[1], p.include_stop_str_in_output)
                stop, count = hit[1], i + 1
                break
    elif count:
        state.text += state.detokenizer.push(tokens[:count] if count < len(tokens) else tokens)
    cut = False
    if stop is not None:
        cut = not out.finished
        out.num_output_tokens -= len(tokens) - count
        out.new_token_ids, out.logprobs = tokens[:count], out.logprobs[:count]
        out.finished, out.finish_reason, out.stop_reason = True, "stop", stop
        out.finish_time = out.finish_time or time.monotonic()
    elif out.finish_reason in ("stop", "length"):
        state.text += state.detokenizer.flush()  # trailing partial bytes become U+FFFD
    text = state.text
    end = releasable_end(len(text), state.emitted, p.stop, out.finished)
    out.new_text = text[state.emitted:end]
    keep_from = max(0, end - state.lookback)
    state.text, state.emitted = text[keep_from:], end - keep_from
    return cut
