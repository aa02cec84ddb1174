"""Compiled grammars and the per-sequence matcher state the sampler and output processor use.

    compile_grammar(tokenizer, grammar)      # off the engine loop (the server's prepare thread);
                                             # cached by grammar text: later calls are lookups
    state = GrammarState.start(tokenizer, grammar, after_think)   # engine.add_request: a copy
    state.fill(mask, row)                     # sampler: this row's allowed tokens (bitmask)
    state.after(drafts[:j]).fill(mask, row)   # sampler, verify step: the row after j drafts
    state.advance(token, output_text)         # output processor: after the token is appended
    accepted = state.check_draft(tokens)      # speculative decoding: longest valid draft prefix

Invariants: a state's matcher has consumed exactly the sequence's output tokens since it became
active (a draft row's mask consumes the drafts before it and rolls them back at once); a matcher
in an error state (it cannot happen through the mask, only through a caller's token) or stopped
allows only end-of-sequence, so a broken request ends instead of spinning. Masks may be computed
ahead on a worker thread (structured/prefetch.py): every method that reads or moves the matcher
first waits for that work (`settle`), and a prefetched mask is used only while the state's
`version` (bumped by every advance and rollback) and drafts are the ones it was computed for. With
`after_think` the grammar waits, unmasked, until the output holds `</think>` (reasoning models
think freely, then answer in the grammar). llguidance drops the GIL while it compiles and fills
masks, so the event loop and other threads keep running.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from homelab_llm.engine.structured.grammar import GrammarError

THINK_END = "</think>"


class _TokenTable:
    """The attributes llguidance's TokenizerWrapper reads, from the engine's own tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Any) -> Any:
    """The llguidance view of a tokenizer (seconds at 150K+ tokens: built once, off the loop)."""
    import llguidance

    table = _TokenTable(tokenizer)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(table),
                                  eos_token=list(tokenizer.eos_token_ids) or None)


