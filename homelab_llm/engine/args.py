"""EngineArgs: every engine knob, spelled like vLLM's flags so `vllm serve` and ours swap."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from homelab_llm.engine.model.context_limit import parse_hf_overrides
from homelab_llm.engine.spec.config import parse_speculative_config
from homelab_llm.errors import HomelabError

KVCacheDType = Literal["auto", "bf16", "fp16", "fp32", "int8"]
LoadFormat = Literal["auto", "gguf", "safetensors", "dummy"]


class EngineArgsError(HomelabError, ValueError):
    """A bad engine setting; the message names the flag and the allowed values."""


def parse_bytes(text: str | int | None) -> int | None:
    """'24GiB', '512MiB', '8e9', '1000000' -> bytes."""
    if text is None or isinstance(text, int):
        return text
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 1 << 10,
             "m": 1 << 20, "g": 1 << 30, "b": 1}
    s = str(text).strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            number = s[: -len(unit)].strip()
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    try:
        return int(float(s))
    except ValueError as exc:
        raise EngineArgsError(f"cannot read {text!r} as a byte count (e.g. 512MiB, 24GiB)") from exc


@dataclass
class EngineArgs:
    model: str = ""
    tokenizer: str | None = None
    load_format: LoadFormat = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str | None = None  # None | w4a16 (GGUF Q4_* / GPTQ / AutoRound are detected)
    # GPUs: the logits from a 4-bit copy of the LM head (group 128, quantized at load)
    quantize_lm_head: bool = False
    tensor_parallel_size: int = 1
    kv_cache_dtype: KVCacheDType = "auto"
    page_size: int = 16
    max_model_len: int | None = None
    # Merged into the HF config before parsing (vLLM's flag), e.g. {"rope_scaling": {...}} to
    # extend the model's positions; a JSON string is parsed by validate().
    hf_overrides: dict[str, Any] | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # Hybrid (Gated DeltaNet) models: the radix cache keeps state snapshots in a bounded pool.
    # None = 2 x max_num_seqs (a prompt end and an output end per running sequence); 0 = no prefix
    # reuse on hybrids. Or a byte budget per device instead. Ignored on plain transformers.
    max_state_snapshots: int | None = None
    state_snapshot_memory_bytes: int | None = None
    enforce_eager: bool = False
    # Schedule and launch step k+1 while step k's tokens are still on the device (GPU only;
    # falls back per step when a request needs the tokens on the host first).
    async_scheduling: bool = True
    seed: int = 0
    # vLLM's JSON: {"method": "ngram"|"mtp", "num_speculative_tokens": K, ...} (engine/spec/config.py)
    speculative_config: str | None = None
    # Multi-node rendezvous (torchrun-compatible env://).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def validate(self) -> None:
        self.hf_overrides = parse_hf_overrides(self.hf_overrides)
        if self.kv_cache_dtype not in ("auto", "bf16", "fp16", "fp32", "int8"):
            raise EngineArgsError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; use auto, bf16, fp16, fp32 or int8")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise EngineArgsError(
                f"--load-format {self.load_format!r} is not supported; use auto, gguf, safetensors or dummy")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise EngineArgsError(f"--page-size must be a power of two, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise EngineArgsError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise EngineArgsError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineArgsError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise EngineArgsError(
                f"--kv-cache-memory-bytes must be positive, got {self.kv_cache_memory_bytes}")
        self.validate_state_snapshots()
        if self.tensor_parallel_size < 1:
            raise EngineArgsError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise EngineArgsError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        parse_speculative_config(self.speculative_config)  # raises a one-line error naming the flag

    def validate_state_snapshots(self) -> None:
        if self.max_state_snapshots is not None and self.max_state_snapshots < 0:
            raise EngineArgsError(f"--max-state-snapshots must be >= 0 (0 turns prefix reuse off "
                                  f"on hybrid models), got {self.max_state_snapshots}")
        if self.state_snapshot_memory_bytes is not None and self.state_snapshot_memory_bytes < 0:
            raise EngineArgsError(f"--state-snapshot-memory-bytes must be >= 0, got "
                                  f"{self.state_snapshot_memory_bytes}")
        if self.max_state_snapshots is not None and self.state_snapshot_memory_bytes is not None:
            raise EngineArgsError("--max-state-snapshots and --state-snapshot-memory-bytes both "
                                  "size the snapshot pool; give only one")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The engine flags, vLLM spelling. Defaults come from the dataclass."""
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
        g.add_argument("--load-format", default=d.load_format,
                       choices=["auto", "gguf", "safetensors", "dummy"],
                       help="how to read MODEL: auto detects GGUF or safetensors; dummy builds "
                            "random weights from a model_configs JSON (benchmarks, tests) "
                            f"(default: {d.load_format})")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                       help="compute dtype; auto picks bfloat16 on GPUs that have it, float32 on "
                            "the CPU with 4-bit weights (a GGUF Q4 file's too) run through the "
                            "bf16 int4 kernel; float32 on the CPU is the exact mode (every weight "
                            f"dequantized) (default: {d.dtype})")
        g.add_argument("--device", default=d.device,
                       help="auto, cpu, cuda or cuda:N (HIP GPUs are cuda too); auto takes the "
                            f"first GPU, else the CPU (default: {d.device})")
        g.add_argument("--quantization", default=None,
                       help="w4a16: 4-bit weights, 16-bit activations, quantized at load from a "
                            "16-bit checkpoint (GPTQ and AutoRound checkpoints are detected "
                            "without it; GGUF Q4 files too on the CPU unless --dtype float32)")
        g.add_argument("--quantize-lm-head", action="store_true",
                       help="GPUs: compute the logits from a 4-bit copy of the LM head (group 128, "
                            "quantized at load, as gpt-fast's int4 and llama.cpp's Q4 files do): "
                            "an untied head takes a quarter of its 16-bit memory and a batch-1 "
                            "decode step reads ~3/4 fewer head bytes; logits move by the "
                            "rounding (the CPU default's head is int8 already)")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="split every layer across this many GPUs of this machine "
                            f"(default: {d.tensor_parallel_size})")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       choices=["auto", "bf16", "fp16", "fp32", "int8"],
                       help="KV cache element type; int8 halves its memory (per-token scales); "
                            f"auto follows --dtype (default: {d.kv_cache_dtype})")
        g.add_argument("--page-size", "--block-size", type=int, default=d.page_size, dest="page_size",
                       help=f"tokens per KV cache page (default: {d.page_size})")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus output, in tokens (default: the model's context, "
                            "lowered to what the KV cache holds)")
        g.add_argument("--hf-overrides", default=None, metavar="JSON",
                       help='merged into the model config, e.g. \'{"rope_scaling": {"rope_type": '
                            '"yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'')
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help=f"requests decoded together at most (default: {d.max_num_seqs})")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="tokens one step may process (prefill chunks plus decodes) "
                            f"(default: {d.max_num_batched_tokens})")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="share of each GPU's memory this server may use, weights and KV cache "
                            f"included (default: {d.gpu_memory_utilization})")
        g.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                       help="KV cache budget per device, e.g. 2GiB (overrides --gpu-memory-utilization)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the KV cache of a shared prompt prefix (chat history, system "
                            "prompt) across requests "
                            f"(default: {'on' if d.enable_prefix_caching else 'off'})")
        g.add_argument("--max-state-snapshots", type=int, default=None,
                       help="hybrid models: GDN state snapshots the prefix cache keeps per device "
                            "(default 2 x --max-num-seqs; 0 = no prefix reuse)")
        g.add_argument("--state-snapshot-memory-bytes", type=parse_bytes, default=None,
                       help="hybrid models: snapshot pool size per device instead, e.g. 2GiB")
        g.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA/HIP graphs: starts faster and uses less memory, decodes slower")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=d.async_scheduling,
                       help="prepare the next step while the GPU runs this one (default on)")
        g.add_argument("--seed", type=int, default=d.seed,
                       help=f"seed for sampling when a request gives none (default: {d.seed})")
        g.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\', '
                            'or \'{"method": "mtp", "num_speculative_tokens": 3}\' on a checkpoint with '
                            'an MTP head (Qwen3.5/3.6, Qwen3-Next)')
        g.add_argument("--nnodes", type=int, default=d.nnodes,
                       help=f"machines in a multi-node tensor-parallel group (default: {d.nnodes})")
        g.add_argument("--node-rank", type=int, default=d.node_rank,
                       help="this machine's index in the group; 0 serves the API, others only "
                            f"run worker ranks (default: {d.node_rank})")
        g.add_argument("--master-addr", default=d.master_addr,
                       help=f"address of node 0 for the group's rendezvous (default: {d.master_addr})")
        g.add_argument("--master-port", type=int, default=d.master_port,
                       help=f"port of node 0 for the group's rendezvous (default: {d.master_port})")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(ns).items() if k in names}
        args = cls(**values)
        args.validate()
        return args
