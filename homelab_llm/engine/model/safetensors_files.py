"""Tensors of an HF folder: one model.safetensors, or shards listed in model.safetensors.index.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from homelab_llm.engine.model.config import ModelLoadError
from homelab_llm.load_progress import LOAD

INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files, in index order; every file the index names must exist."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({err})") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index}: lists shard files that are missing: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (nor {INDEX_NAME}) in this folder")
    return files


def safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, read lazily one at a time from the memory-mapped files."""
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(folder)
    total, done = sum(path.stat().st_size for path in files), 0
    for shard, path in enumerate(files, 1):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    done += tensor.numel() * tensor.element_size()
                    LOAD.weights(done, total, shard, len(files), path.name)
                    yield name, tensor
        except SafetensorError as err:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({err})") from None
        LOAD.weights(done, total, shard, len(files), path.name, shard_done=True)


def safetensors_keys(folder: Path) -> set[str]:
    """Every tensor name in the folder's files, from their headers only (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        except SafetensorError as err:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({err})") from None
    return names