@functools.lru_cache(maxsize=256)
def compile_grammar(tokenizer: Any, grammar: str) -> Any:
    """A fresh matcher for `grammar`, kept as the template later requests copy; GrammarError
    (naming the problem) if llguidance refuses it."""
    import llguidance

    lltok = ll_tokenizer(tokenizer)
    err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    if err and not err.startswith("WARNING"):
        raise GrammarError(f"the constraint is not a valid grammar: {err}")
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"the constraint is not a valid grammar: {matcher.get_error()}")
    return matcher


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask."""
    return (vocab_size + 31) // 32


@dataclass
class PrefetchedMasks:
    """Rows computed ahead: row j is the mask after drafts[:j], for the state at `version`."""
    version: int
    drafts: tuple[int, ...]
    rows: torch.Tensor
    done: Future


@dataclass(eq=False)
class GrammarState:
    matcher: Any
    eos_token_ids: tuple[int, ...]
    words: int  # mask words the tokenizer's vocabulary fills; a padded LM head has more
    active: bool = True  # False while a reasoning section is still open
    version: int = 0  # bumped whenever the matcher moves: prefetched masks older than it are stale
    prefetched: PrefetchedMasks | None = field(default=None, repr=False)

    @classmethod
    def start(cls, tokenizer: Any, grammar: str, after_think: bool) -> GrammarState:
        return cls(compile_grammar(tokenizer, grammar).deep_copy(), tuple(tokenizer.eos_token_ids),
                   mask_words(tokenizer.vocab_size), active=not after_think)

    def settle(self) -> None:
        """Wait until no worker is computing masks from this matcher."""
        if self.prefetched is not None:
            self.prefetched.done.result()

    def fill(self, mask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed tokens into `mask[row]` (int32 bits, CPU tensor)."""
        self.fill_after((), mask, row)

    def after(self, drafts: tuple[int, ...]) -> GrammarView:
        return GrammarView(self, drafts)

    def fill_after(self, drafts: tuple[int, ...], mask: torch.Tensor, row: int) -> None:
        """`mask[row]`: the allowed tokens once `drafts` (grammar-checked) follow the output."""
        ahead = self.prefetched
        if ahead is not None and ahead.version == self.version and ahead.drafts[:len(drafts)] == drafts:
            ahead.done.result()
            mask[row, :ahead.rows.shape[1]] = ahead.rows[len(drafts)]
            mask[row, ahead.rows.shape[1]:].zero_()
            return
        self.settle()
        consumed = 0
        try:
            while consumed < len(drafts) and self._consume(drafts[consumed]):
                consumed += 1
            if consumed == len(drafts):
                self._compute_row(mask, row)
            else:  # past the grammar's end: a row no verify step keeps a token from
                self._eos_only(mask, row)
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def compute_rows(self, rows: torch.Tensor, drafts: tuple[int, ...] = ()) -> None:
        """Row j of `rows` = the mask after drafts[:j] (len(drafts) + 1 rows), as `fill_after`
        writes it. The caller owns the matcher meanwhile (the prefetch worker, between settles)."""
        consumed = 0
        try:
            for j in range(len(drafts) + 1):
                if consumed < j:
                    self._eos_only(rows, j)
                    continue
                self._compute_row(rows, j)
                if j < len(drafts) and self._consume(drafts[j]):
                    consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def _consume(self, token: int) -> bool:
        """Consume one draft token if the grammar takes it (never entering the error state)."""
        if not self.active or self.matcher.is_stopped() or self.matcher.validate_tokens([token]) != 1:
            return False
        return self.matcher.consume_token(token)

    def _compute_row(self, rows: torch.Tensor, j: int) -> None:
        if not self.active:
            rows[j].fill_(-1)
            return
        if self.matcher.is_error() or self.matcher.is_stopped():
            self._eos_only(rows, j)
            return
        # Tokens past the tokenizer's vocabulary (LM-head padding) are never allowed.
        rows[j, self.words:].zero_()
        self.matcher.unsafe_compute_mask_ptr(rows[j].data_ptr(), self.words * 4)

    def _eos_only(self, rows: torch.Tensor, j: int) -> None:
        rows[j].zero_()
        for token in self.eos_token_ids:
            rows[j, token // 32] |= _bit(token % 32)

    def advance(self, token: int, output_text: str) -> None:
        """The sequence appended `token` (its text is already in `output_text`)."""
        self.settle()
        self.version += 1
        if not self.active:
            self.active = THINK_END in output_text
            return
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    def check_draft(self, tokens: list[int]) -> int:
        """How many of `tokens` (a speculative draft, in order) the grammar accepts from here,
        without changing the state (the verifier advances with the tokens it keeps). While a
        reasoning section is open no draft is taken: the grammar would start somewhere inside it."""
        if not self.active:
            return 0
        self.settle()
        return self.matcher.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed tokens (rejected speculative tokens)."""
        if self.active and num_tokens:
            self.settle()
            self.version += 1
            self.matcher.rollback(num_tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing more may follow (only end-of-sequence is allowed)."""
        if not self.active:
            return False
        self.settle()
        return self.matcher.is_stopped()


@dataclass(frozen=True)
class GrammarView:
    """A state as a verify step's draft row sees it: after `drafts` more tokens. Has what the
    sampler reads of a GrammarState (`words`, `fill`)."""
    state: GrammarState
    drafts: tuple[int, ...]

    @property
    def words(self) -> int:
        return self.state.words

    def fill(self, mask: torch.Tensor, row: int) -> None:
        self.state.fill_after(self.drafts, mask, row)


def _bit(index: int) -> int:
    # int32 words: bit 31 is the sign bit.
    return -(1 << 31) if index == 31 else 1 << index


__all__ = ["GrammarError", "GrammarState", "GrammarView", "PrefetchedMasks", "compile_grammar",
           "ll_tokenizer", "mask_words"]
