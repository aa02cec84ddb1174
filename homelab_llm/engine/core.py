"""LLMEngine: the engine as a library. add_request / abort_request / step; not thread-safe."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.cache.kv_manager import KVCacheManager, release_window
from homelab_llm.engine.cache.page_groups import sliding_group_window
from homelab_llm.engine.cache.state_pool import StateSlots
from homelab_llm.engine.device import resolve_target
from homelab_llm.engine.faults import (EngineDeadError, FaultKind, SequenceFault, classify,
                                       describe)
from homelab_llm.engine.host_copy import select_rows
from homelab_llm.engine.isolate import run_isolated
from homelab_llm.engine.layers.sampler import Sampler
from homelab_llm.engine.model.context_limit import check_max_model_len
from homelab_llm.engine.memory import parameter_fields
from homelab_llm.engine.output_processor import OutputProcessor
from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.engine.pending import PLACEHOLDER, PendingTokens, placeholder_rows
from homelab_llm.engine.runner import ModelRunner
from homelab_llm.engine.runner_protocol import Runner
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from homelab_llm.engine.sequence import Sequence
from homelab_llm.engine.spec.config import parse_speculative_config, verify_width
from homelab_llm.engine.spec.drafter import Drafter, make_drafter
from homelab_llm.engine.step_plan import plan_order
from homelab_llm.engine.spec.mtp import enable_mtp
from homelab_llm.engine.spec.mtp_draft import MtpDrafter, collect_work
from homelab_llm.engine.spec.stats import SpecDecodeStats
from homelab_llm.engine.spec.verify import accept, sampler_rows
from homelab_llm.engine.structured.matcher import GrammarState
from homelab_llm.engine.structured.prefetch import MaskPrefetcher
from homelab_llm.errors import HomelabError
from homelab_llm.load_progress import LOAD

log = logging.getLogger("homelab_llm.engine")

class PromptTooLongError(HomelabError, ValueError):
    """Prompt plus requested output exceed the context the engine serves."""


class InvalidPromptError(HomelabError, ValueError):
    """An empty prompt, or token ids outside the vocabulary."""


class DuplicateRequestError(HomelabError, ValueError):
    """A request id that is already in flight."""


def _largest_prefill(items: list[ScheduledSeq]) -> ScheduledSeq | None:
    """Out of memory in a forward: the prefill with the most new tokens caused it (a step of
    decodes only has nothing to give back: that is fatal)."""
    prefills = [item for item in items if item.num_new_tokens > 1]
    return max(prefills, key=lambda item: item.num_new_tokens) if prefills else None


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from homelab_llm.engine.tokenizer import load_tokenizer

        args.validate()
        LOAD.reset()
        if args.node_rank > 0:
            raise EngineArgsError(
                f"--node-rank {args.node_rank} runs worker ranks only; start it with "
                f"`homelab-llm serve ... --node-rank {args.node_rank}` (serve_worker_node)")
        self.args = args
        target = resolve_target(args)
        self.model_path, self.device, self.dtype = target.path, target.device, target.dtype
        # --speculative-config "mtp" builds the checkpoint's MTP head (checked before loading).
        spec = parse_speculative_config(args.speculative_config)
        self.model_config = enable_mtp(target.config, spec)
        self.quantization = target.quantization
        # Refused before any weight loads: a position past the RoPE table is a GPU fault.
        wanted_len = check_max_model_len(args.max_model_len, self.model_config)
        self.tokenizer = load_tokenizer(args.tokenizer or self.model_path, args.load_format)
        torch.manual_seed(args.seed)
        self.runner: Runner
        if args.tensor_parallel_size > 1:
            from homelab_llm.engine.parallel import ParallelRunner

            self.runner = ParallelRunner(args, self.model_config, self.model_path, self.device, self.dtype)
        else:
            self.runner = ModelRunner(args, self.model_config, self.model_path, self.device, self.dtype)
        LOAD.begin("sizing KV cache")
        pool = self.runner.allocate_kv(self.runner.kv_budget())
        self.max_model_len = self._resolve_max_model_len(wanted_len, pool.tokens_capacity)
        log.info("load: KV cache %d tokens (%s, %.2f GiB), max_model_len %d", pool.tokens_capacity,
                 pool.layout.dtype, pool.memory_bytes / 2**30, self.max_model_len)
        if pool.sliding is not None:
            log.info("load: sliding layers' page group %d tokens (%.2f GiB)",
                     pool.sliding.tokens_capacity, pool.sliding.memory_bytes / 2**30)
        LOAD.begin("capturing graphs")
        self.runner.capture_graphs(self.max_model_len)
        LOAD.begin("ready")
        running_slots, snapshot_slots = self.runner.state_slot_counts()
        state_slots = StateSlots(running_slots, snapshot_slots) if running_slots else None
        self.kv = KVCacheManager(pool, args.enable_prefix_caching, state_slots,
                                 release_window=release_window(self.model_config, state_slots),
                                 sliding_window=sliding_group_window(self.model_config))
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        eos = tuple(getattr(self.tokenizer, "eos_token_ids", ()) or self.model_config.eos_token_ids)
        self.eos_token_ids = eos
        self.sampler = Sampler(eos)
        self.masks = MaskPrefetcher()  # grammar masks for the next sample, off the step loop
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []  # ended early (abort or fault): reported next step
        self._dead_reason: str | None = None
        # Async scheduling: one step's tokens may still be on the device (see pending.py); with
        # tensor parallelism rank 0 broadcasts them to the other ranks after the next plan.
        self._async = args.async_scheduling and self.device.type == "cuda"
        self._pending: PendingTokens | None = None
        self._forward_began = False  # the step's forward reached the device (_before_retry)
        self._seed_rng = torch.Generator().manual_seed(args.seed)
        # Speculative decoding: drafts need the sequences' tokens on the host, so while it is on
        # every step runs synchronously (async scheduling brings nothing a draft would not).
        self.drafter: Drafter | None = make_drafter(spec, self.max_model_len) if spec else None
        self.verify_width = verify_width(spec)  # rows of a verify group (1: no speculation)
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.mtp: MtpDrafter | None = None
        if self.model_config.use_mtp:
            self.mtp = MtpDrafter(self.runner, self.drafter.proposer, self.kv, self.max_model_len)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.started_at = time.monotonic()
        log.info("engine ready: %s on %s, %s, KV %d tokens (%s), max_model_len %d",
                 self.model_config.name or self.model_path, self.device, self.dtype,
                 pool.tokens_capacity, pool.layout.dtype, self.max_model_len)

    def _resolve_max_model_len(self, wanted: int, kv_capacity: int) -> int:
        """`wanted`: --max-model-len (checked against the model's positions) or those positions."""
        asked = self.args.max_model_len
        if asked is not None and asked > kv_capacity:
            raise EngineArgsError(
                f"--max-model-len {asked} needs {asked} tokens of KV cache but it holds "
                f"{kv_capacity}; raise --kv-cache-memory-bytes/--gpu-memory-utilization or lower "
                f"--max-model-len")
        limit = wanted
        if limit > kv_capacity:
            log.warning("max_model_len lowered from %d to the KV capacity %d", limit, kv_capacity)
            limit = kv_capacity
        return limit

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        params.validate()
        if request_id in self._seqs:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidPromptError("this model has no tokenizer: send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise InvalidPromptError("the prompt is empty: send at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidPromptError(f"prompt token ids must be in [0, {vocab})")
        n = len(prompt_ids)
        room = self.max_model_len - n
        if params.max_tokens is None:
            if room < 1:
                raise PromptTooLongError(
                    f"the prompt has {n} tokens, which leaves no room to generate within the "
                    f"context limit of {self.max_model_len} tokens")
            max_tokens = room
        else:
            if n + params.max_tokens > self.max_model_len:
                raise PromptTooLongError(
                    f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is "
                    f"{n + params.max_tokens} tokens, over the context limit of "
                    f"{self.max_model_len} tokens")
            max_tokens = params.max_tokens
        seq = Sequence(request_id=request_id, prompt_token_ids=prompt_ids, params=params,
                       arrival_time=arrival_time or time.monotonic(), max_tokens=max_tokens)
        seq.seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        if params.grammar is not None:
            if self.tokenizer is None:
                raise InvalidPromptError("structured output needs the model's tokenizer")
            # A lookup when the server compiled it off the loop (engine/structured/matcher.py).
            seq.grammar = GrammarState.start(self.tokenizer, params.grammar,
                                             params.grammar_after_think)
        self.outputs.start(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return prompt_ids

    def abort_request(self, request_id: str) -> None:
        self._end(request_id, "abort")

    def set_detokenize(self, enabled: bool) -> None:
        """Off: outputs carry token ids only and stop strings are not checked here; whoever
        reads the outputs decodes them (the server's engine process: server/detokenize.py)."""
        self.outputs.detokenize = enabled

    def _end(self, request_id: str, reason: str, error: str | None = None) -> None:
        """Finish a request early (abort, or a fault of its own): pages freed at once, its final
        output reported by the next step. Idempotent."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()  # its token is still on the device: never cache or report it
        # A faulty sequence's KV may be incomplete: only an abort offers it to the prefix cache.
        self.scheduler.finish(seq, cache=reason == "abort")
        seq.finish_reason = reason
        seq.error = error
        if self.drafter is not None:
            self.drafter.forget(seq)
        seq.finish_time = time.monotonic()
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or bool(self._aborted) or self._pending is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve any more (a device fault, a lost rank), else None."""
        return self._dead_reason or self.runner.failure

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. A fault of one request ends that request (finish_reason "error"); a fatal
        one (engine/faults.py) raises EngineDeadError now and on every later call."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        try:
            return self._step()
        except EngineDeadError:
            raise
        except Exception as exc:
            if classify(exc) is FaultKind.FATAL:
                raise self._die(exc) from exc
            raise

    def _die(self, exc: BaseException) -> EngineDeadError:
        self._dead_reason = describe(exc)
        log.error("fatal engine error, the engine is dead: %s", self._dead_reason, exc_info=exc)
        return EngineDeadError(f"the engine is dead: {self._dead_reason}")

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        # A host-side check's message says it all; anything else wants its traceback in the log.
        log.warning("request %s failed alone: %s", seq.request_id, describe(exc),
                    exc_info=None if isinstance(exc, SequenceFault) else exc)
        if classify(exc) is FaultKind.OOM and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._end(seq.request_id, "error", describe(exc))

    def _take_ended(self) -> list[RequestOutput]:
        ended, self._aborted = self._aborted, []
        return [out for seq in ended if (out := self.outputs.make_output(seq)) is not None]

    def _step(self) -> list[RequestOutput]:
        results = self._take_ended()
        if self._pending is not None and not self._can_run_ahead():
            results.extend(self._finish_pending())
        if not self.scheduler.has_work():
            results.extend(self._finish_pending())
            return results
        if self.drafter is not None:
            self.drafter.draft(self.scheduler.running)
        # Masks for this step's samples (and drafts) fill on a worker while the forward runs.
        self.masks.start(self.scheduler.running)
        plan = self.scheduler.schedule()
        ran, logits = run_isolated(
            plan.scheduled, lambda items: self._forward(items, plan.copies),
            lambda item: item.seq.request_id, _largest_prefill,
            lambda item, exc: self._fail(item.seq, exc), self._die,
            lambda items: self._before_retry(items, results))
        results.extend(self._take_ended())  # the requests this forward failed
        if not ran:
            results.extend(self._finish_pending())
            return results
        self.prompt_tokens_total += sum(item.num_prompt_tokens for item in ran)
        mtp_work = collect_work(ran, self.verify_width) if self.mtp is not None else []
        sampling_items = [item for item in ran if item.samples]  # logits rows, in order
        samplers = [item.seq for item in sampling_items]
        self.scheduler.advance(SchedulerOutput(ran, plan.preempted, plan.copies),
                               plan_order(ran, self.verify_width)[0])
        # The previous step's tokens: read while this step runs on the device. A sequence they
        # finish was computed once more in this step; its row is dropped.
        results.extend(self._finish_pending())
        if any(item.spec for item in sampling_items):
            results.extend(self._verify(sampling_items, logits))
        else:
            rows = [i for i, seq in enumerate(samplers) if not seq.is_finished]
            if rows:
                results.extend(self._sample(logits, [(row, samplers[row]) for row in rows]))
        if mtp_work:  # the step's tokens are known: the MTP head drafts for the next step
            self.mtp.draft(mtp_work, len(self.scheduler.running))
        return results

    def _forward(self, scheduled: list[ScheduledSeq], copies: CacheCopies) -> torch.Tensor:
        # Copies are idempotent (same source rows, same targets): a step re-run without a faulty
        # request may apply them again.
        self._forward_began = False
        batch = self.runner.prepare(scheduled, copies)
        if self._pending is not None:
            rows = placeholder_rows(scheduled, self._pending)
            if rows[0]:
                self.runner.patch_inputs(batch, *rows, self._pending.device_tokens)
        self._forward_began = True  # from here a fault may leave states half-advanced
        return self.runner.forward(batch)

    def _before_retry(self, items: list[ScheduledSeq], results: list[RequestOutput]) -> list[ScheduledSeq]:
        """Before a forward runs again without its faulty requests (isolate.run_isolated). On a
        hybrid model a forward that reached the device may have advanced the others' recurrent
        states in place, which a rerun would advance again: those sequences are computed again
        from their tokens instead (Scheduler.recompute), after the previous step's tokens are
        in (no placeholder goes back to the queue). A fault before the device work (the plan's
        checks) reruns them as usual."""
        if self.kv.state_slots is None or not self._forward_began:
            return items
        results.extend(self._finish_pending())
        for item in items:
            log.warning("request %s: recomputed after a fault next to it (hybrid states)", item.seq.request_id)
            self.scheduler.recompute(item.seq)
        return []

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, Sequence]]) -> list[RequestOutput]:
        """Sample each (logits row, sequence); a request whose parameters make the sampler raise
        fails alone and the others are sampled without it."""
        ahead = self._run_ahead_ok([seq for _, seq in rows])

        def run(items: list[tuple[int, Sequence]]):
            picked = select_rows(logits, [row for row, _ in items])
            seqs = [seq for _, seq in items]
            return self.sampler.sample_on_device(picked, seqs) if ahead else self.sampler(picked, seqs)

        ran, sample = run_isolated(rows, run, lambda item: item[1].request_id, lambda items: None,
                                   lambda item, exc: self._fail(item[1], exc), self._die)
        results = self._take_ended()
        sampling = [seq for _, seq in ran]
        if not sampling:
            return results
        if ahead:
            self._pending = PendingTokens.launch(sampling, sample)
            return results
        results.extend(self._record(sampling, sample.token_ids, sample.logprobs))
        return results

    def _record(self, seqs: list[Sequence], tokens: list[int], logprobs) -> list[RequestOutput]:
        """Append each sequence's sampled token; finish and report."""
        return self._record_many(seqs, [[t] for t in tokens], [[lp] for lp in logprobs])

    def _record_many(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list],
                     verified: list[ScheduledSeq] | None = None) -> list[RequestOutput]:
        """Append each sequence's new tokens (one, or the accepted drafts and the token after them)
        until a stop condition holds; roll back rejected drafts; finish and report."""
        results: list[RequestOutput] = []
        for i, (seq, toks, lps) in enumerate(zip(seqs, tokens, logprobs)):
            if seq.is_finished:  # aborted while its token was on the way
                continue
            try:
                for token, lp in zip(toks, lps):
                    self.outputs.append_token(seq, token, lp)
                    self.generation_tokens_total += 1
                    if seq.finish_reason is not None:
                        break
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer fault: this request only
                self._fail(seq, exc)
                continue
            if verified is not None:
                self.spec_stats.observe(len(verified[i].spec), len(toks) - 1)
                self.scheduler.rollback(verified[i], len(toks) - 1)
            if seq.finish_reason is not None:
                seq.finish_time = time.monotonic()
                self.scheduler.finish(seq)
                self._seqs.pop(seq.request_id, None)
                if self.drafter is not None:
                    self.drafter.forget(seq)
            out = self.outputs.make_output(seq)
            if out is not None:
                results.append(out)
        return results

    def _verify(self, items: list[ScheduledSeq], logits: torch.Tensor) -> list[RequestOutput]:
        """A step with drafts (synchronous): sample every row as its own output position, keep
        the longest agreeing prefix per sequence (spec/verify.py), roll the rest back. `items`
        are the step's sampling sequences, in logits-row order."""
        seqs = [item.seq for item in items]
        drafts = [item.spec for item in items]
        sample = self.sampler(logits, sampler_rows(seqs, drafts))
        emitted = accept(sample.token_ids, drafts)
        logprobs: list[list] = []
        row = 0
        for d, toks in zip(drafts, emitted):
            logprobs.append(sample.logprobs[row:row + len(toks)])
            row += len(d) + 1
        return self._record_many(seqs, emitted, logprobs, items)

    def _finish_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        tokens = pending.read()
        return self._record(pending.seqs, tokens, [None] * len(tokens))

    def _run_ahead_ok(self, seqs: list[Sequence]) -> bool:
        """May this step's tokens stay on the device while the next step is launched? Only when
        nothing needs them on the host first (logprobs, penalties, min_tokens masking). A grammar
        does not: the next step's forward is launched first, then `_finish_pending` reads this
        step's token and the matcher consumes it, and the next mask is filled while that forward
        runs (masks for step k+1 computed during step k+1's forward, not after it)."""
        if not self._async or self.drafter is not None:  # drafting reads the tokens on the host
            return False
        for seq in seqs:
            p = seq.params
            if p.logprobs is not None or p.needs_penalties or seq.num_output_tokens < p.min_tokens:
                return False
        return True

    def _can_run_ahead(self) -> bool:
        """The next schedule can proceed with placeholders: no pending sequence is known to end
        by length with its pending token, and no running sequence can be preempted (every
        running sequence finds its next page free)."""
        for seq in self._pending.seqs:
            if seq.is_finished:
                continue
            if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                return False
        return self.kv.free_pages >= len(self.scheduler.running)

    # -- reporting ----------------------------------------------------------------------------
    def status(self) -> dict:
        self.runner.refresh_memory()
        pool = self.kv.pool
        devices = [m.as_dict() for m in self.runner.memory_splits()]
        args = asdict(self.args)
        args["model"] = self.model_path
        return {
            "config": {**args, "max_model_len": self.max_model_len, "quantization": self.quantization,
                       "dtype": str(self.dtype).removeprefix("torch."),
                       "device": str(self.device), "architecture": self.model_config.architecture,
                       **parameter_fields(self.model_config)},
            "devices": devices,
            "kv": {"page_size": pool.page_size, "dtype": str(pool.layout.dtype).removeprefix("torch."),
                   "tokens_capacity": pool.tokens_capacity, "tokens_used": self.kv.tokens_used,
                   "bytes_per_token": pool.layout.bytes_per_token(),
                   # sliding-window models: the window, how many layers slide, and the window
                   # the engine releases pages below (0 when a full-attention layer needs them)
                   "sliding_window": self.model_config.sliding_window,
                   "sliding_layers": len(self.model_config.sliding_layers),
                   "release_window": self.kv.release_window,
                   # mixed full/sliding models: the sliding layers' own page group (its pages
                   # hold only windows; bytes_per_token above counts the full layers only)
                   **self.kv.sliding_status()},
            "requests": {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)},
            "prefix_cache": {"query_tokens": self.kv.prefix_query_tokens,
                             "hit_tokens": self.kv.prefix_hit_tokens,
                             "cached_tokens": self.kv.radix.cached_tokens if self.kv.radix else 0,
                             # Hybrid models: matches resumed from a GDN state snapshot, and
                             # snapshots held now (0 on a plain transformer).
                             "state_snapshot_hits": self.kv.radix.snapshot_hits if self.kv.radix else 0,
                             "state_snapshots_held": (self.kv.state_slots.snapshots_held
                                                      if self.kv.state_slots else 0)},
            **({"spec_decode": self.spec_stats.as_dict()} if self.spec_stats is not None else {}),
            "counters": {"prompt_tokens": self.prompt_tokens_total,
                         "generation_tokens": self.generation_tokens_total,
                         "num_preemptions": self.scheduler.num_preemptions},
        }

    def shutdown(self) -> None:
        for rid in list(self._seqs):
            self.abort_request(rid)
        self.masks.close()
        self.runner.shutdown()

    @property
    def model_name(self) -> str:
        return self.model_config.name or Path(self.model_path).stem
