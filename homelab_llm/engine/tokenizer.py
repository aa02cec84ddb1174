"""Tokenizers: HF tokenizer.json, a GGUF file's vocabulary, or raw bytes for dummy models.

    tok = load_tokenizer(path, load_format)
    ids = tok.encode(text); text = tok.decode(ids)
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    detok = IncrementalDetokenizer(tok, prompt_ids); delta = detok.push(new_ids)
"""

from __future__ import annotations

import codecs
from functools import cached_property
from pathlib import Path
from typing import Any

from homelab_llm.engine.model.chat_template import ChatTemplateError, render_chat_template
from homelab_llm.engine.model.config import ModelLoadError, UnsupportedModelError, read_json

__all__ = ["ChatTemplateError", "Tokenizer", "ByteTokenizer", "IncrementalDetokenizer",
           "load_tokenizer"]

# A plain ChatML template for models that ship none (dummy weights, bare tokenizer.json).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, reversed: byte-level BPE token text -> bytes."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: stop ids, chat template, token bytes."""

    def __init__(self, backend: Any, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None, name: str = ""):
        self.backend = backend
        self.name = name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_text = {i: t.content for i, t in added.items()}
        self._byte_level = "ByteLevel" in repr(backend.decoder)

    @property
    def sentencepiece_spaces(self) -> bool:
        """Tokens carry a word-start space (SentencePiece) rather than exact bytes (byte-level)."""
        return not self._byte_level

    # -- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes_table[token_id] if 0 <= token_id < len(self._bytes_table) else b""

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs; a partial UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @cached_property
    def _bytes_table(self) -> list[bytes]:
        """Every token's bytes, built once (~0.1 s for 150K tokens) so detokenizing is a lookup."""
        table: list[bytes] = []
        to_byte = _byte_decoder()
        for i in range(self.vocab_size):
            if i in self._added_text:
                table.append(self._added_text[i].encode())
                continue
            piece = self.backend.id_to_token(i) or ""
            if self._byte_level:
                if all(c in to_byte for c in piece):
                    table.append(bytes(to_byte[c] for c in piece))
                else:  # not a byte-level piece after all: take its text
                    table.append(piece.encode())
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table.append(bytes([int(piece[3:5], 16)]))  # SentencePiece byte fallback
            else:
                table.append(piece.replace("▁", " ").encode())
        return table

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        template = self.chat_template or DEFAULT_CHAT_TEMPLATE
        kwargs.setdefault("bos_token", self.bos_token or "")
        kwargs.setdefault("eos_token", self.eos_token or "")
        return render_chat_template(template, messages, tools, add_generation_prompt, **kwargs)

    @property
    def uses_think_tags(self) -> bool:
        """The template writes or strips <think> blocks (Qwen3, DeepSeek-R1 style reasoning)."""
        return "<think>" in (self.chat_template or "")

    @property
    def tool_call_tags(self) -> tuple[str, str] | None:
        """Hermes-style tool-call markers, if this model uses them."""
        if "<tool_call>" in (self.chat_template or "") or \
                self.backend.token_to_id("<tool_call>") is not None:
            return "<tool_call>", "</tool_call>"
        return None


