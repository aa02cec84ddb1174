"""Agent turns for chat templates that know nothing of tools (SmolLM2's, plain ChatML).

A template that handles tools (Qwen2.5/3, Llama 3.1+, Mistral, Hermes) gets the messages as HF's
apply_chat_template would pass them. A template that never reads `tool_calls` would drop the
assistant's calls (or fail on `'...' + None`), and one that never reads `tools` would hide the
tools from the model. For those, and only those, the turn is written in the Hermes form our tool
parser reads (`server/tool_hermes.py`): the tools go into the system message, an assistant's calls
become `<tool_call>` blocks in its content, and a missing content becomes "".
"""

from __future__ import annotations

import json
from typing import Any

from homelab_llm.server.tool_hermes import CLOSE, OPEN

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are listed "
    "in <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "JSON object with the function name and arguments within " + OPEN + CLOSE + " XML tags:\n"
    + OPEN + '\n{{"name": <function-name>, "arguments": <args-json-object>}}\n' + CLOSE)


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    arguments = fn.get("arguments")
    return (f'{OPEN}\n{json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)}'
            f"\n{CLOSE}")


def adapt_messages(template: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` as this template can render them (unchanged for tool-aware templates)."""
    out = messages
    if "tool_calls" not in template:
        out = []
        for message in messages:
            item = dict(message)
            calls = item.pop("tool_calls", None)
            if calls:
                text = item.get("content") or ""
                item["content"] = "\n".join([text] * bool(text) + [_call_block(c) for c in calls])
            if item.get("content") is None:
                item["content"] = ""
            out.append(item)
    if tools and "tools" not in template:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out = [{**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}] + out[1:]
        else:
            out = [{"role": "system", "content": preamble}] + out
    return out
