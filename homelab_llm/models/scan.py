"""Find models on disk: the Hugging Face cache, ~/models and the folders a user configured.

What counts as a model:
- a `*.gguf` file (each one; a repo of several quantizations lists each file);
- an HF folder: `config.json` beside `*.safetensors` weights (or a safetensors index);
- in the Hub cache (`hub/models--org--name/snapshots/<rev>/`), each snapshot, named "org/name"
  (with "@rev" when a repo holds several), and any GGUF files inside it.
A walk stops descending at a model folder, skips hidden folders and goes at most MAX_DEPTH deep,
so pointing it at $HOME stays quick. A path found twice (a configured folder inside another) is
listed once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from homelab_llm.models.describe import LocalModel, describe_gguf, describe_hf

MAX_DEPTH = 4
HUB_PREFIX = "models--"
# llama.cpp's gguf-split names: model-00001-of-00003.gguf. Parts 2.. are listed with part 1.
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps downloads, by its own environment variables."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def default_dirs(configured: Iterable[str | Path] = ()) -> list[Path]:
    """The Hub cache, ~/models, then the configured folders (in that order, duplicates dropped)."""
    out: list[Path] = []
    for d in (hf_hub_cache(), Path("~/models").expanduser(), *map(Path, configured)):
        d = d.expanduser()
        if d not in out:
            out.append(d)
    return out


def is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()
        or any(folder.glob("*.bin")))


def _hub_snapshots(cache: Path) -> Iterator[tuple[str, Path]]:
    """(display name, snapshot folder) per cached model repo revision."""
    for repo in sorted(cache.glob(HUB_PREFIX + "*")):
        repo_id = repo.name.removeprefix(HUB_PREFIX).replace("--", "/", 1)
        snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        for snap in snapshots:
            yield (repo_id if len(snapshots) == 1 else f"{repo_id}@{snap.name[:8]}"), snap


def _walk(root: Path, depth: int = 0) -> Iterator[tuple[str | None, Path]]:
    """(name or None, path) for every model below root; a model folder is not entered further."""
    if root.is_file():
        if root.suffix == ".gguf":
            yield None, root
        return
    if is_hf_folder(root):
        yield None, root
        return
    if depth >= MAX_DEPTH:
        return
    try:
        children = sorted(root.iterdir())
    except OSError:
        return
    for child in children:
        if not child.name.startswith("."):
            yield from _walk(child, depth + 1)


def _candidates(root: Path) -> Iterator[tuple[str | None, Path]]:
    if root.is_dir() and any(root.glob(HUB_PREFIX + "*")):  # a Hub cache (or its hub/ folder)
        for repo_id, snap in _hub_snapshots(root):
            if is_hf_folder(snap):
                yield repo_id, snap
            for gguf in sorted(snap.rglob("*.gguf")):
                yield f"{repo_id}/{gguf.relative_to(snap)}", gguf
        return
    yield from _walk(root)


def find_models(dirs: Iterable[str | Path]) -> list[LocalModel]:
    """Every model below dirs, described (headers only), in the order found."""
    seen: set[Path] = set()
    models: list[LocalModel] = []
    for d in dirs:
        root = Path(d).expanduser()
        if not root.exists():
            continue
        for name, path in _candidates(root):
            key = path.resolve() if path.is_dir() else path.absolute()
            if key in seen:
                continue
            seen.add(key)
            if path.suffix == ".gguf" and path.is_file():
                split = SPLIT_PART.search(path.name)
                if split and split.group(1) != "00001":
                    continue
                models.append(describe_split(path, name, int(split.group(2))) if split
                              else describe_gguf(path, name))
            else:
                models.append(describe_hf(path, name))
    return models


def describe_split(first: Path, name: str | None, parts: int) -> LocalModel:
    """A gguf-split model, listed once: its size is every part's; the engine reads one file."""
    model = describe_gguf(first, name)
    for i in range(2, parts + 1):
        part = first.with_name(SPLIT_PART.sub(f"-{i:05d}-of-{parts:05d}.gguf", first.name))
        model.size_bytes += part.stat().st_size if part.exists() else 0
    model.supported, model.config = False, None
    model.reason = (f"split GGUF ({parts} parts): merge it into one file with "
                    "`llama-gguf-split --merge`")
    return model


def scan_configured() -> list[LocalModel]:
    """What `homelab-llm models` lists without flags: the cache, ~/models, models_dirs."""
    from homelab_llm.settings import load_settings

    return find_models(default_dirs(load_settings().models_dirs))
