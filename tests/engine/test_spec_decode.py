"""Speculative decoding (n-gram drafts, verify in one forward, rollback): the output equals the
run without speculation token for token (greedy and seeded sampling, batched, chunked prefill,
prefix caching, async scheduling forced on), drafts are really verified and accepted, no KV page
leaks, the point-mass rejection rule keeps the distribution (chi-square), and TP=2 equals TP=1."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from homelab_llm.engine.args import EngineArgs
from homelab_llm.engine.llm import LLM
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.spec.config import SpeculativeConfigError, parse_speculative_config
from homelab_llm.engine.spec.ngram import NgramProposer, find_draft
from homelab_llm.engine.spec.verify import accept, residual_sample
from tests.engine.engine_fixtures import prompts, tiny_llm, write_config

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1})


def _copy_heavy(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so the lookup finds matches (a random model often loops)."""
    return [p + p[: len(p) // 2] + p for p in prompts(n, seed=seed, lo=4, hi=20)]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=4, repetition_penalty=1.2,
                       ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5, stop_token_ids=[7, 9, 11]),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True),
    ]


def _run(llm: LLM, ps, params) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, [(lp.token_id, round(lp.logprob, 5)) for lp in o.logprobs])
            for o in llm.generate(ps, params)]


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    pool = engine.kv.pool
    if engine.kv.radix is not None:
        engine.kv.radix.evict(pool.num_pages)
    assert pool.num_free == pool.num_pages, (pool.num_free, pool.num_pages)


# -- flag -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,needle", [
    ("{", "not valid JSON"), ("[1]", "JSON object"), ('{"method": "eagle"}', '"method"'),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "<= 16"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "only apply"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": "4"}', "disable_by_batch_size"),
])
def test_bad_configs_are_one_line_errors(text: str, needle: str) -> None:
    with pytest.raises(SpeculativeConfigError) as err:
        EngineArgs(model="x", speculative_config=text).validate()
    assert needle in str(err.value) and "--speculative-config" in str(err.value)
    assert "\n" not in str(err.value)


def test_metrics_and_status_carry_spec_decode() -> None:
    from homelab_llm.server.metrics import render_metrics
    from homelab_llm.server.stats import ServerStats
    from homelab_llm.server.status import build_status
    from homelab_llm.engine.spec.stats import SpecDecodeStats

    stats = SpecDecodeStats(3)
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(0, 0)  # a sequence without drafts in a verify step counts nothing
    section = stats.as_dict()
    assert section == {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 2, "acceptance_rate": 0.3333,
                       "mean_accepted_length": 2.0, "accepted_per_position": [1, 1, 0]}
    text = render_metrics({"spec_decode": section}, ServerStats(), "m")
    assert 'homelab_llm:spec_decode_num_drafts_total{model_name="m"} 2' in text
    assert 'homelab_llm:spec_decode_num_draft_tokens_total{model_name="m"} 6' in text
    assert 'homelab_llm:spec_decode_num_accepted_tokens_total{model_name="m"} 2' in text
    assert 'homelab_llm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1' in text
    assert build_status({"spec_decode": section}, ServerStats())["spec_decode"] == section
    assert "spec_decode" not in build_status({}, ServerStats())
    assert "spec_decode" not in render_metrics({}, ServerStats(), "m")


def test_config_defaults_follow_vllm() -> None:
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 5)
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 4)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert cfg.disable_by_batch_size == 0 and cfg.drafts_in_batch(10_000)
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}')
    assert cfg.disable_by_batch_size == 0
    cfg = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 4}')
    assert cfg.disable_by_batch_size == 4 and cfg.drafts_in_batch(4) and not cfg.drafts_in_batch(5)


