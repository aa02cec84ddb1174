"""Tokenizers vs transformers (GGUF vocab and HF folder), chat templates, incremental detokenizing."""

from __future__ import annotations

import json

import pytest

from homelab_llm.engine.model.chat_template import ChatTemplateError, render_chat_template
from homelab_llm.engine.model.config import UnsupportedModelError
from homelab_llm.engine.model.gguf_tokenizer import CONTROL, NORMAL, GGUFVocab, build_gguf_tokenizer
from homelab_llm.engine.tokenizer import (
    ByteTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)

TEXTS = [
    "Hello world",
    "  leading spaces,   runs\n\n\tand tabs\r\n",
    "Ünïcödé — “quotes” 日本語のテキスト 한국어 Ελληνικά",
    "emoji 🎉 family 👩‍👩‍👧 flags 🇫🇷!",
    "def f(x):\n    return x ** 2  # 12345 and 3.14159\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll we've they're",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? ünïcode 🎉"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def ours(smollm2_path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def theirs(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent),
                                                      gguf_file=smollm2_path.name)


def test_gguf_encode_decode_match_transformers(ours, theirs):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    # SmolLM2 pre-tokenizes digits one by one, as llama.cpp's "smollm" and the original do.
    assert len(ours.encode("12345")) == 5


def test_special_tokens_and_ids(ours):
    assert ours.vocab_size == 49152 and ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    assert ours.encode("<|im_end|>") == [2]
    assert ours.token_text(2) == "<|im_end|>" and 2 in ours.special_ids
    assert ours.token_text(ours.encode(" world")[0]) == " world"
    assert not ours.uses_think_tags and ours.tool_call_tags is None


@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, theirs, gen):
    for messages in (CONVERSATION, CONVERSATION[1:]):  # without a system turn it adds its own
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_hf_folder_tokenizer(theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text)
    assert tok.eos_token_ids[0] == 2 and 0 in tok.eos_token_ids
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CONVERSATION) == expected


def test_incremental_detokenizer_holds_back_split_characters(ours):
    text = "é🎉日本 👩‍👩‍👧!"
    ids = ours.encode(text)
    assert len(ids) > len(text) / 2  # several characters span more than one token
    detok = IncrementalDetokenizer(ours, prompt_ids=[1])
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # at least one token ended mid-character and was held back


def test_incremental_detokenizer_cost_is_per_new_token(ours, monkeypatch):
    calls = []
    original = ours.token_bytes
    monkeypatch.setattr(ours, "token_bytes", lambda i: calls.append(i) or original(i))
    detok = IncrementalDetokenizer(ours, prompt_ids=list(range(100)))
    for token in ours.encode("one two three four five six seven"):
        detok.push([token])
    assert len(calls) == len(ours.encode("one two three four five six seven"))


def test_incremental_detokenizer_special_tokens(ours):
    ids = ours.encode("hi<|im_end|>")
    assert IncrementalDetokenizer(ours, [1]).push(ids) == "hi"
    assert IncrementalDetokenizer(ours, [1], skip_special_tokens=False).push(ids) == "hi<|im_end|>"


def test_byte_tokenizer_for_dummy_models(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    tok = load_tokenizer(path, "dummy")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 300
    ids = tok.encode("héllo 🎉")
    assert max(ids) < 256 and tok.decode(ids + [tok.EOS]) == "héllo 🎉"
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push([i]) for i in ids) == "héllo 🎉"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")
    with pytest.raises(UnsupportedModelError, match="at least 258"):
        ByteTokenizer(100)


def test_template_helpers_and_errors():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    source = ("{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
              "{% for t in tools %}{{ t | tojson }}{% endfor %}|{{ strftime_now('%Y') | length }}"
              "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    out = render_chat_template(source, [{"role": "user", "content": "ü"}], tools=tools)
    assert out == json.dumps(tools[0]) + "|4ü"
    with pytest.raises(ChatTemplateError, match="only one message"):
        render_chat_template(source, [{"role": "user", "content": "a"}] * 2)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses to touch Python internals
        render_chat_template("{{ messages.__class__.__mro__ }}", [])


def test_think_and_tool_call_markers(theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    cfg["chat_template"] = "{% for m in messages %}<think>\n</think><tool_call>{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.uses_think_tags and tok.tool_call_tags == ("<tool_call>", "</tool_call>")


def test_sentencepiece_gguf_vocab():
    """A tiny Llama-2 style vocab: merges from scores, byte fallback for unknown characters."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello", "▁w",
             "or", "▁wor", "ld", "▁world"]
    tokens = pieces + words
    types = [2, CONTROL, CONTROL] + [6] * 256 + [NORMAL] * len(words)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))][::-1]
    vocab = GGUFVocab(model="llama", pre="default", tokens=tokens, token_types=types, merges=[],
                      scores=scores, bos_token_id=1, add_bos=True, unk_token_id=0)
    backend = build_gguf_tokenizer(vocab, "spm.gguf")
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", eos_token_ids=(2,),
                    chat_template=None)
    ids = tok.encode("hello world é")
    assert ids[0] == 1 and tokens[ids[1]] == "▁hello" and tokens[ids[2]] == "▁world"
    assert tok.decode(ids) == "hello world é"
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push([i]) for i in ids[1:]) == "hello world é"
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'mystery'"):
        build_gguf_tokenizer(GGUFVocab(model="gpt2", pre="mystery", tokens=["a"], token_types=[1],
                                       merges=[], scores=[0.0], bos_token_id=None, add_bos=False,
                                       unk_token_id=None), "x.gguf")
