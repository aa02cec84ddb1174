"""One model on disk -> `LocalModel`: family, parameters, quantization, size, and whether the
engine can run it (with the reason when not).

Read through the engine's own parsers (config_from_hf, parse_quant_config, the GGUF header
reader), so "supported" here means exactly what loading would say. Headers only: no weight is
read, so describing a 70B folder takes milliseconds.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from homelab_llm.engine.model.config import (
    ModelConfig,
    config_from_hf,
    read_hf_config,
)
from homelab_llm.errors import HomelabError
from homelab_llm.models.params import HeaderError, ParamCount, gguf_params, hf_params

KIND_GGUF = "gguf"
KIND_HF = "hf"


@dataclass
class LocalModel:
    name: str  # "org/name" for a Hub cache entry, else the file or folder name
    path: str
    kind: str  # KIND_GGUF or KIND_HF
    family: str  # HF model_type or GGUF general.architecture; "?" when unreadable
    size_bytes: int
    params_total: int | None = None
    params_active: int | None = None
    quantization: str = ""  # "Q4_K_M", "gptq 4-bit g128", "bfloat16", ...
    supported: bool = False
    reason: str = ""  # why not supported ("" when it is)
    max_position_embeddings: int | None = None
    config: ModelConfig | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("config")
        return out


def _folder_size(folder: Path) -> int:
    """Bytes of every file below folder; symlinks followed (a Hub snapshot links into blobs/)."""
    total = 0
    for p in folder.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def _reason(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _apply_config(model: LocalModel, build: Any) -> None:
    """Run the engine's own config parse; an error is the reason the model is unsupported."""
    try:
        model.config = build()
    except HomelabError as err:
        model.reason = _reason(err)
        return
    model.supported = True
    model.max_position_embeddings = model.config.max_position_embeddings


def describe_gguf(path: Path, name: str | None = None) -> LocalModel:
    from gguf import LlamaFileType

    from homelab_llm.engine.model.gguf_file import open_gguf

    model = LocalModel(name or path.name, str(path), KIND_GGUF, "?", path.stat().st_size)
    try:
        gguf = open_gguf(path)
    except HomelabError as err:
        model.reason = _reason(err)
        return model
    meta = gguf.metadata()
    model.family = str(meta.get("general.architecture", "?"))
    count = gguf_params(((t.name, t.shape) for t in gguf.tensors.values()), meta)
    model.params_total, model.params_active = count.total, count.active
    file_type = meta.get("general.file_type")
    try:
        model.quantization = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):  # no or unknown file_type: the type holding the most bytes
        by_type: collections.Counter[str] = collections.Counter()
        for t in gguf.tensors.values():
            by_type[t.type_name] += t.n_bytes
        model.quantization = by_type.most_common(1)[0][0] if by_type else "?"
    _apply_config(model, gguf.config)
    return model


def _quant_label(raw: dict[str, Any]) -> str:
    q = raw.get("quantization_config") or {}
    if not q:
        return str(raw.get("torch_dtype") or raw.get("dtype") or "?")
    method = str(q.get("quant_method") or "?")
    bits = q.get("bits") or q.get("w_bit")
    group = q.get("group_size") or q.get("q_group_size")
    return " ".join(x for x in (method, f"{bits}-bit" if bits else "", f"g{group}" if group else "") if x)


def describe_hf(folder: Path, name: str | None = None) -> LocalModel:
    from homelab_llm.engine.model.quant_config import parse_quant_config

    model = LocalModel(name or folder.name, str(folder), KIND_HF, "?", _folder_size(folder))
    try:
        raw = read_hf_config(folder)
    except HomelabError as err:
        model.reason = _reason(err)
        return model
    model.family = str(raw.get("model_type") or (raw.get("architectures") or ["?"])[0])
    model.quantization = _quant_label(raw)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        try:
            count: ParamCount | None = hf_params(files, raw)
        except HeaderError as err:
            model.reason = f"unreadable safetensors header ({err})"
            return model
        model.params_total, model.params_active = count.total, count.active

    def build() -> ModelConfig:
        cfg = config_from_hf(raw, name=model.name, where=str(folder / "config.json"))
        parse_quant_config(cfg.quantization, str(folder / "config.json"))
        return cfg

    _apply_config(model, build)
    if model.supported and not files:
        model.supported, model.reason = False, "no *.safetensors weights (only .bin or none)"
    return model
