"""MTP speculative decoding on tiny Qwen3.5 hybrids whose checkpoints carry random `mtp.*` heads.

- The head's drafts equal a plain-torch reference of the formula (transformers' pieces, the whole
  sequence recomputed from scratch) after the prefill and after every verify step: the head's KV
  stays right through verification, rollback and batching (fp32; argmax tokens compared exactly),
  and its output states h' match the reference's within 1e-4.
- Greedy output with MTP K = 1..3 equals the output without, token for token, batched and
  single, with prefix caching on (second round served from the cache), dense, MoE and
  Qwen3-Next; so does
  seeded sampling (verification keeps each position's draw, spec/verify.py).
- An "echo" head (drafts repeat the target's last token) gets drafts accepted and rejected; the
  counters add up and, after rejections, the hybrid state equals a never-drafted run's.
- A checkpoint without MTP heads or tensors: one-line errors.
- The memory plan (and `plan --speculative-config`) counts the head's weights and KV layer,
  exactly as the engine allocates them.
"""

from __future__ import annotations

import json

import pytest
import torch

from homelab_llm.engine.memory import kv_bytes_per_token, weight_bytes
from homelab_llm.engine.model.config import ModelLoadError
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.spec.config import SpeculativeConfig, SpeculativeConfigError
from homelab_llm.engine.spec.mtp import enable_mtp
from hybrid_reference import greedy, make_hf_qwen3_5, our_llm
from hybrid_shapes import QWEN36_27B
from moe_reference import make_hf_qwen3_5_moe, make_hf_qwen3_next
from mtp_reference import add_mtp_weights, make_mtp_checkpoint, reference_drafts, reference_head
from test_spec_hybrid import compare_states_while_running

PROMPTS = [[5, 6, 7, 8, 9] * 5, [(7 * i) % 300 + 3 for i in range(30)], [40, 41, 42]]


