"""Find a model's config and fill its weights: HF safetensors folder, GGUF file, or dummy weights.

    config = load_model_config(path, load_format)
    model = load_model(config, path, load_format, dtype, device, tp_rank, tp_size)
"""

from __future__ import annotations

import dataclasses
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from homelab_llm.engine.layers.moe import ExpertPart, FusedExperts, expert_target
from homelab_llm.engine.model.config import (
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    config_from_hf,
    read_hf_config,
    read_json,
)
from homelab_llm.engine.model.context_limit import override_config, override_hf_dict
from homelab_llm.engine.model.gemma3 import Gemma3ForCausalLM
from homelab_llm.engine.model.gpt_oss import GptOssForCausalLM
from homelab_llm.engine.model.llama import LlamaForCausalLM
from homelab_llm.engine.model.quant_config import parse_quant_config
from homelab_llm.engine.model.qwen3_5 import Qwen3_5ForCausalLM
from homelab_llm.engine.model.qwen3_5_moe import Qwen3_5MoeForCausalLM
from homelab_llm.engine.model.qwen3_moe import Qwen3MoeForCausalLM
from homelab_llm.engine.model.qwen3_next import Qwen3NextForCausalLM
from homelab_llm.engine.parallel import state as parallel_state

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DUMMY_STD = 0.02  # small enough that 60+ random layers keep activations finite


# config.architecture -> the model class; every other supported architecture is llama.py's.
MODEL_CLASSES: dict[str, type[nn.Module]] = {"qwen3_5": Qwen3_5ForCausalLM,
                                             "qwen3_moe": Qwen3MoeForCausalLM,
                                             "qwen3_5_moe": Qwen3_5MoeForCausalLM,
                                             "qwen3_next": Qwen3NextForCausalLM,
                                             "gemma3": Gemma3ForCausalLM,
                                             "gpt_oss": GptOssForCausalLM}


def model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)


def resolve_format(path: str | Path, load_format: str = "auto") -> str:
    """auto -> gguf for a .gguf file, dummy for a .json config, safetensors for a folder."""
    if load_format not in LOAD_FORMATS:
        raise UnsupportedModelError(
            f"load format {load_format!r} is not supported; use {', '.join(LOAD_FORMATS)}")
    p = Path(path)
    if load_format != "auto":
        return load_format
    if p.suffix == ".gguf":
        return "gguf"
    if p.suffix == ".json":
        return "dummy"
    if p.is_dir():
        return "safetensors"
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file or folder")
    raise ModelLoadError(f"{p}: not a .gguf file, an HF model folder or a model-config .json")


def _hf_config(folder: Path, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    config_path = folder / "config.json"
    raw = override_hf_dict(read_hf_config(folder), hf_overrides)
    cfg = config_from_hf(raw, name=folder.name, where=str(config_path))
    parse_quant_config(cfg.quantization, str(config_path))  # unsupported settings fail here
    # Chat models list extra stop ids (e.g. Llama 3.1's <|eot_id|>) only in generation_config.
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen_eos = read_json(gen_path).get("eos_token_id")
        extra = (gen_eos,) if isinstance(gen_eos, int) else tuple(gen_eos or ())
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + tuple(int(e) for e in extra)))
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return cfg


