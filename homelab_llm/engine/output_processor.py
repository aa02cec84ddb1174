"""After sampling: append tokens, detokenize incrementally, check stop conditions, build outputs.

Stop strings are matched on text and cut from it (unless include_stop_str_in_output); text that
could still be the start of a stop string is held back until it cannot be (engine/stop_text.py).

With `detokenize` off (the server's engine process: the server detokenizes, vLLM v1's split) the
outputs carry token ids only (new_text ""), and only the stop conditions that need no text are
checked here: EOS, stop token ids, max_tokens, min_tokens, the context limit. A sequence whose
grammar waits for the end of a reasoning section still decodes its text here, for that check only.
"""

from __future__ import annotations

import time

from homelab_llm.engine.outputs import RequestOutput, TokenLogprob
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.stop_text import cut_at_stop, find_stop, releasable_end


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.detokenize = True  # False: token ids only, the server decodes (see the docstring)

    def start(self, seq: Sequence) -> None:
        from homelab_llm.engine.tokenizer import IncrementalDetokenizer

        needs_text = self.detokenize or (seq.grammar is not None and not seq.grammar.active)
        if self.tokenizer is not None and needs_text:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Add one sampled token; sets finish_reason when a stop condition holds."""
        p = seq.params
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        n_out = seq.num_output_tokens
        stop_token = n_out > p.min_tokens - 1 and (
            (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids)
        if stop_token:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in p.stop_token_ids else None
        else:
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.push([token])
            if seq.grammar is not None:
                seq.grammar.advance(token, seq.output_text)
                if not self.detokenize and seq.grammar.active:
                    seq.detokenizer = None  # it decoded only to find the reasoning's end
            if self.detokenize and seq.detokenizer is not None and p.stop \
                    and n_out >= p.min_tokens and self._check_stop_strings(seq):
                return
            if n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None and seq.detokenizer is not None:
            seq.output_text += seq.detokenizer.flush()  # trailing partial bytes become U+FFFD

    def _check_stop_strings(self, seq: Sequence) -> bool:
        best = find_stop(seq.output_text, seq.params.stop, seq.emitted_text_len)
        if best is None:
            return False
        idx, s = best
        seq.output_text = cut_at_stop(seq.output_text, idx, s, seq.params.include_stop_str_in_output)
        seq.finish_reason = "stop"
        seq.stop_reason = s
        return True

    def make_output(self, seq: Sequence) -> RequestOutput | None:
        """The delta since the last output of this sequence, or None if there is nothing new."""
        finished = seq.finish_reason is not None
        text = seq.output_text if self.detokenize else ""
        end = releasable_end(len(text), seq.emitted_text_len, seq.params.stop, finished)
        new_tokens = seq.token_ids[seq.num_prompt_tokens + seq.emitted_token_count:]
        if not new_tokens and end == seq.emitted_text_len and not finished:
            return None
        new_text = text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        seq.emitted_token_count = seq.num_output_tokens
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            logprobs=logprobs,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            error=seq.error,
        )