def test_disable_by_batch_size_drafts_nothing_in_larger_batches(tmp_path: Path) -> None:
    """vLLM's disable_by_batch_size: the drafter gives no sequence a draft while more are running;
    the output still equals the run without speculation, and the batch drafts again once it
    shrinks (requests of different lengths), so some steps verify and some do not."""
    from homelab_llm.engine.sequence import Sequence
    from homelab_llm.engine.spec.drafter import make_drafter

    drafter = make_drafter(parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "disable_by_batch_size": 2}'), 64)
    seqs = [Sequence(str(i), [4, 5, 6, 4, 5], SamplingParams(temperature=0.0), 0.0, max_tokens=16) for i in range(3)]
    for seq in seqs:
        seq.token_ids.append(6)  # one output token: 5, 6 matched earlier, so "4, 5" is the draft
    drafter.draft(seqs)
    assert [seq.spec_token_ids for seq in seqs] == [[], [], []]
    drafter.draft(seqs[:2])
    assert [seq.spec_token_ids for seq in seqs[:2]] == [[4, 5, 6], [4, 5, 6]]
    ps = _copy_heavy(4, seed=7)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 10, 24, 28)]
    want = _run(tiny_llm(tmp_path, max_num_seqs=4), ps, params)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    llm = tiny_llm(tmp_path, max_num_seqs=4, speculative_config=spec)
    assert _run(llm, ps, params) == want
    drafts = llm.engine.status()["spec_decode"]["drafts"]
    _assert_no_leak(llm)
    always = tiny_llm(tmp_path, max_num_seqs=4, speculative_config=json.dumps(
        {k: v for k, v in json.loads(spec).items() if k != "disable_by_batch_size"}))
    assert _run(always, ps, params) == want
    assert 0 < drafts < always.engine.status()["spec_decode"]["drafts"]


# -- proposer and acceptance ----------------------------------------------------------------------
def _naive_draft(t: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Reference: longest n in [min_n, max_n] whose suffix occurs earlier; the latest such
    occurrence with k tokens after it, else the earliest."""
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        tail = t[len(t) - n:]
        ends = [e for e in range(n - 1, len(t) - 1) if t[e - n + 1:e + 1] == tail]
        if ends:
            full = [e for e in ends if e + k <= len(t) - 1]
            start = (full[-1] if full else ends[0]) + 1
            return t[start:start + k]
    return []


def test_ngram_matches_the_naive_search() -> None:
    rng = random.Random(0)
    for _ in range(300):
        t = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randrange(1, 5), rng.randrange(1, 3)
        hi = lo + rng.randrange(0, 3)
        assert find_draft(np.array(t), k, hi, lo) == _naive_draft(t, k, hi, lo), (t, k, hi, lo)


def test_ngram_proposer_grows_its_buffer() -> None:
    prop = NgramProposer(3, 2, 1)
    toks = [5, 6, 7, 8, 5, 6]
    assert prop.propose("a", toks, 3) == [7, 8, 5]
    toks += [7] * 300 + [1, 2, 3, 1, 2]
    assert prop.propose("a", toks, 2) == [3, 1]
    prop.forget("a")
    assert prop.propose("a", [1, 2, 3], 3) == []


def test_accept_keeps_the_agreeing_prefix_and_the_next_token() -> None:
    assert accept([4, 5, 9, 7, 1], [[4, 5, 6], [1]]) == [[4, 5, 9], [1]]
    assert accept([4, 5, 6, 8], [[4, 5, 6]]) == [[4, 5, 6, 8]]
    assert accept([3], [[]]) == [[3]]


def _chi2(counts: np.ndarray, expected: np.ndarray) -> float:
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_point_mass_rejection_sampling_keeps_the_distribution() -> None:
    """Both forms of the rule (explicit residual draw, and sample-then-compare) reproduce p."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, generator=gen) * 1.5, dim=0)
    n, draft = 20000, int(torch.argmax(probs))
    residual = np.bincount([residual_sample(probs, draft, gen) for _ in range(n)], minlength=8)
    # chi-square with 7 degrees of freedom: 24.3 is the 0.1 % tail; a broken rule is far off.
    assert _chi2(residual, probs.numpy() * n) < 24.3


# -- engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_kw", [
    dict(max_num_seqs=4, enable_prefix_caching=False),
    dict(max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=True),  # chunked prefill
])
def test_ngram_output_equals_no_speculation(tmp_path: Path, engine_kw: dict) -> None:
    ps = _copy_heavy(5, seed=1) + prompts(2, seed=5)  # copy-heavy and plain prompts
    params = _params()
    want = _run(tiny_llm(tmp_path, **engine_kw), ps, params)
    llm = tiny_llm(tmp_path, speculative_config=NGRAM, **engine_kw)
    llm.engine._async = True  # forced on: speculation must turn the run-ahead off by itself
    got = _run(llm, ps, params)
    assert got == want
    stats = llm.engine.status()["spec_decode"]
    assert stats["drafts"] > 0 and 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"]
    _assert_no_leak(llm)
    # The same prompts again hit the prefix cache, which never saw a rejected token.
    if llm.engine.kv.radix is not None:
        assert _run(llm, ps, params) == want
        _assert_no_leak(llm)


