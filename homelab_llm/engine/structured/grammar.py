"""What a constrained request asks for, turned into one llguidance grammar (Lark text).

    spec = GrammarSpec("json_schema", json.dumps(schema))
    grammar = to_grammar(spec)   # raises GrammarError naming the problem (the server's 400)

Kinds: json_schema, json_object (any JSON object), regex, choice (a JSON list of strings), grammar
(Lark, or GBNF/EBNF as llama.cpp and vLLM's guided_grammar take it), and tool_call (a JSON list of
OpenAI tool definitions: the output is one call object `{"name", <args_key>}` of one of them, with
arguments valid against its `parameters` schema, between the spec's `call` wrapper: a Hermes
`<tool_call>` block by default, the server passes the form its tool parser reads). The grammar text is the cache key of the compiled
matcher (structured/matcher.py), so equal requests compile once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from homelab_llm.errors import HomelabError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")
MAX_SOURCE_CHARS = 256 * 1024  # a schema or grammar beyond this is abuse, not an agent's tool set


class GrammarError(HomelabError, ValueError):
    """The schema or grammar is invalid or unsupported; the message says what and where."""


@dataclass(frozen=True)
class CallWrap:
    """How a constrained tool call is written: `open` + {"name", args_key} + `close`."""
    open: str = "<tool_call>\n"
    close: str = "\n</tool_call>"
    args_key: str = "arguments"


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str = ""  # schema JSON, regex, choices JSON, grammar text or tools JSON, per kind
    call: CallWrap = CallWrap()  # tool_call only


def _json_grammar(schema: Any, what: str) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, RuntimeError) as err:
        raise GrammarError(f"{what}: {err}") from None


def _lark_grammar(text: str) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    text = text.strip()
    if "::=" in text:  # GBNF / EBNF (root ::= ...) as llama.cpp writes it
        try:
            text = gbnf_to_lark(text)
        except Exception as err:  # the converter raises bare Exceptions for user errors
            raise GrammarError(f"the GBNF grammar does not parse: {err}") from None
    try:
        return llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, RuntimeError) as err:
        raise GrammarError(f"the grammar does not parse: {err}") from None


def _load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise GrammarError(f"{what} is not valid JSON: {err}") from None


def tool_call_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON object of one call of any of `tools`, its arguments under `args_key`."""
    options = []
    for tool in tools:
        fn = tool.get("function") or {}
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {
            "name": {"const": fn.get("name", "")}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact separators: free whitespace lets a small model pad the call with spaces and newlines.
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def to_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec`, validated; GrammarError naming the problem."""
    import llguidance

    grammar = _build(spec)
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err and not err.startswith("WARNING"):
        what = {"json_schema": "the JSON schema", "json_object": "json_object", "regex": "the regex",
                "choice": "choice", "grammar": "the grammar",
                "tool_call": "a tool's parameters schema"}[spec.kind]
        raise GrammarError(f"{what} is not supported: {err}")
    return grammar


def _build(spec: GrammarSpec) -> str:
    if spec.kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {spec.kind!r}; one of {', '.join(KINDS)}")
    if len(spec.source) > MAX_SOURCE_CHARS:
        raise GrammarError(f"the {spec.kind} constraint is {len(spec.source)} characters; "
                           f"at most {MAX_SOURCE_CHARS}")
    if spec.kind == "json_object":
        return _json_grammar({"type": "object"}, "json_object")
    if spec.kind == "json_schema":
        schema = _load_json(spec.source, "the JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        return _json_grammar(schema, "the JSON schema")
    if spec.kind == "regex":
        import llguidance

        try:
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        except (ValueError, RuntimeError) as err:
            raise GrammarError(f"the regex does not compile: {err}") from None
    if spec.kind == "choice":
        choices = _load_json(spec.source, "the choices")
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise GrammarError("choice must be a non-empty list of strings")
        return _lark_grammar("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "grammar":
        return _lark_grammar(spec.source)
    tools = _load_json(spec.source, "the tools")
    if not (isinstance(tools, list) and tools):
        raise GrammarError("a tool-call constraint needs at least one tool")
    schema = json.dumps(tool_call_schema(tools, spec.call.args_key))
    wrap = " ".join([json.dumps(spec.call.open)] * bool(spec.call.open) + ["call"]
                    + [json.dumps(spec.call.close)] * bool(spec.call.close))
    return _lark_grammar(f"start: {wrap}\ncall: %json {schema}")
