"""What every route needs: the server's settings and the live engine client + statistics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from homelab_llm.server.client_base import ClientBase, Engine
from homelab_llm.server.errors import model_not_found, unavailable
from homelab_llm.server.limits import PromptBound
from homelab_llm.server.stats import ServerStats


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    model_path: str = ""
    api_key: str | None = None
    max_queue_len: int | None = None  # requests waiting for their first token; None: unbounded
    drain_timeout_s: float = 30.0
    host: str = "127.0.0.1"  # the bound address: a loopback one turns the Host allow-list on
    allowed_hosts: tuple[str, ...] = ()  # extra Host names to accept; "*" accepts any
    max_request_body_bytes: int = 32 << 20  # larger bodies get 413 before they are read whole
    max_seqs_per_request: int = 256  # prompts x n of one request; more is a 400
    reasoning_parser: str | None = None  # --reasoning-parser: route <think> whatever the template
    max_logprobs: int = 20  # --max-logprobs: the most top logprobs a request may ask for
    tool_call_parser: str | None = None  # --tool-call-parser: server/tool_parser.py (None: hermes)


@dataclass
class ServerState:
    config: ServerConfig
    client: ClientBase
    stats: ServerStats
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_bound: PromptBound | None = None  # computed on first use: it reads the vocabulary

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The name to echo back; a name we do not serve is a 404 (None means the default)."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.config.served_model_names:
            raise model_not_found(requested, list(self.config.served_model_names))
        return requested

    def ready_engine(self) -> Engine:
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.client.state in ("failed", "dead"):
            raise unavailable(self.client.unavailable_reason, 60)
        if self.client.state != "ready" or self.client.engine is None:
            raise unavailable("the model is still loading")
        return self.client.engine

    async def ready_prompt_bound(self, engine: Engine) -> PromptBound:
        if self.prompt_bound is None:
            self.prompt_bound = await asyncio.to_thread(PromptBound.of, engine.tokenizer,
                                                        engine.max_model_len)
        return self.prompt_bound
