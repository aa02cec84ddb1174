"""A null engine for measuring the server alone (benchmarks/http_cpu.py): no model, tokens made at
a fixed pace, but every output goes through the checkout's own OutputProcessor with the real
SmolLM2 tokenizer, so the engine side does the per-token work the real engine does (decoding and
stop checks where that checkout does them there, token ids only where it does not).

The pace comes with each request: a prompt "pace <microseconds>" makes every later step take at
least that long (0: as fast as the loop goes). Each running request gets one token per step, from
a fixed English text, until its max_tokens. Works with any checkout since the engine process
(Sequence, OutputProcessor and the Engine API are the same), so two can be compared in one run."""

from __future__ import annotations

import re
import time
from typing import Any

TEXT = ("The engine schedules requests in pages, and the radix tree shares every token of a "
        "common prefix between agent turns, so long contexts start fast. Streams are decoded "
        "incrementally: a character split across tokens waits for its last byte, and text that "
        "may grow into a stop string is held back until it cannot. ") * 4


class NullEngine:
    def __init__(self, max_model_len: int = 8192) -> None:
        from homelab_llm.assets import default_model_path
        from homelab_llm.engine.output_processor import OutputProcessor
        from homelab_llm.engine.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(default_model_path())
        self.max_model_len = max_model_len
        eos = tuple(self.tokenizer.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, eos, max_model_len)
        self.script = self.tokenizer.encode(TEXT, add_special_tokens=False)
        self.seqs: dict[str, Any] = {}
        self.ended: list[Any] = []
        self.pace_s = 0.0
        self.next_step = 0.0
        self.dead_reason: str | None = None

    def set_detokenize(self, enabled: bool) -> None:
        self.outputs.detokenize = enabled

    def add_request(self, request_id: str, prompt: str | list[int], params: Any) -> list[int]:
        from homelab_llm.engine.sequence import Sequence

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if (pace := re.search(r"pace (\d+)", self.tokenizer.decode(ids))) is not None:
            self.pace_s = int(pace.group(1)) / 1e6
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params,
                       arrival_time=time.monotonic(), max_tokens=max_tokens)
        self.outputs.start(seq)
        self.seqs[request_id] = seq
        return ids

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = "abort"
            self.ended.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs or self.ended)

    def step(self) -> list[Any]:
        now = time.monotonic()
        if self.next_step > now:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.pace_s
        outputs = [self.outputs.make_output(seq) for seq in self.ended]
        self.ended.clear()
        script = self.script
        for seq in list(self.seqs.values()):
            token = script[seq.num_output_tokens % len(script)]
            self.outputs.append_token(seq, token, None)
            if seq.finish_reason is not None:
                seq.finish_time = time.monotonic()
                del self.seqs[seq.request_id]
            if (out := self.outputs.make_output(seq)) is not None:
                outputs.append(out)
        return [out for out in outputs if out is not None]

    def status(self) -> dict[str, Any]:
        return {"config": {"model": "null", "max_model_len": self.max_model_len},
                "requests": {"running": len(self.seqs), "waiting": 0}}

    def shutdown(self) -> None:
        self.seqs.clear()
