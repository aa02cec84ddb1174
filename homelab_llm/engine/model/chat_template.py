"""Render a model's jinja2 chat template the way transformers' apply_chat_template does.

Templates come from the checkpoint, so they run in jinja2's immutable sandbox. They expect a few
helpers HF provides (raise_exception, strftime_now, a tojson that keeps non-ASCII) and the
{% generation %} tag; a template error becomes a ChatTemplateError the server can report as 400.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from homelab_llm.errors import HomelabError


class ChatTemplateError(HomelabError, ValueError):
    """The chat template rejected the messages (or is itself broken); the message says why."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson this does not HTML-escape: the output is a prompt, not a page.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """{% generation %}...{% endgeneration %} marks assistant text for training masks in HF;
        for inference it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the model's chat template does not compile: {err}") from None


def check_template(source: str) -> None:
    """ChatTemplateError if `source` does not compile as a jinja template."""
    _compile(source)


def render_chat_template(source: str, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None,
                         add_generation_prompt: bool = True, **kwargs: Any) -> str:
    import jinja2

    template = _compile(source)
    try:
        return template.render(messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:
        raise ChatTemplateError(f"chat template failed on these messages: {err}") from None
