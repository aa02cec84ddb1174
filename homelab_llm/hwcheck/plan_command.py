"""`homelab-llm plan MODEL`: per device weights, activations, graphs, sequence state (hybrid
models) and KV cache; tokens of context the KV cache holds; how many full-length sequences fit.

The arithmetic is engine/memory.py, the same the engine uses for its KV layout, so a plan and a
running server's /v1/status agree. MODEL is a model_configs name (assets/model_configs/*.json), an
HF config.json, an HF model folder or a GGUF file. Only a GGUF or a folder imports the engine's
loader (and torch); a config name or JSON stays torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_llm.errors import HomelabError

KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8")


class PlanError(HomelabError, ValueError):
    """A model that cannot be found or read, or flags that cannot make a plan."""


def sliding_lines(plan: Any) -> list[str]:
    """The sliding-window figures (memory.sliding_window_figures) of a model that has them."""
    sw = plan.sliding
    if not sw:
        return []
    per_seq = "  ".join(f"{_len_label(int(n))}: {b / 1e9:.2f} GB (uncapped "
                        f"{sw['kv_bytes_per_sequence_uncapped'][n] / 1e9:.2f})"
                        for n, b in sw["kv_bytes_per_sequence"].items())
    conc = "  ".join(f"{_len_label(int(n))}: {c}" for n, c in sw["max_concurrency"].items())
    note = "" if sw["engine_caps"] else " (target: this engine keeps every page of this model)"
    if sw.get("sliding_group_pages"):
        note += f"; the sliding layers' own page group: {sw['sliding_group_pages']} pages"
    return [f"sliding window {sw['window']} on {sw['sliding_layers']} of "
            f"{sw['sliding_layers'] + sw['full_layers']} layers; KV per sequence, device 0: {per_seq}",
            f"sequences that fit with sliding KV capped at the window: {conc}{note}"]


UNITS = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "TB": 10**12, "GB": 10**9, "MB": 10**6}


@dataclass(frozen=True)
class Memory:
    """A size as the user wrote it: the bytes, and the unit to answer in."""

    bytes: int
    unit: str


BARE_BYTES_MIN = 1 << 30  # a bare number this large is a byte count (25753026560), not "24"


def parse_memory(text: str) -> Memory:
    """'24GiB', '24 gb', '0.5TiB' -> Memory. A bare number is a byte count only when it is at
    least 1 GiB (then the plan answers in GB); '24' is refused (24 bytes is never meant)."""
    raw = text.strip().replace(" ", "")
    if raw.isdigit() and int(raw) >= BARE_BYTES_MIN:
        return Memory(int(raw), "GB")
    for unit, scale in UNITS.items():
        if raw.lower().endswith(unit.lower()):
            try:
                value = float(raw[: -len(unit)])
            except ValueError:
                break
            if value <= 0:
                break
            return Memory(int(value * scale), unit)
    raise argparse.ArgumentTypeError(
        f"{text!r} needs a unit: e.g. 24GiB (binary, as GPUs are sized) or 24GB (decimal)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from homelab_llm.engine.args import parse_bytes

    p = subparsers.add_parser(
        "plan", help="plan memory: weights, KV, context and concurrency",
        description="Plan memory per GPU before loading anything: weights, activation and graph "
                    "estimates, KV cache, token capacity and concurrency at 8K/32K/128K.")
    p.add_argument("model", metavar="MODEL",
                   help="model_configs name, HF config.json, HF model folder or .gguf file")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES)
    p.add_argument("--gpu-memory", type=parse_memory, default=None, metavar="SIZE",
                   help="memory per GPU with its unit, e.g. 24GiB or 24GB; the plan answers in "
                        "that unit (default: the smallest GPU hwcheck finds, in GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--quantization", default=None, help="w4a16 (detected for GPTQ/AWQ/AutoRound)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="the LM head as a 4-bit copy (the engine's --quantize-lm-head)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--page-size", "--block-size", type=int, default=16, dest="page_size")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA/HIP graphs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-state-snapshots", type=int, default=None,
                   help="hybrid models: prefix-cache state snapshots (default 2 x --max-num-seqs)")
    p.add_argument("--state-snapshot-memory-bytes", type=parse_bytes, default=None,
                   help="hybrid models: snapshot pool bytes per device instead, e.g. 2GiB")
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='as for serve; {"method": "mtp", ...} counts the MTP head\'s weights and KV')
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


def model_configs_dir() -> Path:
    from homelab_llm.assets import assets_dir

    return assets_dir() / "model_configs"


def load_config(model: str, load_format: str = "auto") -> Any:
    """ModelConfig for MODEL: a path (JSON, folder, GGUF) or a name in assets/model_configs."""
    from homelab_llm.engine.model.config import config_from_hf

    path = Path(model).expanduser()
    if path.suffix == ".json" and path.is_file():
        return config_from_hf(_read_json(path), name=path.stem, where=str(path))
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        from homelab_llm.engine.model.loader import load_model_config  # imports torch

        return load_model_config(path, load_format)
    if path.exists():
        raise PlanError(f"{path}: not a .gguf file, an HF model folder or a config .json")
    known = sorted(model_configs_dir().glob("*.json"))
    for candidate in known:
        if candidate.stem.lower() == model.lower().removesuffix(".json"):
            return config_from_hf(_read_json(candidate), name=candidate.stem, where=str(candidate))
    names = ", ".join(c.stem for c in known) or "none shipped yet"
    raise PlanError(f"{model!r} is neither a file nor a folder nor a model_configs name "
                    f"(known names: {names})")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlanError(f"{path}: not a readable JSON config ({err})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON object (an HF config.json)")
    return data


def detected_gpu_memory() -> int | None:
    """The smallest discrete GPU's VRAM on this machine (tensor parallel fills every GPU alike)."""
    from homelab_llm.hwcheck.gpus import detect_gpus

    sizes = [g.vram_bytes for g in detect_gpus() if not g.integrated and g.vram_bytes]
    return min(sizes) if sizes else None


