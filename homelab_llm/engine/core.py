"""LLMEngine: the engine as a library. add_request / abort_request / step; not thread-safe."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from homelab_llm.engine.args import EngineArgs, EngineArgsError
from homelab_llm.engine.cache.kv_manager import KVCacheManager, release_window
from homelab_llm.engine.cache.state_pool import StateSlots
from homelab_llm.engine.device import resolve_target
from homelab_llm.engine.layers.sampler import Sampler
from homelab_llm.engine.memory import parameter_fields
from homelab_llm.engine.output_processor import OutputProcessor
from homelab_llm.engine.outputs import RequestOutput
from homelab_llm.engine.pending import PLACEHOLDER, PendingTokens, placeholder_rows
from homelab_llm.engine.runner import ModelRunner
from homelab_llm.engine.runner_protocol import Runner
from homelab_llm.engine.sampling_params import SamplingParams
from homelab_llm.engine.scheduler import Scheduler
from homelab_llm.engine.sequence import Sequence
from homelab_llm.errors import HomelabError

log = logging.getLogger("homelab_llm.engine")

class PromptTooLongError(HomelabError, ValueError):
    """Prompt plus requested output exceed the context the engine serves."""


class InvalidPromptError(HomelabError, ValueError):
    """An empty prompt, or token ids outside the vocabulary."""


class DuplicateRequestError(HomelabError, ValueError):
    """A request id that is already in flight."""


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from homelab_llm.engine.tokenizer import load_tokenizer

        args.validate()
        if args.node_rank > 0:
            raise EngineArgsError(
                f"--node-rank {args.node_rank} runs worker ranks only; start it with "
                f"`homelab-llm serve ... --node-rank {args.node_rank}` (serve_worker_node)")
        self.args = args
        target = resolve_target(args)
        self.model_path, self.device, self.dtype = target.path, target.device, target.dtype
        self.model_config, self.quantization = target.config, target.quantization
        self.tokenizer = load_tokenizer(args.tokenizer or self.model_path, args.load_format)
        torch.manual_seed(args.seed)
        self.runner: Runner
        if args.tensor_parallel_size > 1:
            from homelab_llm.engine.parallel import ParallelRunner

            self.runner = ParallelRunner(args, self.model_config, self.model_path, self.device, self.dtype)
        else:
            self.runner = ModelRunner(args, self.model_config, self.model_path, self.device, self.dtype)
        pool = self.runner.allocate_kv(self.runner.kv_budget())
        self.max_model_len = self._resolve_max_model_len(pool.tokens_capacity)
        self.runner.capture_graphs(self.max_model_len)
        running_slots, snapshot_slots = self.runner.state_slot_counts()
        state_slots = StateSlots(running_slots, snapshot_slots) if running_slots else None
        self.kv = KVCacheManager(pool, args.enable_prefix_caching, state_slots,
                                 release_window=release_window(self.model_config, state_slots))
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        eos = tuple(getattr(self.tokenizer, "eos_token_ids", ()) or self.model_config.eos_token_ids)
        self.eos_token_ids = eos
        self.sampler = Sampler(eos)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        # Async scheduling: one step's tokens may still be on the device (see pending.py); with
        # tensor parallelism rank 0 broadcasts them to the other ranks after the next plan.
        self._async = args.async_scheduling and self.device.type == "cuda"
        self._pending: PendingTokens | None = None
        self._seed_rng = torch.Generator().manual_seed(args.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.started_at = time.monotonic()
        log.info("engine ready: %s on %s, %s, KV %d tokens (%s), max_model_len %d",
                 self.model_config.name or self.model_path, self.device, self.dtype,
                 pool.tokens_capacity, pool.layout.dtype, self.max_model_len)

    def _resolve_max_model_len(self, kv_capacity: int) -> int:
        native = self.model_config.max_position_embeddings
        asked = self.args.max_model_len
        if asked is not None and asked > kv_capacity:
            raise EngineArgsError(
                f"--max-model-len {asked} needs {asked} tokens of KV cache but it holds "
                f"{kv_capacity}; raise --kv-cache-memory-bytes/--gpu-memory-utilization or lower "
                f"--max-model-len")
        limit = asked if asked is not None else native
        if limit > kv_capacity:
            log.warning("max_model_len lowered from %d to the KV capacity %d", limit, kv_capacity)
            limit = kv_capacity
        return limit

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids."""
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
        self.outputs.start(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return prompt_ids

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()  # its token is still on the device: never cache or report it
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.finish_time = time.monotonic()
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or bool(self._aborted) or self._pending is not None

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        for seq in self._aborted:
            out = self.outputs.make_output(seq)
            if out is not None:
                results.append(out)
        self._aborted.clear()
        if self._pending is not None and not self._can_run_ahead():
            results.extend(self._finish_pending())
        if not self.scheduler.has_work():
            results.extend(self._finish_pending())
            return results
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            results.extend(self._finish_pending())
            return results
        self.prompt_tokens_total += sum(item.num_prompt_tokens for item in plan.scheduled)
        samplers = [item.seq for item in plan.scheduled if item.samples]  # logits rows, in order
        batch = self.runner.prepare(plan.scheduled, plan.copies)
        if self._pending is not None:
            rows = placeholder_rows(plan.scheduled, self._pending)
            if rows[0]:
                self.runner.patch_inputs(batch, *rows, self._pending.device_tokens)
        logits = self.runner.forward(batch)
        self.scheduler.advance(plan)
        # The previous step's tokens: read while this step runs on the device. A sequence they
        # finish was computed once more in this step; its row is dropped.
        results.extend(self._finish_pending())
        keep = [i for i, seq in enumerate(samplers) if not seq.is_finished]
        sampling = [samplers[i] for i in keep]
        if not sampling:
            return results
        if len(keep) != len(samplers):
            logits = logits[keep]
        if self._run_ahead_ok(sampling):
            self._pending = PendingTokens.launch(sampling, self.sampler.sample_on_device(logits, sampling))
            return results
        sample = self.sampler(logits, sampling)
        results.extend(self._record(sampling, sample.token_ids, sample.logprobs))
        return results

    def _record(self, seqs: list[Sequence], tokens: list[int], logprobs) -> list[RequestOutput]:
        """Append each sequence's sampled token; finish and report."""
        results: list[RequestOutput] = []
        for seq, token, lp in zip(seqs, tokens, logprobs):
            if seq.is_finished:  # aborted while its token was on the way
                continue
            self.outputs.append_token(seq, token, lp)
            self.generation_tokens_total += 1
            if seq.finish_reason is not None:
                seq.finish_time = time.monotonic()
                self.scheduler.finish(seq)
                self._seqs.pop(seq.request_id, None)
            out = self.outputs.make_output(seq)
            if out is not None:
                results.append(out)
        return results

    def _finish_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        tokens = pending.read()
        return self._record(pending.seqs, tokens, [None] * len(tokens))

    def _run_ahead_ok(self, seqs: list[Sequence]) -> bool:
        """May this step's tokens stay on the device while the next step is launched? Only when
        nothing needs them on the host first (logprobs, penalties, min_tokens masking)."""
        if not self._async:
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
        return self.kv.pool.num_free >= len(self.scheduler.running)

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
                   "release_window": self.kv.release_window},
            "requests": {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)},
            "prefix_cache": {"query_tokens": self.kv.prefix_query_tokens,
                             "hit_tokens": self.kv.prefix_hit_tokens,
                             "cached_tokens": self.kv.radix.cached_tokens if self.kv.radix else 0,
                             # Hybrid models: matches resumed from a GDN state snapshot, and
                             # snapshots held now (0 on a plain transformer).
                             "state_snapshot_hits": self.kv.radix.snapshot_hits if self.kv.radix else 0,
                             "state_snapshots_held": (self.kv.state_slots.snapshots_held
                                                      if self.kv.state_slots else 0)},
            "counters": {"prompt_tokens": self.prompt_tokens_total,
                         "generation_tokens": self.generation_tokens_total,
                         "num_preemptions": self.scheduler.num_preemptions},
        }

    def shutdown(self) -> None:
        for rid in list(self._seqs):
            self.abort_request(rid)
        self.runner.shutdown()

    @property
    def model_name(self) -> str:
        return self.model_config.name or Path(self.model_path).stem