def test_single_request_near_the_context_limit(tmp_path: Path) -> None:
    """Drafts shrink to the room left: max_tokens and max_model_len are never overshot."""
    p = [9, 10, 11, 12] * 6
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _run(tiny_llm(tmp_path, max_model_len=64), [p], [params])
    llm = tiny_llm(tmp_path, max_model_len=64, speculative_config=NGRAM)
    got = _run(llm, [p], [params])
    assert got == want and len(got[0][0]) == 40
    _assert_no_leak(llm)


def test_sampling_distribution_and_seeds(tmp_path: Path) -> None:
    """Many seeds on a tiny-vocabulary model: the tokens drawn at the drafted positions follow the
    non-speculative sampler's distribution (chi-square), and each seed reproduces exactly."""
    vocab = 12
    (tmp_path / "tok").mkdir()
    tokenizer = str(write_config(tmp_path / "tok"))  # the byte tokenizer wants >= 258 ids
    path = write_config(tmp_path, {"vocab_size": vocab})
    common = dict(load_format="dummy", device="cpu", dtype="float32", page_size=4, seed=0,
                  max_num_seqs=120, max_num_batched_tokens=1024, kv_cache_memory_bytes=4 << 20, tokenizer=tokenizer)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    n = 240
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    other_seeds = [SamplingParams(max_tokens=5, temperature=1.0, seed=10_000 + s, ignore_eos=True)
                   for s in range(n)]
    base = LLM(str(path), **common)
    plain = [o.token_ids for o in base.generate([prompt] * n, other_seeds)]
    llm = LLM(str(path), speculative_config=NGRAM, **common)
    spec = [o.token_ids for o in llm.generate([prompt] * n, params)]
    assert llm.engine.status()["spec_decode"]["drafts"] > 0
    # Two-sample chi-square (independent seeds) per drafted position: df <= vocab - 1 = 11, and
    # 31.3 is the 0.1 % tail there. A sampler that ignored the target (always accepting the
    # draft) scores in the hundreds.
    for pos in range(1, 5):
        a = np.bincount([t[pos] for t in spec], minlength=vocab).astype(float)
        b = np.bincount([t[pos] for t in plain], minlength=vocab).astype(float)
        both = a + b > 0
        assert float(((a - b)[both] ** 2 / (a + b)[both]).sum()) < 31.3, (pos, a, b)
    # The coupling: a seed gives exactly the non-speculative run's tokens.
    assert spec == [o.token_ids for o in base.generate([prompt] * n, params)]
    again = [o.token_ids for o in llm.generate([prompt] * n, params)]
    assert again == spec
    _assert_no_leak(llm)


def test_presets_take_the_config_as_a_table_or_json_text() -> None:
    import tomllib

    from homelab_llm.presets import Preset, dump_preset, parse_preset, validate_preset

    table = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    preset = Preset(name="spec", backend="builtin", model="@default", args={"speculative_config": table})
    assert validate_preset(preset) == []
    assert preset.flag_args() == ["--speculative-config", json.dumps(table)]
    parsed, issues = parse_preset(tomllib.loads(dump_preset(preset)), name="spec")
    assert parsed.args == preset.args and issues == []  # TOML round trip
    text = preset.with_changes(args={"speculative_config": json.dumps(table)})
    assert validate_preset(text) == []
    bad = preset.with_changes(args={"speculative_config": {"method": "ngram"}})
    (issue,) = validate_preset(bad)
    assert issue.field == "args.speculative_config" and "num_speculative_tokens" in issue.message


def test_int8_kv_with_ngram_equals_without(tmp_path: Path) -> None:
    ps = _copy_heavy(3, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _run(tiny_llm(tmp_path, kv_cache_dtype="int8"), ps, params)
    llm = tiny_llm(tmp_path, kv_cache_dtype="int8", speculative_config=NGRAM)
    assert _run(llm, ps, params) == want
    assert llm.engine.status()["spec_decode"]["accepted_tokens"] > 0
    _assert_no_leak(llm)
