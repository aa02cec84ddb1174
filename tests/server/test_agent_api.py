"""The agent turn and vLLM's serving surface, without a model: assistant tool calls with null
content and tool results render through tool-aware templates exactly as transformers renders them
and through tool-less ones (SmolLM2's) in the Hermes form; `vllm serve` flags parse with their
meaning; GET /v1/models/{id}; --max-logprobs; the two-turn conversation over the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest

from homelab_llm.cli import build_parser
from homelab_llm.errors import HomelabError
from homelab_llm.server import vllm_flags
from homelab_llm.server.command import resolve_args
from homelab_llm.server.protocol import ChatCompletionRequest
from homelab_llm.server.tool_template import adapt_messages
from homelab_llm.engine.model.chat_template import render_chat_template
from tests.server.conftest import fake_server, in_thread_engine, openai_client

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TURN = [{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]

# Written for these tests in the shapes the families' templates take (not copies of them): a
# Hermes/Qwen-style one, a Llama-3.1-style JSON one, a Mistral-style one, and SmolLM2's (which
# knows nothing of tools and joins strings with +).
HERMES = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA = """{{- bos_token }}{%- if tools %}{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}{%- for message in messages %}
{%- if 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{- message.content | tojson }}{{- "<|eot_id|>" }}
{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
MISTRAL = """{{- bos_token }}{%- if tools %}{{- "[AVAILABLE_TOOLS]" + tools | tojson + "[/AVAILABLE_TOOLS]" }}{%- endif %}{%- for message in messages %}
{%- if message.role == "user" %}{{- "[INST]" + message.content + "[/INST]" }}
{%- elif message.role == "assistant" and message.tool_calls %}{{- "[TOOL_CALLS][" }}
{%- for tc in message.tool_calls %}{{- {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}{% endfor %}{{- "]" + eos_token }}
{%- elif message.role == "tool" %}{{- "[TOOL_RESULTS]" + message.content + "[/TOOL_RESULTS]" }}
{%- elif message.role == "assistant" %}{{- message.content + eos_token }}{% endif %}{%- endfor %}"""
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def server_messages(messages: list[dict]) -> list[dict]:
    return ChatCompletionRequest(messages=messages, tools=TOOLS).template_messages()


@pytest.mark.parametrize("template", [HERMES, LLAMA, MISTRAL], ids=["hermes", "llama3", "mistral"])
def test_tool_turn_renders_as_transformers_does(template: str) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    hf_messages = json.loads(json.dumps(TURN))  # HF's documented form: arguments as an object
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    kwargs = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    expect = render_jinja_template([hf_messages], tools=TOOLS, chat_template=template, **kwargs)[0][0]
    ours = render_chat_template(template, adapt_messages(template, server_messages(TURN), TOOLS),
                                TOOLS, **kwargs)
    assert ours == expect
    assert "Oslo" in ours and "temp" in ours


def test_tool_turn_through_a_template_without_tools() -> None:
    text = render_chat_template(SMOLLM2, adapt_messages(SMOLLM2, server_messages(TURN), TOOLS), TOOLS)
    assert '<|im_start|>system\nYou may call' in text and '"get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>tool\n{"temp": 3}<|im_end|>' in text


def test_vllm_flags_keep_their_meaning(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(HERMES)
    argv = ["serve", "--chat-template", str(path), "--enable-auto-tool-choice", "--tool-call-parser",
            "hermes", "--reasoning-parser", "qwen3", "--trust-remote-code", "--disable-log-requests",
            "--max-logprobs", "5"]
    flags = vllm_flags.resolve(resolve_args(build_parser(argv).parse_args(argv)))
    assert flags == vllm_flags.VllmFlags(chat_template=HERMES, reasoning_parser="qwen3",
                                         tool_call_parser="hermes", max_logprobs=5)
    for name in ("llama3_json", "mistral"):
        argv = ["serve", "--tool-call-parser", name]
        assert vllm_flags.resolve(resolve_args(build_parser(argv).parse_args(argv))).tool_call_parser == name
    inline = ["serve", "--chat-template", SMOLLM2]
    assert vllm_flags.resolve(resolve_args(build_parser(inline).parse_args(inline))).chat_template == SMOLLM2
    for bad, needle in ((["--max-logprobs", "99"], "--max-logprobs"),
                        (["--chat-template", "{% if %}"], "--chat-template"),
                        (["--chat-template", str(tmp_path / "missing.jinja")], "cannot read")):
        argv = ["serve", *bad]
        with pytest.raises(HomelabError, match=needle):
            vllm_flags.resolve(resolve_args(build_parser(argv).parse_args(argv)))


@pytest.fixture(scope="module")
def running():
    with fake_server(max_logprobs=2) as r:
        yield r


def test_model_by_id(running) -> None:
    client = openai_client(running)
    assert client.models.retrieve("fake-alias").id == "fake-alias"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_max_logprobs_is_enforced(running) -> None:
    client = openai_client(running)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.chat.completions.create(model="fake", messages=TURN[:1], logprobs=True,
                                       top_logprobs=3, max_tokens=2)


def test_two_turn_conversation_over_the_sdk(running) -> None:
    client = openai_client(running)
    out = client.chat.completions.create(model="fake", messages=TURN + [
        {"role": "user", "content": "SAY[[It is 3 degrees.]]"}], tools=TOOLS, max_tokens=20)
    assert out.choices[0].message.content == "It is 3 degrees."


RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_responses_text_and_previous_response_id(running) -> None:
    client = openai_client(running)
    first = client.responses.create(model="fake", input="SAY[[Hi there.]]", max_output_tokens=20)
    assert first.status == "completed" and first.output_text == "Hi there."
    second = client.responses.create(model="fake", input="SAY[[Again.]]",
                                     previous_response_id=first.id, max_output_tokens=20)
    assert second.output_text == "Again." and second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="fake", input="x", previous_response_id="resp_nope")


def test_responses_tools_and_the_result_turn(running) -> None:
    client = openai_client(running)
    first = client.responses.create(model="fake", input=f"SAY[[{HERMES_CALL}]]", tools=RESP_TOOLS,
                                    max_output_tokens=200)
    call = first.output[0]
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})
    second = client.responses.create(model="fake", previous_response_id=first.id, tools=RESP_TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 3}'},
        {"role": "user", "content": "SAY[[3 degrees.]]"}], max_output_tokens=20)
    assert second.output_text == "3 degrees."