def load_model_config(path: str | Path, load_format: str = "auto",
                      hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The model's config; `hf_overrides` (--hf-overrides) is merged in before parsing."""
    p = Path(path)
    fmt = resolve_format(p, load_format)
    if fmt == "gguf":
        from homelab_llm.engine.model.gguf_file import open_gguf

        return override_config(open_gguf(p).config(), hf_overrides, str(p))
    if p.is_dir():
        return _hf_config(p, hf_overrides)
    if p.suffix == ".json":
        cfg = config_from_hf(override_hf_dict(read_json(p), hf_overrides), name=p.stem, where=str(p))
        parse_quant_config(cfg.quantization, str(p))
        return cfg
    raise ModelLoadError(f"{p}: load format {fmt} needs an HF model folder (config.json)")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def default_quantization(path: str | Path, fmt: str, fast_cpu: bool) -> str | None:
    """What no --quantization means for this file: "w4a16" for a GGUF with 4-bit linears on the
    CPU's fast default (device.fast_cpu_default), else None (resolve_quantization decides)."""
    if not fast_cpu or fmt != "gguf":
        return None
    from homelab_llm.engine.model.gguf_file import open_gguf

    return "w4a16" if open_gguf(path).has_four_bit_linears() else None


def resolve_quantization(config: ModelConfig, fmt: str, quantization: str | None) -> str | None:
    """None (dense, the model dtype) or "w4a16". A GPTQ/AutoRound/AWQ checkpoint implies w4a16;
    GGUF Q4 files are dequantized unless asked (default_quantization asks on the CPU default)."""
    if quantization is not None and quantization.lower() != "w4a16":
        raise UnsupportedModelError(f"quantization {quantization!r} is not supported; use w4a16")
    implied = fmt in ("safetensors", "dummy") and parse_quant_config(config.quantization) is not None
    if quantization and fmt == "safetensors" and not implied:
        raise UnsupportedModelError(
            "w4a16 loads GPTQ / AutoRound / AWQ checkpoints, GGUF Q4_0/Q4_1/Q4_K files and dummy "
            "weights; this folder has plain weights (drop --quantization to run it in the model dtype)")
    return "w4a16" if quantization or implied else None


def load_model(config: ModelConfig, path: str | Path, load_format: str, dtype: torch.dtype,
               device: torch.device | str, tp_rank: int = 0, tp_size: int = 1,
               quantization: str | None = None, fast_cpu: bool = False,
               quantize_lm_head: bool = False) -> nn.Module:
    """quantization "w4a16": GGUF linears stored as Q4_0/Q4_1/Q4_K stay 4-bit, dummy weights are
    random 4-bit; GPTQ/AutoRound/AWQ checkpoints load 4-bit with or without it. fast_cpu
    (device.fast_cpu_default): a GGUF Q4 file loads 4-bit unasked, and a 4-bit model computes
    its 4-bit matmuls in bf16 and its logits from an int8 LM head (model/w4a16.use_cpu_kernels).
    quantize_lm_head (--quantize-lm-head): on a GPU the logits come from a 4-bit copy of the head
    (ParallelLMHead.quantize_w4); the CPU keeps its own head."""
    fmt = resolve_format(path, load_format)
    method = resolve_quantization(config, fmt, quantization or default_quantization(path, fmt, fast_cpu))
    model = _load(config, path, fmt, method, dtype, device, tp_rank, tp_size)
    if quantize_lm_head and torch.device(device).type != "cpu" and model.lm_head.w4 is None:
        model.lm_head.quantize_w4(tied=config.tie_word_embeddings)  # (a checkpoint's 4-bit head stays)
    if fast_cpu and method == "w4a16" and torch.device(device).type == "cpu":
        from homelab_llm.engine.model.cpu_kernels import use_cpu_kernels

        use_cpu_kernels(model)
    return model


def _load(config: ModelConfig, path: str | Path, fmt: str, method: str | None, dtype: torch.dtype,
          device: torch.device | str, tp_rank: int, tp_size: int) -> nn.Module:
    if (parallel_state.tp_rank(), parallel_state.tp_size()) != (tp_rank, tp_size):
        # Layers read the rank at construction; keep the process-wide state in step with the call.
        parallel_state.set_parallel_state(tp_rank, tp_size)
    device = torch.device(device)
    if method == "w4a16" and fmt == "gguf":
        return _load_gguf_w4a16(config, path, dtype, device).eval()
    if method == "w4a16":
        return _load_w4a16(config, Path(path), fmt, dtype, device).eval()
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config)(config)
    if fmt == "dummy":
        fill_dummy_weights(model, seed=0)
    elif fmt == "gguf":
        from homelab_llm.engine.model.gguf_file import open_gguf

        gguf = open_gguf(path)
        gguf.check_tensor_types()
        load_weights(model, gguf.weights(config, dtype), str(path))
    else:
        from homelab_llm.engine.model.safetensors_files import safetensors_weights

        load_weights(model, ((n, t, None) for n, t in safetensors_weights(Path(path))), str(path))
    return model.eval()


def _load_w4a16(config: ModelConfig, path: Path, fmt: str, dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    """Dummy or GPTQ/AutoRound/AWQ weights, linears built as meta placeholders so no dense copy
    of a 4-bit weight is ever allocated."""
    from homelab_llm.engine.layers.linear import deferred_weights

    with _default_dtype(dtype), torch.device(device), deferred_weights():
        model = model_class(config)(config)
    if fmt == "dummy":
        from homelab_llm.engine.model.w4a16_dummy import fill_dummy_w4

        fill_dummy_w4(model, device, dtype, seed=0)
        fill_dummy_weights(model, seed=0)
        return model
    from homelab_llm.engine.model.w4a16_checkpoint import load_quantized_checkpoint

    load_weights(model, load_quantized_checkpoint(model, path, config.quantization or {}, device, dtype),
                 str(path))
    return model


def _load_gguf_w4a16(config: ModelConfig, path: str | Path, dtype: torch.dtype,
                     device: torch.device) -> nn.Module:
    """Linear weights start as meta placeholders: 4-bit ones are repacked from the file's blocks
    straight to W4A16, the rest materialized and dequantized, so no dense copy of a 4-bit
    weight ever exists on the device."""
    from homelab_llm.engine.layers.linear import LinearBase, deferred_weights
    from homelab_llm.engine.model.gguf_file import open_gguf
    from homelab_llm.engine.model.w4a16 import install_w4, plan_w4a16

    gguf = open_gguf(path)
    gguf.check_tensor_types()
    with _default_dtype(dtype), torch.device(device), deferred_weights():
        model = model_class(config)(config)
    plan = plan_w4a16(model, gguf)
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name not in plan:
            module.materialize(device, dtype)
    keep = {tensor for tensors in plan.values() for tensor in tensors}
    load_weights(model, gguf.weights(config, dtype, keep_quantized=keep), str(path))
    for name in plan:
        install_w4(model.get_submodule(name), device, dtype)
    return model


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor, Any]],
                 where: str) -> None:
    """Route each checkpoint tensor (HF name) to its parameter's weight_loader; all must arrive."""
    loaded: set[tuple[str, Any]] = set()
    for name, tensor, blocks in split_parts(model, weights):
        if name == "rope_freqs":
            model.model.rotary.set_freq_factors(tensor)
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints still ship the copy
        target, shard_id = route(model, name)
        # Looked up each time: a W4A16 load may materialize a placeholder while streaming.
        param = _parameter(model, target)
        if param is None:
            continue  # e.g. rotary inv_freq buffers saved by old transformers versions
        if tensor is None:  # kept 4-bit (W4A16): only its blocks are recorded
            model.get_submodule(target.rsplit(".", 1)[0]).record_gguf_blocks(blocks, shard_id)
            loaded.add((target, shard_id))
            continue
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as err:
            raise ModelLoadError(f"{where}: tensor {name}: {err}") from None
        if blocks is not None:
            model.get_submodule(target.rsplit(".", 1)[0]).record_gguf_blocks(blocks, shard_id)
        loaded.update((target, sid) for sid in _covered_parts(model, target, shard_id))
    # Looked up afresh: a linear given a 4-bit weight while loading no longer has a dense one.
    missing = [f"{name}[{sid}]" if sid is not None else name
               for name, _ in model.named_parameters()
               for sid in _parts_of(model, name) if (name, sid) not in loaded]
    if missing and all(name.startswith("mtp.") for name in missing):
        raise ModelLoadError(
            f'{where}: --speculative-config method "mtp" needs the checkpoint\'s mtp.* weights and '
            f'{missing[0]} is missing; use {{"method": "ngram", ...}} with this checkpoint')
    if missing:
        raise ModelLoadError(
            f"{where}: {len(missing)} weights are missing from the checkpoint "
            f"(e.g. {', '.join(missing[:5])})")


