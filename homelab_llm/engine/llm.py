"""Offline API: LLM(model, **engine_args).generate(prompts, SamplingParams) -> completions."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.core import LLMEngine
from homelab_llm.engine.outputs import TokenLogprob
from homelab_llm.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLM:
    def __init__(self, model: str = "", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Run all prompts together (continuous batching) and return them in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        results: dict[str, Completion] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params):
            rid = f"offline-{next(self._ids)}"
            prompt_ids = self.engine.add_request(rid, prompt, p)
            results[rid] = Completion(rid, prompt_ids)
            order.append(rid)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                c = results.get(out.request_id)
                if c is None:
                    continue
                c.token_ids.extend(out.new_token_ids)
                c.text += out.new_text
                c.logprobs.extend(out.logprobs)
                c.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[Completion]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in conversations]  # type: ignore[arg-type]
        # The template already carries BOS where the model wants it.
        ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, params)

    def shutdown(self) -> None:
        self.engine.shutdown()
