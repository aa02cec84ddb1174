"""Sampler and stop handling against hand-computed references (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_llm.engine.layers.sampler import Sampler, _apply_penalties
from homelab_llm.engine.output_processor import OutputProcessor
from homelab_llm.engine.sampling_params import SamplingParams, SamplingParamsError
from homelab_llm.engine.sequence import Sequence

EOS = 0


def seq(params: SamplingParams, prompt=(5, 6, 7), out=(), seed: int = 0) -> Sequence:
    s = Sequence("r", list(prompt), params, 0.0, max_tokens=params.max_tokens or 100)
    s.token_ids.extend(out)
    s.seed = seed
    return s


def draw(sampler: Sampler, logits: torch.Tensor, s: Sequence) -> int:
    """One sample, then advance the sequence as the engine would (new position, new noise)."""
    token = sampler(logits, [s]).token_ids[0]
    s.token_ids.append(token)
    return token


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler((EOS,))(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    seqs = [seq(SamplingParams(temperature=1.7, top_k=1), seed=i) for i in range(4)]
    assert Sampler((EOS,))(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_sampling_follows_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    expected = torch.softmax(logits[0] / 0.8, -1)
    s = seq(SamplingParams(temperature=0.8), seed=3)
    sampler = Sampler((99,))
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[draw(sampler, logits, s)] += 1
    freq = counts / n
    # 4000 draws: standard error <= 0.008; allow 4 sigma.
    assert torch.allclose(freq, expected, atol=0.032), (freq, expected)


def test_same_seed_same_draws_different_seed_different_draws() -> None:
    logits = torch.zeros(1, 1000)
    def draws(seed: int) -> list[int]:
        s = seq(SamplingParams(temperature=1.0, seed=seed), seed=seed)
        return [draw(Sampler((EOS,)), logits, s) for _ in range(20)]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_p_never_samples_outside_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    s = seq(SamplingParams(temperature=1.0, top_p=0.7), seed=4)
    seen = {draw(Sampler((99,)), logits, s) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 so the token crossing the mass (0.3) stays in


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().unsqueeze(0)
    s = seq(SamplingParams(temperature=1.0, min_p=0.3), seed=5)
    seen = {draw(Sampler((99,)), logits, s) for _ in range(300)}
    assert seen == {0, 1}  # 0.3 * 0.6 = 0.18


def test_penalties_match_the_hand_computation() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    # prompt has token 1, output has token 4 twice and token 2 once
    s = seq(params, prompt=(1,), out=(4, 4, 2))
    expected = torch.tensor([1.0, -2.0, 1.0 - 0.5 - 0.25, 0.5, 1.5 - 0.5 - 0.5])
    _apply_penalties(logits, [s])
    assert torch.allclose(logits, expected.unsqueeze(0))


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.full((1, 10), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    logits[0, 4] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert Sampler((EOS,))(logits, [seq(params, out=(4,))]).token_ids == [4]
    assert Sampler((EOS,))(logits, [seq(params, out=(4, 4))]).token_ids == [EOS]


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=3)), seq(SamplingParams(temperature=0.0))]
    res = Sampler((EOS,))(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    lp = res.logprobs[0]
    assert lp is not None and res.logprobs[1] is None
    assert lp.token_id == int(logits[0].argmax())
    assert math.isclose(lp.logprob, float(ref[0, lp.token_id]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == torch.topk(ref[0], 3).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                                         ("min_p", 2.0), ("max_tokens", 0), ("logprobs", 21),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
                                         ("top_k", -2)])
def test_out_of_range_params_name_the_field(field: str, value) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value}).validate()


class CharDetok:
    """Token id -> one character ('a' + id), as an incremental detokenizer would emit."""

    def push(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    def flush(self) -> str:
        return ""


def run_tokens(params: SamplingParams, tokens: list[int]) -> tuple[str, Sequence]:
    proc = OutputProcessor(tokenizer=None, eos_token_ids=(25,), max_model_len=100)
    s = seq(params, prompt=(0,))
    s.detokenizer = CharDetok()
    text = ""
    for t in tokens:
        proc.append_token(s, t, None)
        out = proc.make_output(s)
        if out is not None:
            text += out.new_text
        if s.finish_reason:
            break
    return text, s


def test_stop_string_is_cut_and_never_streamed() -> None:
    # "abcxyd": stop "xy" spans two tokens; the 'x' must be held back, then dropped.
    text, s = run_tokens(SamplingParams(max_tokens=20, stop=["xy"]), [0, 1, 2, 23, 24, 3])
    assert text == "abc" and s.finish_reason == "stop" and s.stop_reason == "xy"


def test_stop_string_kept_when_asked() -> None:
    text, _ = run_tokens(SamplingParams(max_tokens=20, stop=["xy"], include_stop_str_in_output=True),
                         [0, 23, 24, 3])
    assert text == "axy"


def test_held_back_text_is_released_when_it_cannot_be_a_stop() -> None:
    text, s = run_tokens(SamplingParams(max_tokens=4, stop=["xy"]), [23, 0, 1, 2])
    assert text == "xabc" and s.finish_reason == "length"


def test_eos_and_stop_token_ids_finish_without_text() -> None:
    text, s = run_tokens(SamplingParams(max_tokens=20), [0, 1, 25, 2])
    assert text == "ab" and s.finish_reason == "stop" and s.stop_reason is None
    text, s = run_tokens(SamplingParams(max_tokens=20, stop_token_ids=[3]), [0, 3])
    assert text == "a" and s.stop_reason == 3
    text, s = run_tokens(SamplingParams(max_tokens=3, ignore_eos=True), [25, 25, 25, 25])
    assert s.finish_reason == "length" and s.num_output_tokens == 3
