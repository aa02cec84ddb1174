"""A fake LLMEngine with the exact API of engine/core.py (see docs/ARCHITECTURE.md), so every
server behaviour is tested without torch: deterministic byte-level token streams, a running /
waiting split under max_num_seqs, a token-granular prefix cache, logprobs, stop strings and EOS,
injected failures, and a check that only one thread ever calls it (the engine is not thread-safe).

Prompt conventions the default script reads:
  SAY[[text]]   the output is exactly `text`, then EOS
  FAIL-STEP     step() raises while this request is running
  DIE-STEP      step() hits a fatal fault while this request is running: the engine is dead
otherwise the output is a long deterministic word stream (offset by the seed when sampling)."""

from __future__ import annotations

import codecs
import json
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from homelab_llm.engine.faults import EngineDeadError
from homelab_llm.engine.outputs import RequestOutput, TokenLogprob
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.errors import HomelabError

PAD, BOS, EOS = 0, 1, 2
SPECIALS = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}
OFFSET = 3  # byte b is token b + OFFSET
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


class PromptTooLongError(HomelabError, ValueError):
    pass


class DuplicateRequestError(HomelabError, ValueError):
    pass


class FakeTokenizer:
    vocab_size = 256 + OFFSET
    eos_token_ids = (EOS,)
    bos_token_id = BOS
    special_ids = frozenset(SPECIALS)
    sentencepiece_spaces = False
    chat_template = "fake-chatml: renders tools itself; tool_calls as content"

    def __init__(self, uses_think_tags: bool = False) -> None:
        self.uses_think_tags = uses_think_tags

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode()]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for t in ids:
            if t in SPECIALS:
                out.append(raw.decode(errors="replace"))
                raw.clear()
                if not skip_special_tokens:
                    out.append(SPECIALS[t])
            else:
                raw.append(t - OFFSET)
        out.append(raw.decode(errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in SPECIALS:
            return SPECIALS[token_id].encode()
        return bytes([token_id - OFFSET])

    def token_text(self, token_id: int) -> str:
        if token_id in SPECIALS:
            return SPECIALS[token_id]
        return bytes([token_id - OFFSET]).decode("latin-1")

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        parts = []
        if tools:
            parts.append(f"<|im_start|>system\nTools: {json.dumps(tools)}<|im_end|>\n")
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m['role']!r}")
            parts.append(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
            if kwargs.get("enable_thinking"):
                parts.append("<think>\n")
        return "".join(parts)


def default_script(prompt_text: str, params: SamplingParams) -> tuple[str, bool]:
    """(output text, whether EOS follows it)."""
    said = re.search(r".*SAY\[\[(.*)\]\]", prompt_text, re.S)  # the last SAY: earlier turns hold theirs
    if said:
        return said.group(1), True
    if params.temperature == 0:
        start = 0
    elif params.seed is not None:
        start = random.Random(params.seed).randrange(1000)
    else:
        start = random.randrange(1000)
    return "".join(WORDS[(start + k) % len(WORDS)] + " " for k in range(600)), False


@dataclass
class FakeSequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    script: bytes
    eos_after_script: bool
    fail: bool
    die: bool
    arrival_time: float
    num_cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    first_token_time: float | None = None
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class FakeEngine:
    def __init__(self, max_model_len: int = 1024, max_num_seqs: int = 8, step_delay: float = 0.0,
                 script: Callable[[str, SamplingParams], tuple[str, bool]] = default_script,
                 tokenizer: FakeTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or FakeTokenizer()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.script = script
        self.waiting: deque[FakeSequence] = deque()
        self.running: list[FakeSequence] = []
        self.aborted: list[str] = []
        self.known: set[str] = set()
        self.cached_prompts: deque[list[int]] = deque(maxlen=64)
        self.query_tokens = 0
        self.hit_tokens = 0
        self.steps = 0
        self.generated = 0  # tokens produced, all requests (status()["config"]: the split's tests)
        self.thread_ids: set[int] = set()
        self.shut_down = False
        self.dead_reason: str | None = None  # a test may set it: a rank died while idle
        self.last_params: SamplingParams | None = None
        self.detokenize = True  # False (the engine process): token ids only, the server decodes

    def _thread(self) -> None:
        self.thread_ids.add(threading.get_ident())

    # ---- the Engine API ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self._thread()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params.validate()
        self.last_params = params
        if request_id in self.known:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        budget = params.max_tokens or 1
        if len(ids) + budget > self.max_model_len:
            raise PromptTooLongError(f"prompt ({len(ids)}) + max_tokens ({budget}) > {self.max_model_len}")
        text = self.tokenizer.decode(ids)
        script, eos = self.script(text, params)
        self.known.add(request_id)
        self.waiting.append(FakeSequence(request_id, ids, params, script.encode(), eos,
                                         "FAIL-STEP" in text, "DIE-STEP" in text,
                                         time.monotonic()))

    def abort_request(self, request_id: str) -> None:
        self._thread()
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.aborted.append(request_id)

    def set_detokenize(self, enabled: bool) -> None:
        self._thread()
        self.detokenize = enabled

    def has_unfinished_requests(self) -> bool:
        self._thread()
        return bool(self.waiting or self.running or self.aborted)

    def step(self) -> list[RequestOutput]:
        self._thread()
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = [RequestOutput(rid, [], "", finished=True, finish_reason="abort")
                   for rid in self.aborted]
        self.aborted.clear()
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.num_cached = self._match_prefix(seq.prompt_ids)
            self.running.append(seq)
        if any(seq.fail for seq in self.running):
            raise RuntimeError("injected step failure")
        if any(seq.die for seq in self.running):
            self.dead_reason = "RuntimeError: CUDA error: an illegal memory access was encountered"
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        for seq in list(self.running):
            outputs.append(self._advance(seq))
            if outputs[-1].finished:
                self.running.remove(seq)
                self.known.discard(seq.request_id)
        return outputs

    def status(self) -> dict[str, Any]:
        self._thread()
        used = sum(len(s.prompt_ids) + len(s.output_ids) for s in self.running)
        return {
            "config": {"model": "fake", "max_model_len": self.max_model_len,
                       "max_num_seqs": self.max_num_seqs, "tensor_parallel_size": 1,
                       "fake_generated_tokens": self.generated},
            "devices": [{"name": "cpu", "total": 1 << 30, "weights": 1 << 20,
                         "activations_peak": 1 << 20, "graphs": 0, "kv_cache": 1 << 24,
                         "state": 0, "other": 0, "free": (1 << 30) - (1 << 24) - (2 << 20)}],
            "kv": {"page_size": 16, "dtype": "fp32", "tokens_capacity": 1 << 16, "tokens_used": used},
            "requests": {"running": len(self.running), "waiting": len(self.waiting)},
            "prefix_cache": {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens},
        }

    def shutdown(self) -> None:
        self._thread()
        self.shut_down = True

    # ---- internals ---------------------------------------------------------------------------
    def _match_prefix(self, ids: list[int]) -> int:
        best = 0
        for cached in self.cached_prompts:
            n = 0
            while n < min(len(ids), len(cached)) and ids[n] == cached[n]:
                n += 1
            best = max(best, n)
        best = min(best, len(ids) - 1)  # the last prompt token is always computed
        self.cached_prompts.append(list(ids))
        self.query_tokens += len(ids)
        self.hit_tokens += best
        return best

    def _advance(self, seq: FakeSequence) -> RequestOutput:
        p = seq.params
        k = len(seq.output_ids)
        if k < len(seq.script):
            token = seq.script[k] + OFFSET
        elif seq.eos_after_script and not p.ignore_eos and k >= p.min_tokens:
            token = EOS
        else:
            token = ord(" ") + OFFSET  # ignore_eos / min_tokens: pad with spaces
        seq.output_ids.append(token)
        self.generated += 1
        now = time.monotonic()
        seq.first_token_time = seq.first_token_time or now
        finished, reason, stop_reason = False, None, None
        if token == EOS:
            finished, reason, stop_reason = True, "stop", EOS
        elif self.detokenize:
            seq.text += seq.decoder.decode(bytes([token - OFFSET]))
            for stop in p.stop:
                at = seq.text.find(stop, max(0, seq.emitted - len(stop)))
                if at >= 0 and k + 1 >= p.min_tokens:
                    seq.text = seq.text[:at + (len(stop) if p.include_stop_str_in_output else 0)]
                    finished, reason, stop_reason = True, "stop", stop
                    break
        limit = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(seq.prompt_ids)
        if not finished and len(seq.output_ids) >= limit:
            finished, reason = True, "length"
        end = len(seq.text)
        if not finished:  # hold back a possible partial stop string
            for stop in p.stop:
                for keep in range(min(len(stop) - 1, end - seq.emitted), 0, -1):
                    if stop.startswith(seq.text[end - keep:]):
                        end = min(end, len(seq.text) - keep)
                        break
        delta = seq.text[seq.emitted:end]
        seq.emitted = max(seq.emitted, end)
        logprobs = []
        if p.logprobs is not None:
            top = tuple((t, -0.5 - i) for i, t in enumerate([token, *range(OFFSET, OFFSET + 40)])
                        if i == 0 or t != token)[: p.logprobs]
            logprobs = [TokenLogprob(token, -0.5, top)]
        return RequestOutput(
            seq.request_id, [token], delta, finished=finished, finish_reason=reason,
            stop_reason=stop_reason, num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached, num_output_tokens=len(seq.output_ids),
            logprobs=logprobs, arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            finish_time=now if finished else None)
