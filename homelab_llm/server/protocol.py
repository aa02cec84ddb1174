"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into the engine's
SamplingParams. Unknown fields are accepted and ignored, as OpenAI clients send many we do not use;
wrong types and out-of-range values become 400s that name the field."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from homelab_llm.engine.sampling_params import SamplingParams, SamplingParamsError
from homelab_llm.engine.structured.grammar import CallWrap, GrammarSpec
from homelab_llm.engine.tokenizer import Tokenizer
from homelab_llm.server.errors import APIError, bad_request
from homelab_llm.server.structured import StructuredFields, single_spec, tool_spec

MAX_N = 128  # choices per request: beyond this a single request could starve everyone else
MAX_LOGPROBS = 20


class _Body(BaseModel):
    # NaN/Infinity never reach the sampler: 1e999 decodes to inf, and pydantic would take it.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (exact per-chunk counts)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, name, reasoning_content ...) are kept: chat templates
    # read them.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class SamplingFields(_Body, StructuredFields):
    """Fields both endpoints share; None means "the default", as OpenAI clients send nulls."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # checked, then refused: the sampler lacks it
    allowed_token_ids: list[int] | None = None  # vLLM's; the same
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        return stops

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        # Seeds become 64-bit generator seeds, and choice i uses seed + i.
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - 1 - MAX_N:
            raise bad_request(f"seed must fit in a signed 64-bit integer, got {self.seed}", "seed")

    def constraint(self) -> tuple[str, GrammarSpec] | None:
        """The one output constraint this request sets (field, spec); a 400 when it sets several."""
        return single_spec(self.grammar_specs())

    def check_token_fields(self, vocab_size: int) -> None:
        """Token ids the client names must lie in the vocabulary; fields the engine cannot honour
        are refused (a silently ignored constraint would be a wrong answer)."""
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys are token ids, got {key[:40]!r}",
                                  "logit_bias") from None
            if not 0 <= token < vocab_size:
                raise bad_request(f"logit_bias names token {token}, outside the vocabulary "
                                  f"[0, {vocab_size})", "logit_bias")
            if not -100 <= bias <= 100:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}",
                                  "logit_bias")
        for token in self.allowed_token_ids or []:
            if not 0 <= token < vocab_size:
                raise bad_request(f"allowed_token_ids holds {token}, outside the vocabulary "
                                  f"[0, {vocab_size})", "allowed_token_ids")
        for name in ("logit_bias", "allowed_token_ids"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported by this server", name, "unsupported")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0,
                        *, vocab_size: int, grammar: str | None = None,
                        grammar_after_think: bool = False) -> SamplingParams:
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            # n > 1 with a seed: each choice gets seed + i, so choices differ but replay exactly.
            seed=None if self.seed is None else self.seed + seed_offset,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            grammar=grammar,
            grammar_after_think=grammar_after_think,
        )
        try:
            params.validate(vocab_size)
        except SamplingParamsError as err:
            raise bad_request(str(err), str(err).split(" ", 1)[0]) from err
        return params


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        if not self.logprobs:
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        return top

    def check(self) -> None:
        self.check_common()
        if self.tool_choice is not None and not self.tools:
            raise bad_request("tool_choice requires tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise bad_request(f"tool_choice names {self.tool_choice.function.name!r}, "
                                  f"which is not among the tools {names}", "tool_choice")

    def constraint(self, call: CallWrap = CallWrap()) -> tuple[str, GrammarSpec] | None:
        """As SamplingFields.constraint, with tool_choice "required" / a named function first
        (the call written in the `call` form: the server's tool parser's)."""
        specs = self.grammar_specs()
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) \
            else self.tool_choice
        spec = tool_spec(tools, choice, call) if tools else None
        if spec is not None:
            specs.insert(0, ("tool_choice", spec))
        return single_spec(specs)

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template, shaped as HF's apply_chat_template
        expects them: every message keeps its `content` key (None on an assistant turn that only
        calls tools: templates test `message.content`, and a missing key is an error in jinja's
        sandbox), tool-call arguments sent as JSON text become objects (templates write them with
        `| tojson`), text parts are joined and other parts refused."""
        out = []
        for i, message in enumerate(self.messages):
            item = message.model_dump(exclude_none=True)
            item.setdefault("content", None)
            if isinstance(item.get("tool_calls"), list):
                item["tool_calls"] = [template_tool_call(call) for call in item["tool_calls"]]
            if isinstance(message.content, list):
                texts = []
                for part in message.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request(f"messages[{i}].content: only text parts are supported, "
                                          f"got type {part.get('type')!r}", f"messages.{i}.content")
                    texts.append(part["text"])
                item["content"] = "".join(texts)
            out.append(item)
        return out


def template_tool_call(call: Any) -> Any:
    """One assistant tool call as templates read it: `arguments` an object when the client sent
    a JSON object as text (OpenAI's wire form), else left as sent."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        # OpenAI's completions default is 16 tokens; clients that want more say so.
        return 16 if self.max_tokens is None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                              "logprobs")
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, one token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if any(isinstance(x, list) and not x for x in p):
            raise bad_request("prompt token lists must not be empty", "prompt")
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        self.check_common()


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """The field part of a pydantic error location; union-member tags ('str', 'list[int]',
    'NamedToolChoice') that follow it are dropped."""
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            path.append(part)
        else:
            break
    return path


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Tokenize client text; text the tokenizer cannot take (e.g. a lone UTF-16 surrogate, which
    JSON allows) is the client's problem, not a 500."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as err:
        raise bad_request(f"{param}: the text cannot be tokenized ({err})", param) from err


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; any mismatch is a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(_field_path(first["loc"]))
        raise bad_request(f"{loc or 'body'}: {first['msg']}", loc or None) from err


def check_logprobs_cap(count: int | None, cap: int) -> int | None:
    """The server's --max-logprobs, as vLLM applies it: more top logprobs is a 400."""
    if count is not None and count > cap:
        raise bad_request(f"this server returns at most {cap} top logprobs (--max-logprobs); "
                          f"the request asks for {count}", "logprobs")
    return count


def check_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                     param: str = "max_tokens") -> int | None:
    """The context check done before a request reaches the engine: prompt + max_tokens must fit.
    Returns the max_tokens to give the engine (None: up to the limit)."""
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if requested is None:
        if prompt_len >= max_model_len:
            raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room to generate "
                              f"within the context limit of {max_model_len} tokens", "messages")
        return None
    if prompt_len + requested > max_model_len:
        raise bad_request(f"the prompt ({prompt_len} tokens) plus {param} ({requested}) is "
                          f"{prompt_len + requested} tokens, beyond the model's context limit of "
                          f"{max_model_len} tokens", param, "context_length_exceeded")
    return requested


__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "TokenizeRequest",
           "DetokenizeRequest", "parse_body", "check_max_tokens"]
