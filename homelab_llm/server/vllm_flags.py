"""`vllm serve` flags people paste from guides, accepted with vLLM's meaning where it applies here.

| flag | here |
| --- | --- |
| `--chat-template PATH_OR_TEXT` | replaces the model's chat template (a file, or the template itself) |
| `--enable-auto-tool-choice` | accepted; tool calls are always parsed when a request sends tools |
| `--tool-call-parser hermes/qwen` | the Hermes `<tool_call>` parser (what Qwen2.5/3, Hermes, SmolLM2 use; the default) |
| `--tool-call-parser llama3_json` | Llama 3.1+ JSON calls, `<|python_tag|>` optional, several joined by `;` |
| `--tool-call-parser mistral` | `[TOOL_CALLS]` + a JSON list of calls, or `[TOOL_CALLS]name[ARGS]{...}` |
| `--reasoning-parser deepseek_r1/qwen3` | `<think>` text goes to `reasoning_content` even when the template does not show think tags |
| `--trust-remote-code` | accepted and ignored: no model code is ever run, only weights are read |
| `--disable-log-requests` | accepted and ignored: request bodies are never logged |
| `--max-logprobs N` | a request asking for more top logprobs than N gets a 400 (vLLM's default 20) |

The parser also decides how a forced call (`tool_choice` "required" or a named function) is
written, so it always parses (server/tool_parser.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from homelab_llm.errors import HomelabError
from homelab_llm.server.tool_parser import TOOL_FORMATS

TOOL_PARSERS = tuple(TOOL_FORMATS)
REASONING_PARSERS = ("deepseek_r1", "qwen3")
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class VllmFlags:
    chat_template: str | None = None  # the template text, read from the file when given a path
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    max_logprobs: int = MAX_LOGPROBS


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vllm compatibility")
    g.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="use this jinja chat template instead of the model's (a file or the text)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool calls are always parsed")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="how the model writes tool calls: hermes/qwen <tool_call> blocks (the "
                        "default), llama3_json, mistral [TOOL_CALLS]")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="route <think>...</think> to reasoning_content")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted and ignored: no model code is run")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted and ignored: request bodies are never logged")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                   help=f"most top logprobs a request may ask for (default {MAX_LOGPROBS})")


def resolve(args: argparse.Namespace) -> VllmFlags:
    """Check the flags (one-line HomelabErrors naming the flag) and read --chat-template."""
    parser = getattr(args, "tool_call_parser", None)
    if parser is not None and parser not in TOOL_FORMATS:  # argparse checks; a preset may not
        raise HomelabError(f"--tool-call-parser {parser} is unknown; one of {', '.join(TOOL_FORMATS)}")
    max_logprobs = getattr(args, "max_logprobs", MAX_LOGPROBS)
    if not 0 <= max_logprobs <= MAX_LOGPROBS:
        raise HomelabError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {max_logprobs}")
    template = getattr(args, "chat_template", None)
    if template is not None:
        path = Path(template).expanduser()
        looks_like_path = "{" not in template and len(template) < 4096
        if looks_like_path:
            try:
                template = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise HomelabError(f"--chat-template {path}: cannot read it ({err})") from err
        from homelab_llm.engine.model.chat_template import ChatTemplateError, check_template

        try:
            check_template(template)
        except ChatTemplateError as err:
            raise HomelabError(f"--chat-template: {err}") from err
    return VllmFlags(chat_template=template, reasoning_parser=getattr(args, "reasoning_parser", None),
                     tool_call_parser=parser,
                     max_logprobs=max_logprobs)
