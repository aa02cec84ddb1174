"""Request fields that constrain decoding -> one GrammarSpec -> a compiled grammar (or a 400).

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` object and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields, and for chat
`tool_choice` "required" or a named function (the output is a call of the allowed tool(s), in the
form the server's tool parser reads: server/tool_parser.py). At most one constraint per request: two would
have to agree, and a silent pick would be a wrong answer. `prepare_grammar` runs in the request's
prepare thread, so compiling (cached by grammar text) never stalls the event loop or the engine.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from homelab_llm.engine.structured.grammar import CallWrap, GrammarError, GrammarSpec, to_grammar
from homelab_llm.server.errors import bad_request


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request object (one of its fields set)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The constraint fields both endpoints accept (mixed into SamplingFields)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def grammar_specs(self) -> list[tuple[str, GrammarSpec]]:
        """Every constraint the request sets, with the field that set it."""
        found: list[tuple[str, GrammarSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            found.append(("response_format", GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_))))
        so = self.structured_outputs
        if so is not None:
            found.extend(_guided("structured_outputs", so.json_, so.regex, so.choice, so.grammar))
            if so.json_object:
                found.append(("structured_outputs", GrammarSpec("json_object")))
        found.extend(_guided(None, self.guided_json, self.guided_regex, self.guided_choice,
                             self.guided_grammar))
        return found


def _guided(field: str | None, schema: dict[str, Any] | str | None, regex: str | None,
            choice: list[str] | None, grammar: str | None) -> list[tuple[str, GrammarSpec]]:
    out = []
    if schema is not None:
        out.append((field or "guided_json",
                    GrammarSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema))))
    if regex is not None:
        out.append((field or "guided_regex", GrammarSpec("regex", regex)))
    if choice is not None:
        out.append((field or "guided_choice", GrammarSpec("choice", json.dumps(choice))))
    if grammar is not None:
        out.append((field or "guided_grammar", GrammarSpec("grammar", grammar)))
    return out


def tool_spec(tools: list[dict[str, Any]], tool_choice: Any,
              call: CallWrap = CallWrap()) -> GrammarSpec | None:
    """tool_choice "required": a call of any tool; a named function: a call of that one; written
    in the `call` form."""
    if tool_choice == "required":
        return GrammarSpec("tool_call", json.dumps(tools), call)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return GrammarSpec("tool_call", json.dumps(
            [t for t in tools if t["function"]["name"] == name]), call)
    return None


def single_spec(specs: list[tuple[str, GrammarSpec]]) -> tuple[str, GrammarSpec] | None:
    if len(specs) > 1:
        names = ", ".join(dict.fromkeys(field for field, _ in specs))
        raise bad_request(f"a request may set one output constraint; this one sets {len(specs)} "
                          f"({names})", specs[1][0])
    return specs[0] if specs else None


def prepare_grammar(tokenizer: Any, field_spec: tuple[str, GrammarSpec] | None) -> str | None:
    """The compiled grammar's text (the engine's cache key), or a 400 naming the field."""
    if field_spec is None:
        return None
    from homelab_llm.engine.structured.matcher import compile_grammar

    field, spec = field_spec
    try:
        grammar = to_grammar(spec)
        compile_grammar(tokenizer, grammar)
    except GrammarError as err:
        raise bad_request(f"{field}: {err}", field) from err
    return grammar
