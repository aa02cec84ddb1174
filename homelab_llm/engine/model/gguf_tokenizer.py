"""Build a `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file.

Two GGUF tokenizer models: "gpt2" (byte-level BPE with merges: SmolLM2, Llama 3, Qwen2/3) and
"llama" (SentencePiece BPE with scores and byte fallback: Llama 2, Mistral v0.1-0.3). The
pre-tokenizer split is chosen by tokenizer.ggml.pre, mirroring llama.cpp's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from homelab_llm.engine.model.config import UnsupportedModelError

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regex or None for GPT-2's, digits one at a time first)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False), "gpt2": (None, False), "gpt-2": (None, False), "mpt": (None, False),
    "olmo": (None, False), "jais": (None, False),
    "smollm": (None, True), "starcoder": (None, True), "refact": (None, True),
    "command-r": (None, True), "codeshell": (None, True), "exaone": (None, True),
    "llama-bpe": (_LLAMA3_SPLIT, False), "llama3": (_LLAMA3_SPLIT, False),
    "dbrx": (_LLAMA3_SPLIT, False), "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False), "stablelm2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "tekken": (_TEKKEN_SPLIT, False),
}


@dataclass
class GGUFVocab:
    model: str  # "gpt2" | "llama"
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float]
    bos_token_id: int | None
    add_bos: bool
    unk_token_id: int | None
    add_space_prefix: bool = True


def _byte_level_bpe(v: GGUFVocab, where: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if v.pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{where}: GGUF pre-tokenizer {v.pre!r} is not supported; "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
    split, digits = _PRE_TOKENIZERS[v.pre]
    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in v.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split is _LLAMA3_SPLIT))
    steps: list[Any] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(v: GGUFVocab):
    """SentencePiece BPE rebuilt as HF BPE: merges ranked by the merged piece's score."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    ranked: list[tuple[float, int, str, str]] = []
    for piece, pid in vocab.items():
        if v.token_types[pid] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-v.scores[pid], pid, left, right))
    ranked.sort()
    unk = v.tokens[v.unk_token_id] if v.unk_token_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked],
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if v.add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def build_gguf_tokenizer(v: GGUFVocab, where: str):
    """-> tokenizers.Tokenizer with special tokens registered and BOS added if the file says so."""
    from tokenizers import AddedToken, processors

    if v.model == "gpt2":
        tok = _byte_level_bpe(v, where)
    elif v.model == "llama":
        tok = _sentencepiece_bpe(v)
    else:
        raise UnsupportedModelError(
            f"{where}: GGUF tokenizer model {v.model!r} is not supported; supported: gpt2, llama")
    # Control tokens are special (skipped when decoding with skip_special_tokens); user-defined
    # ones are only matched whole in the input text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(v.tokens, v.token_types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(v.tokens, v.token_types) if ty == USER_DEFINED])
    if v.add_bos and v.bos_token_id is not None:
        bos = v.tokens[v.bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, v.bos_token_id)])
    return tok