def run(args: argparse.Namespace) -> int:
    from homelab_llm.engine import memory
    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.spec.config import parse_speculative_config
    from homelab_llm.engine.spec.mtp import enable_mtp

    for flag, value, low in (("--tensor-parallel-size", args.tensor_parallel_size, 1),
                             ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                             ("--page-size", args.page_size, 1)):
        if value < low:
            raise PlanError(f"{flag} must be >= {low}, got {value}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise PlanError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    EngineArgs(max_state_snapshots=args.max_state_snapshots,
               state_snapshot_memory_bytes=args.state_snapshot_memory_bytes).validate_state_snapshots()
    spec = parse_speculative_config(args.speculative_config)
    config = enable_mtp(load_config(args.model, args.load_format), spec)
    given: Memory | None = args.gpu_memory
    if given is None:
        detected = detected_gpu_memory()
        given = Memory(detected, "GiB") if detected else None
    if given is None:
        raise PlanError("no GPU found to size against: give --gpu-memory, e.g. 24GiB")

    def make(**changes: Any) -> Any:
        options = dict(
            gpu_memory_bytes=given.bytes, tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, quantization=args.quantization,
            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            page_size=args.page_size, enforce_eager=args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching,
            max_state_snapshots=args.max_state_snapshots,
            state_snapshot_memory_bytes=args.state_snapshot_memory_bytes,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            quantize_lm_head=args.quantize_lm_head)
        return memory.plan(config, **{**options, **changes})

    plan = make()
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(render_plan(plan, args.max_num_seqs, given.unit))
        print("".join(suggestions(plan, args, make, given.unit)), end="")
    return 0


