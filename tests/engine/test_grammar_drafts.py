"""Grammar-checked speculative drafts and masks computed ahead, below the engine (byte tokenizer,
no model): a constrained draft is cut at the first token the grammar refuses; a verify step's row
j is masked with the grammar after drafts 0..j-1 and leaves the state as it was; masks the
prefetch worker computed equal the ones computed in place and are dropped once the state moves."""

from __future__ import annotations

import json

import torch

from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.spec.config import SpeculativeConfig
from homelab_llm.engine.spec.drafter import Drafter
from homelab_llm.engine.spec.verify import sampler_rows
from homelab_llm.engine.structured.grammar import GrammarSpec, to_grammar
from homelab_llm.engine.structured.matcher import GrammarState, mask_words
from homelab_llm.engine.structured.prefetch import MaskPrefetcher
from tests.engine.test_structured import TOK, allowed, feed

GRAMMAR = to_grammar(GrammarSpec("choice", json.dumps(["abcd", "abxy", "zz"])))


def masks(views, width: int = mask_words(TOK.vocab_size)) -> torch.Tensor:
    out = torch.full((len(views), width), 7, dtype=torch.int32)
    for row, view in enumerate(views):
        view.fill(out, row)
    return out


def reference(prefix: str) -> set[int]:
    st = GrammarState.start(TOK, GRAMMAR, False)
    feed(st, prefix)
    return allowed(st)


def bits(row: torch.Tensor) -> set[int]:
    return {t for t in range(TOK.vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}


def constrained_seq(drafts: list[int]) -> Sequence:
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0.0, grammar=GRAMMAR), 0.0, max_tokens=16)
    seq.grammar = GrammarState.start(TOK, GRAMMAR, False)
    seq.spec_token_ids = drafts
    return seq


class FixedProposer:
    def __init__(self, draft: list[int]) -> None:
        self.draft = draft

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        return self.draft[:k]

    def forget(self, request_id: str) -> None:
        pass


def test_drafts_are_cut_where_the_grammar_refuses() -> None:
    seq = constrained_seq([])
    seq.token_ids.append(ord("a"))  # one output token, so the sequence may draft
    seq.grammar.advance(ord("a"), "a")
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4), FixedProposer(
        [ord(c) for c in "bxq!"]), max_model_len=64)
    drafter.draft([seq])
    assert seq.spec_token_ids == [ord("b"), ord("x")]
    free = Sequence("f", [1, 2, 3], SamplingParams(temperature=0.0), 0.0, max_tokens=16)
    free.token_ids.append(5)
    drafter.draft([free])
    assert free.spec_token_ids == [ord(c) for c in "bxq!"]


def test_verify_rows_are_masked_after_their_drafts() -> None:
    seq = constrained_seq([ord(c) for c in "abx"])
    rows = sampler_rows([seq], [seq.spec_token_ids])
    got = masks([row.grammar for row in rows])
    for j, prefix in enumerate(["", "a", "ab", "abx"]):
        assert bits(got[j]) == reference(prefix), prefix
    assert allowed(seq.grammar) == {ord("a"), ord("z")} and seq.grammar.version == 0


def test_prefetched_masks_equal_in_place_ones_and_go_stale() -> None:
    seq = constrained_seq([ord(c) for c in "ab"])
    views = [row.grammar for row in sampler_rows([seq], [seq.spec_token_ids])]
    in_place = masks(views)
    prefetcher = MaskPrefetcher()
    try:
        prefetcher.start([seq])
        ahead = seq.grammar.prefetched
        assert ahead is not None and ahead.drafts == (ord("a"), ord("b"))
        wide = masks(views, mask_words(TOK.vocab_size) + 2)  # a padded LM head: extra words zero
        assert torch.equal(wide[:, :in_place.shape[1]], in_place) and not wide[:, -2:].any()
        ahead.rows.zero_()  # proof that the sampler reads the prefetched rows, not fresh ones
        assert not masks(views).any()
        seq.grammar.advance(ord("z"), "z")  # the state moved: the prefetched rows are stale
        assert bits(masks([seq.grammar])[0]) == reference("z")
        seq.spec_token_ids = []
        prefetcher.start([seq])
        assert seq.grammar.prefetched.version == seq.grammar.version
        assert bits(masks([seq.grammar])[0]) == reference("z")
    finally:
        prefetcher.close()