def route(model: nn.Module, name: str) -> tuple[str, Any]:
    """A checkpoint tensor name (its part suffix, if split, after '#') -> (our parameter name,
    shard_id) through the model's fused-module table."""
    name, _, split_id = name.partition("#")
    expert = expert_target(name)
    if expert is not None:  # mlp.experts.<e>.<proj>.weight or the fused experts.gate_up_proj
        return expert
    parts = name.split(".")
    if split_id:
        fused = model.split_modules[parts[-2]].fused
        return ".".join(parts[:-2] + [fused, parts[-1]]), split_id
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        fused, shard_id = model.packed_modules[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard_id
    return name, None


def split_parts(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor, Any]]
                ) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """Checkpoint tensors in the model's naming (checkpoint_name: None drops one); a tensor that
    holds several parts of one fused weight (split_modules) comes out as one `name#part` each.
    A model with `combine_checkpoint` (gpt-oss's MXFP4 experts) first rewrites the stream."""
    splits = model.split_modules
    combine = getattr(model, "combine_checkpoint", None)
    if combine is not None:
        weights = combine(weights)
    for name, tensor, blocks in weights:
        name = model.checkpoint_name(name)
        if name is None:
            continue
        parts = name.split(".")
        if "#" in name or len(parts) < 2 or parts[-2] not in splits or tensor is None:
            yield name, tensor, blocks
            continue
        try:
            pieces = splits[parts[-2]].take(tensor)
        except ValueError as err:
            raise ModelLoadError(f"tensor {name}: {err}") from None
        for part, piece in pieces:
            yield f"{name}#{part}", piece, blocks


def _parameter(model: nn.Module, name: str) -> nn.Parameter | None:
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    param = module._parameters.get(leaf)
    return param if isinstance(param, nn.Parameter) else None


def _parts_of(model: nn.Module, param_name: str) -> list[Any]:
    """The shard ids a parameter is loaded in: [None], or each part of a fused weight."""
    from homelab_llm.engine.layers.linear import LinearBase

    module_name, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(module, FusedExperts):
        return list(module.part_ids(leaf))
    return module.part_ids() if isinstance(module, LinearBase) else [None]


def _covered_parts(model: nn.Module, target: str, shard_id: Any) -> list[Any]:
    """The shard ids one loaded tensor fills: all experts' for a fused expert tensor."""
    if isinstance(shard_id, ExpertPart):
        return shard_id.covers(model.get_submodule(target.rpartition(".")[0]).num_experts)
    return [shard_id]


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights: each tensor seeded from its name, drawn on its own device.

    Norm weights stay 1 (as trained models roughly are); everything else ~ N(0, DUMMY_STD), but
    MXFP4 expert bytes (uint8): random codes with scales near 2^-7.
    Each rank draws its own shard, so a TP>1 dummy model is not the TP=1 one split.
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed(seed + zlib.crc32(f"{name}@{parallel_state.tp_rank()}".encode()))
        if param.dtype == torch.uint8:  # MXFP4 experts: random e2m1 codes, e8m0 scales ~ 2^-7
            low, high = (119, 122) if name.endswith("_scales") else (0, 256)
            param.data.random_(low, high, generator=gen)
            continue
        param.data.normal_(0.0, DUMMY_STD, generator=gen)