def suggestions(plan: Any, args: argparse.Namespace, make: Any, unit: str) -> list[str]:
    """What to change when the weights or the KV cache do not fit, each re-planned to check it
    helps: 4-bit weights, a 4-bit LM head, int8 KV, a shorter context, more GPUs."""
    out: list[str] = []
    scale = UNITS[unit]
    no_room = any(d.kv_cache_bytes == 0 for d in plan.per_device)
    short = 0 < plan.tokens_capacity < plan.max_model_len
    if no_room and not plan.quantization:
        q = make(quantization="w4a16")
        fits = all(d.kv_cache_bytes > 0 for d in q.per_device)
        out.append(f"suggestion: --quantization w4a16 stores the weights in about "
                   f"{q.per_device[0].weights_bytes / scale:.2f} {unit} per device instead of "
                   f"{plan.per_device[0].weights_bytes / scale:.2f} {unit}"
                   + (f", leaving {q.tokens_capacity:,} tokens of KV cache" if fits
                      else "; still too big for this memory"))
    if no_room and args.tensor_parallel_size == 1:
        out.append("suggestion: split the model over two GPUs with -tp 2")
    if (no_room or short) and plan.quantization and not args.quantize_lm_head:
        h = make(quantize_lm_head=True)
        freed = plan.per_device[0].weights_bytes - h.per_device[0].weights_bytes
        if freed > 0 and h.tokens_capacity > plan.tokens_capacity:
            out.append(f"suggestion: --quantize-lm-head keeps the LM head in 4 bits, "
                       f"{freed / scale:.2f} {unit} less per device: {h.tokens_capacity:,} tokens "
                       "of KV cache")
    if short and not no_room:
        fit = plan.tokens_capacity // plan.page_size * plan.page_size
        out.append(f"suggestion: --max-model-len {fit} (what the KV cache holds), or fewer bytes "
                   "per token" + (" with --kv-cache-dtype int8" if plan.kv_cache_dtype != "int8"
                                  else ""))
    return [line + "\n" for line in out]


def _amount(n: int, unit: str = "GB") -> str:
    return f"{n / UNITS[unit]:8.2f}"


def _len_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def parameter_line(plan: Any) -> str:
    """Parameters, and for a mixture of experts those one token reads."""
    line = f"parameters: {plan.parameters / 1e9:.1f}B"
    if plan.active_parameters < plan.parameters:
        line += f", {plan.active_parameters / 1e9:.1f}B active per token (all experts resident)"
    return line


def render_plan(plan: Any, max_num_seqs: int | None = None, unit: str = "GB") -> str:
    kv = plan.kv_cache_dtype if plan.kv_cache_dtype != "auto" else f"auto ({plan.dtype})"
    d0 = plan.per_device[0]
    scale = UNITS[unit]
    lines = [
        f"{plan.model or 'model'}: TP={plan.tensor_parallel_size}, {plan.dtype} weights"
        + (f" ({plan.quantization})" if plan.quantization else "") + f", KV {kv}, page "
        f"{plan.page_size}, budget {d0.budget_bytes / scale:.2f} of {d0.total_bytes / scale:.2f} "
        f"{unit} per device",
        "",
        f"device   weights  buffers  activations  graphs    state    other  KV cache   ({unit})",
    ]
    for d in plan.per_device:
        lines.append(f"{d.rank:>6} {_amount(d.weights_bytes, unit)} {_amount(d.buffers_bytes, unit)} "
                     f"{_amount(d.activation_bytes, unit)}    {_amount(d.graph_bytes, unit)} "
                     f"{_amount(d.state_bytes, unit)} {_amount(d.other_bytes, unit)} "
                     f"{_amount(d.kv_cache_bytes, unit)}")
    per_token = ", ".join(f"{d.kv_bytes_per_token:,}" for d in plan.per_device)
    lines += ["", f"KV bytes per token per device: {per_token}"]
    if plan.state_bytes_per_sequence:  # hybrid: GDN conv + recurrent state instead of KV pages
        verify = (f" (+ {plan.verify_bytes_per_sequence / 1e6:.1f} MB of pending verify rows each)"
                  if plan.verify_bytes_per_sequence else "")
        lines.append(f"state per sequence per device: {plan.state_bytes_per_sequence:,} bytes "
                     f"({plan.state_bytes_per_sequence / 1e6:.1f} MB); running sequences{verify} + "
                     f"{plan.state_snapshots} prefix-cache snapshots: {d0.state_bytes / 1e9:.2f} GB")
    lines.append(f"token capacity: {plan.tokens_capacity:,} tokens "
                 f"({plan.per_device[0].num_pages:,} pages of {plan.page_size})")
    conc = "  ".join(f"{_len_label(int(n))}: {c}" for n, c in plan.max_concurrency.items())
    lines.append(f"max concurrent full-length sequences: {conc}")
    if max_num_seqs is not None and any(c > max_num_seqs for c in plan.max_concurrency.values()):
        lines.append(f"  (the scheduler also caps running sequences at --max-num-seqs {max_num_seqs})")
    lines += sliding_lines(plan)
    lines.append(parameter_line(plan))
    lines.append("activations and graphs are estimates; the engine measures them at startup")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