def test_responses_stream_events(running) -> None:
    client = openai_client(running)
    events = list(client.responses.create(model="fake", input=f"SAY[[Look: {HERMES_CALL}]]",
                                          tools=RESP_TOOLS, max_output_tokens=200, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").strip() == "Look:"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Oslo"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("kwargs, grammar_has", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}, '"n"'),
    ({"response_format": {"type": "json_object"}}, "object"),
    ({"extra_body": {"guided_choice": ["yes", "no"]}}, '"yes"'),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}}, "[0-9]"),
    ({"extra_body": {"guided_grammar": 'root ::= "a" | "b"'}}, '"a"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
      "tool_choice": "required"}, "<tool_call>"),
])
def test_constraints_reach_the_engine(running, kwargs, grammar_has) -> None:
    client = openai_client(running)
    client.chat.completions.create(model="fake", messages=TURN[:1], max_tokens=4, **kwargs)
    params = in_thread_engine(running).last_params
    assert params.grammar is not None and grammar_has in params.grammar


@pytest.mark.parametrize("kwargs, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format: the JSON schema.*strnig"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex: "),
    ({"extra_body": {"guided_grammar": "root ::= undefined"}}, "guided_grammar: "),
    ({"extra_body": {"guided_choice": []}}, "non-empty"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
     "one output constraint.*response_format, guided_regex"),
])
def test_bad_constraints_are_400s_naming_the_field(running, kwargs, needle) -> None:
    client = openai_client(running)
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(model="fake", messages=TURN[:1], max_tokens=4, **kwargs)
    with pytest.raises(openai.BadRequestError):  # completions reads the same fields
        client.completions.create(model="fake", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a(b"})
