"""The tool-call parsers, by the names `--tool-call-parser` takes (vLLM's spelling), in one table.

Each entry says how to read a model's calls (a streaming parser: server/tool_call.py's ToolParser)
and how a constrained call is written (`tool_choice` "required" or a named function: the grammar
wraps one call object in `call_open` ... `call_close`, its arguments under `args_key`), so a forced
call always comes back in the form the same parser reads. `keep_special_tokens`: the format's
markers are special tokens (Mistral's [TOOL_CALLS]) that detokenizing would otherwise drop.
Without the flag, requests with tools use hermes (what SmolLM2, Qwen and Hermes models write).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from homelab_llm.server.tool_call import ToolCall, ToolParser
from homelab_llm.server.tool_hermes import CLOSE, OPEN, HermesToolParser
from homelab_llm.server.tool_json import TOOL_CALLS, Llama3JsonToolParser, MistralToolParser


@dataclass(frozen=True)
class ToolFormat:
    make: Callable[[], ToolParser]
    call_open: str
    call_close: str
    args_key: str = "arguments"
    keep_special_tokens: bool = False


_HERMES = ToolFormat(HermesToolParser, OPEN + "\n", "\n" + CLOSE)

TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": _HERMES,
    "qwen": _HERMES,
    "qwen25": _HERMES,
    "llama3_json": ToolFormat(Llama3JsonToolParser, "", "", args_key="parameters"),
    "mistral": ToolFormat(MistralToolParser, TOOL_CALLS + "[", "]", keep_special_tokens=True),
}
DEFAULT_TOOL_PARSER = "hermes"


def tool_format(name: str | None) -> ToolFormat:
    return TOOL_FORMATS[name or DEFAULT_TOOL_PARSER]


def parse_tool_calls(text: str, parser: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole output: the concatenation of its streamed pieces."""
    stream = tool_format(parser).make()
    a, b = stream.push(text), stream.flush()
    content = a.content + b.content
    return (content or None), a.calls + b.calls