class ByteTokenizer(Tokenizer):
    """Bytes as tokens (ids 0-255), plus <|bos|> 256 and <|eos|> 257: for dummy-weight models."""

    BOS, EOS = 256, 257

    def __init__(self, vocab_size: int = 258):
        if vocab_size < 258:
            raise UnsupportedModelError(
                f"the byte-level fallback tokenizer needs a vocab of at least 258, got {vocab_size}")
        self.backend = None
        self.name = "bytes"
        self.bos_token, self.eos_token = "<|bos|>", "<|eos|>"
        self.bos_token_id, self.eos_token_ids = self.BOS, (self.EOS,)
        self.chat_template = DEFAULT_CHAT_TEMPLATE
        self.vocab_size = vocab_size
        self.special_ids = frozenset(range(256, vocab_size))
        self._added_text = {self.BOS: self.bos_token, self.EOS: self.eos_token}
        self._byte_level = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.token_bytes(i) for i in ids
                        if not (skip_special_tokens and i in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self._added_text.get(token_id, "").encode()

    @property
    def tool_call_tags(self) -> tuple[str, str] | None:
        return None


class IncrementalDetokenizer:
    """Streams text as tokens arrive: each push costs O(new tokens), and a UTF-8 character split
    across tokens is held back until its last byte arrives."""

    def __init__(self, tok: Tokenizer, prompt_ids: list[int] | tuple[int, ...] = (),
                 skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = tok.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece marks a word start with a space; at the very start of a text it is
        # dropped, as the full decode does.
        self._strip_leading_space = not prompt_ids and tok.sentencepiece_spaces

    def push(self, new_ids: list[int]) -> str:
        data = b"".join(self.tok.token_bytes(i) for i in new_ids if i not in self.skip)
        text = self._utf8.decode(data)
        if self._strip_leading_space and text:
            self._strip_leading_space = False
            text = text[1:] if text.startswith(" ") else text
        return text

    def flush(self) -> str:
        """Whatever incomplete bytes remain, as U+FFFD (call when the sequence ends)."""
        return self._utf8.decode(b"", final=True)


# -- loading ------------------------------------------------------------------------------------
def load_tokenizer(path: str | Path, load_format: str = "auto") -> Tokenizer:
    """A GGUF file's vocabulary, an HF folder's tokenizer.json, or bytes for dummy weights."""
    p = Path(path)
    if p.suffix == ".gguf" or load_format == "gguf":
        return _from_gguf(p)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return _from_hf_folder(p)
    if p.suffix == ".json" and p.is_file() or (p.is_dir() and load_format == "dummy"):
        config = read_json(p if p.suffix == ".json" else p / "config.json")
        return ByteTokenizer(int(config.get("vocab_size", 258)))
    if p.is_dir():
        raise ModelLoadError(f"{p}: no tokenizer.json in this folder (pass --tokenizer FOLDER)")
    raise ModelLoadError(f"{p}: no such file or folder")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _from_hf_folder(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except Exception as err:  # the Rust side raises a bare Exception on bad JSON
        raise ModelLoadError(f"{folder / 'tokenizer.json'}: cannot load ({err})") from None
    cfg_path = folder / "tokenizer_config.json"
    cfg = read_json(cfg_path) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if (folder / "chat_template.jinja").is_file():  # where newer transformers save it
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
    eos_ids = [backend.token_to_id(eos)] if eos and backend.token_to_id(eos) is not None else []
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            eos_ids += _ids(read_json(folder / name).get("eos_token_id"))
    return Tokenizer(backend, bos_token=bos, eos_token=eos,
                     eos_token_ids=tuple(dict.fromkeys(eos_ids)), chat_template=template,
                     name=folder.name)


def _from_gguf(path: Path) -> Tokenizer:
    from homelab_llm.engine.model.gguf_file import open_gguf
    from homelab_llm.engine.model.gguf_tokenizer import GGUFVocab, build_gguf_tokenizer

    gguf = open_gguf(path)
    meta = gguf.metadata()
    model = meta.get("tokenizer.ggml.model")
    tokens = gguf.array("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise UnsupportedModelError(
            f"{path}: this GGUF has no embedded tokenizer; pass --tokenizer with an HF folder")
    n = len(tokens)
    vocab = GGUFVocab(
        model=str(model), pre=str(meta.get("tokenizer.ggml.pre", "default")), tokens=tokens,
        token_types=gguf.array("tokenizer.ggml.token_type") or [1] * n,
        merges=gguf.array("tokenizer.ggml.merges") or [],
        scores=gguf.array("tokenizer.ggml.scores") or [0.0] * n,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
    )
    backend = build_gguf_tokenizer(vocab, str(path))

    def name_of(key: str) -> str | None:
        token_id = meta.get(key)
        return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < n else None

    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    return Tokenizer(backend, bos_token=name_of("tokenizer.ggml.bos_token_id"),
                     eos_token=name_of("tokenizer.ggml.eos_token_id"),
                     eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
                     chat_template=meta.get("tokenizer.chat_template"), name=path.stem)