def mtp(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    model, tensors = make_mtp_checkpoint(folder, seed=3)
    return folder, model, tensors


@pytest.fixture(scope="module")
def want(checkpoint):
    """Greedy outputs without speculation: for PROMPTS, then for second turns that extend each
    prompt by its output and two tokens (served from the prefix cache)."""
    plain = our_llm(checkpoint[0])
    first = [c.token_ids for c in plain.generate(PROMPTS, greedy(8))]
    turns = [p + out + [50, 51] for p, out in zip(PROMPTS, first)]
    second = [c.token_ids for c in plain.generate(turns, greedy(8))]
    plain.shutdown()
    return first, turns, second


def test_drafts_match_the_reference_through_verify_steps(checkpoint) -> None:
    """16-token steps: the 30-token prompt prefills in chunks (the head's pass follows each),
    next to the other request's verify steps."""
    folder, model, tensors = checkpoint
    llm = our_llm(folder, speculative_config=mtp(2), max_num_batched_tokens=16)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(str(i), prompt, greedy(10))
    seqs = list(engine._seqs.values())
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in seqs:
            stored = engine.drafter.proposer.propose(seq.request_id, seq.token_ids, 2)
            if stored and not seq.is_finished:
                assert stored == reference_drafts(model, tensors, seq.token_ids, len(stored))
                checked += 1
    assert checked >= 6 and engine.spec_stats.num_drafts > 0


def test_head_state_matches_the_formula(checkpoint) -> None:
    """h' itself (not only its argmax), after a prefill and after each chained step: fp32 both
    sides, within 1e-4 absolute (reduction order only)."""
    folder, model, tensors = checkpoint
    llm = our_llm(folder, speculative_config=mtp(3))
    runner = llm.engine.runner
    seen: list[torch.Tensor] = []
    run_mtp = runner.run_mtp

    def keep(plan, rows, step):
        tokens = run_mtp(plan, rows, step)
        seen.append(runner.mtp_hidden[0].clone())
        return tokens

    runner.run_mtp = keep
    llm.engine.add_request("r", PROMPTS[1], greedy(8))
    llm.engine.step()
    tokens = llm.engine._seqs["r"].token_ids
    drafts, states = reference_head(model, tensors, tokens, 3)
    assert llm.engine.drafter.proposer.propose("r", tokens, 3) == drafts
    for got, want_state in zip(seen, states, strict=True):
        torch.testing.assert_close(got, want_state, atol=1e-4, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_equals_no_speculation(checkpoint, want, k: int) -> None:
    first, turns, second = want
    llm = our_llm(checkpoint[0], speculative_config=mtp(k))
    assert [c.token_ids for c in llm.generate(PROMPTS, greedy(8))] == first  # batched
    assert [llm.generate([p], greedy(8))[0].token_ids for p in turns] == second  # alone, cached
    stats = llm.engine.status()["spec_decode"]
    assert stats["drafts"] > 0 and stats["draft_tokens"] <= k * stats["drafts"]
    assert llm.engine.kv.prefix_hit_tokens > 0
    slots = llm.engine.kv.state_slots
    assert slots.running_free == slots.num_running  # backups returned too
    llm.shutdown()


def test_seeded_sampling_equals_no_speculation(checkpoint) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    want = [c.token_ids for c in our_llm(checkpoint[0]).generate(PROMPTS[:2], params)]
    llm = our_llm(checkpoint[0], speculative_config=mtp(2))
    assert [c.token_ids for c in llm.generate(PROMPTS[:2], params)] == want
    assert llm.engine.status()["spec_decode"]["drafts"] > 0


def test_int8_kv_with_mtp_equals_without(checkpoint) -> None:
    want = [c.token_ids for c in our_llm(checkpoint[0], kv_cache_dtype="int8").generate(PROMPTS[:2], greedy(8))]
    llm = our_llm(checkpoint[0], kv_cache_dtype="int8", speculative_config=mtp(3))
    assert llm.engine.runner.pool.layout.num_layers == 3  # 2 full-attention layers + the head's
    assert [c.token_ids for c in llm.generate(PROMPTS[:2], greedy(8))] == want


@pytest.mark.parametrize("make", [make_hf_qwen3_5_moe, make_hf_qwen3_next])
def test_moe_head_output_equals_no_speculation(tmp_path, make) -> None:
    make(tmp_path, seed=1)
    add_mtp_weights(tmp_path, seed=2, donor=3)  # a full-attention layer with experts
    expected = [c.token_ids for c in our_llm(tmp_path).generate(PROMPTS, greedy(8))]
    llm = our_llm(tmp_path, speculative_config=mtp(2))
    assert llm.engine.runner.model.mtp is not None
    assert [c.token_ids for c in llm.generate(PROMPTS, greedy(8))] == expected
    assert llm.engine.status()["spec_decode"]["drafts"] > 0


def test_echo_head_accepts_and_rollback_keeps_the_state(tmp_path) -> None:
    make_mtp_checkpoint(tmp_path, seed=5, echo=True)
    prompt = [5, 6, 7, 8, 9] * 3  # output: 4 different tokens, then one token repeated
    plain, spec = our_llm(tmp_path), our_llm(tmp_path, speculative_config=mtp(3))
    want = plain.generate([prompt], greedy(16))[0].token_ids
    for llm in (spec, plain):
        llm.engine.add_request("r", prompt, greedy(16))
    seq = spec.engine._seqs["r"]
    compared, _ = compare_states_while_running(spec, plain, "r")
    assert compared >= 1
    assert seq.output_token_ids == want
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "--speculative-config" in text
    return text


def test_checkpoint_without_mtp_is_a_one_line_error(tmp_path) -> None:
    make_hf_qwen3_5(tmp_path, seed=0)  # no mtp_num_hidden_layers
    with pytest.raises(SpeculativeConfigError) as err:
        our_llm(tmp_path, speculative_config=mtp(2))
    assert "mtp_num_hidden_layers" in _one_line(err)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ModelLoadError) as err:  # declared, but no mtp.* tensors
        our_llm(tmp_path, speculative_config=mtp(2))
    assert "mtp.fc.weight" in _one_line(err)


def test_memory_plan_counts_the_head() -> None:
    with_head = enable_mtp(QWEN36_27B, SpeculativeConfig("mtp", 3))
    assert with_head.mtp_layers == 1 and QWEN36_27B.mtp_layers == 0
    kv, kv_mtp = (kv_bytes_per_token(c, "auto", "bfloat16", 1) for c in (QWEN36_27B, with_head))
    assert kv_mtp * 16 == kv * 17  # 16 full-attention layers + the head's
    h = QWEN36_27B.hidden_size
    extra = weight_bytes(with_head, "bfloat16", None, 1) - weight_bytes(QWEN36_27B, "bfloat16", None, 1)
    # fc (2H x H) + one full-attention layer (~ 0.4 B parameters at this shape), bf16
    assert 2 * (2 * h * h) < extra < 2 * (2 * h * h + 500_000_000)


def test_plan_cli_counts_the_head_and_backup_states(capsys) -> None:
    from homelab_llm.cli import main
    from homelab_llm.hwcheck.plan_command import model_configs_dir

    def plan(*extra: str) -> dict:
        assert main(["plan", str(model_configs_dir() / "Qwen3.6-27B.json"), "--gpu-memory", "80GiB",
                     "--max-num-seqs", "4", "--json", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return {**out["per_device"][0], "verify_bytes_per_sequence": out["verify_bytes_per_sequence"]}

    plain, spec = plan(), plan("--speculative-config", mtp(3))
    assert spec["kv_bytes_per_token"] * 16 == plain["kv_bytes_per_token"] * 17
    assert spec["weights_bytes"] > plain["weights_bytes"]
    # K+1 pending verify rows per running slot (kernels/gdn_pending.py): 48 GDN layers of 48 value
    # heads and 16 key heads of 128, 10240 bf16 conv channels; d and k twice (two halves), u and
    # the conv inputs once. ~12 MB a slot, against 3 spare 144 MiB states a slot before.
    rows = 4
    per_layer = rows * (2 * (48 + 16 * 128) + 48 * 128) * 4 + rows * 10240 * 2
    assert spec["state_bytes"] - plain["state_bytes"] == 4 * 48 * per_layer
    assert spec["verify_bytes_per_sequence"] == 48 * per_layer and plain["verify_bytes_per_sequence"] == 0
    assert 48 * per_layer < plain["state_bytes_per_sequence"] / 10
    # disable_by_batch_size changes only which steps draft: the same memory
    bounded = plan("--speculative-config", json.dumps({**json.loads(mtp(3)), "disable_by_batch_size": 2}))
    assert bounded["state_bytes"] == spec["state_bytes"]


def test_tensor_parallel_head_drafts_and_output(checkpoint, want) -> None:
    """Two gloo ranks: every head forward runs on both (Runner.run_mtp); the first drafts equal
    the reference and the output equals the one-device run without speculation."""
    folder, model, tensors = checkpoint
    llm = our_llm(folder, tensor_parallel_size=2, speculative_config=mtp(2))
    try:
        engine = llm.engine
        engine.add_request("r", PROMPTS[1], greedy(8))
        engine.step()
        seq = engine._seqs["r"]
        drafts = engine.drafter.proposer.propose("r", seq.token_ids, 2)
        assert drafts == reference_drafts(model, tensors, seq.token_ids, 2)
        engine.abort_request("r")
        engine.step()
        assert [c.token_ids for c in llm.generate(PROMPTS, greedy(8))] == want[0]
        assert engine.status()["spec_decode"]["drafts"] > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("with_head", [False, True])
def test_plan_equals_what_the_engine_allocates(tmp_path, with_head: bool) -> None:
    """A dummy tiny hybrid with an MTP head: the plan's weight and KV bytes per token are exactly
    what the engine measures, with the head (and its KV layer) built or not."""
    from homelab_llm.engine.llm import LLM
    from homelab_llm.engine.memory import rope_table_bytes
    from homelab_llm.engine.model.config import config_from_hf
    from hybrid_reference import TEXT_SHAPE

    raw = dict(TEXT_SHAPE, model_type="qwen3_5_text", mtp_num_hidden_layers=1)
    (tmp_path / "m.json").write_text(json.dumps(raw))
    spec = SpeculativeConfig("mtp", 2) if with_head else None
    config = enable_mtp(config_from_hf(raw), spec)
    llm = LLM(str(tmp_path / "m.json"), load_format="dummy", device="cpu", dtype="float32",
              page_size=4, kv_cache_memory_bytes=1 << 20, speculative_config=mtp(2) if spec else None)
    try:
        status = llm.engine.status()
    finally:
        llm.shutdown()
    assert status["devices"][0]["weights"] == weight_bytes(config, "float32", None, 1) + rope_table_bytes(config)
    assert status["kv"]["bytes_per_token"] == kv_bytes_per_token(config, "auto", "float32", 1)
