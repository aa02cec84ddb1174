"""Pull a model repo from the Hugging Face Hub into its cache, with a fit check first.

Order: list the repo (commit, files, checksums; huggingface_hub's API) -> fetch config.json and
fit the model to the machine (`fit_model`, the numbers `plan` gives) -> download each file
(download.py: resumes a `.incomplete` blob an interrupted pull left) -> verify each file's size
and checksum. HF_TOKEN and HF_ENDPOINT are honoured (read when the pull starts). Progress arrives as
`PullProgress` values on the caller's callback, from the downloading thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_llm.models.download import FileProgress, download_file, repo_cache_dir, write_ref
from homelab_llm.models.fit import Fit, Machine, fit_model
from homelab_llm.models.hub import PullError, RemoteRepo, hub_endpoint, list_repo
from homelab_llm.models.scan import hf_hub_cache


@dataclass(frozen=True)
class PullProgress:
    file_index: int  # 1-based
    file_count: int
    file: FileProgress


@dataclass(frozen=True)
class FitCheck:
    verdict: str  # one line for a person
    fit: Fit | None  # None: nothing to fit yet (GGUF-only repo, unsupported, or no GPU)
    blocks: bool  # True: unsupported or does not fit (refused unless forced)


@dataclass(frozen=True)
class PullResult:
    path: Path  # the snapshot folder
    repo: RemoteRepo
    fit: FitCheck


ProgressCallback = Callable[[PullProgress], None]


def check_fit(repo: RemoteRepo, machine: Machine | None,
              fetch: Callable[[str], Path]) -> FitCheck:
    """Fit the model before its weights come down: config.json is small and says enough."""
    from homelab_llm.engine.model.config import QUANT_CONFIG_FILES, config_from_hf, read_hf_config
    from homelab_llm.engine.model.quant_config import parse_quant_config
    from homelab_llm.errors import HomelabError

    names = {f.path for f in repo.files}
    if "config.json" not in names:
        if any(n.endswith(".gguf") for n in names):
            return FitCheck("fit: checked after download (a GGUF carries its shape inside)",
                            None, False)
        return FitCheck("fit: no config.json in the selection; not checked", None, False)
    folder = fetch("config.json").parent
    for side_file in QUANT_CONFIG_FILES:  # older quantizers keep the 4-bit settings beside it
        if side_file in names:
            fetch(side_file)
    where = f"{repo.repo_id}/config.json"
    try:
        config = config_from_hf(read_hf_config(folder), name=repo.repo_id, where=where)
        parse_quant_config(config.quantization, where)
    except HomelabError as err:
        return FitCheck(f"fit: the engine cannot run this model ({err})", None, True)
    return verdict_line(config, machine)


def verdict_line(config: Any, machine: Machine | None) -> FitCheck:
    if machine is None:
        return FitCheck("fit: no GPU found to check against (give --gpu-memory)", None, False)
    fit = fit_model(config, machine)
    where = f"{machine.tensor_parallel_size} x {machine.gpu_memory_bytes / 2**30:.1f} GiB"
    if not fit.fits:
        return FitCheck(f"fit: does NOT fit {where}: {fit.reason}", fit, True)
    return FitCheck(f"fit: fits {where}: up to {fit.max_context:,} tokens of context at int8 KV, "
                    f"{fit.concurrency_32k} sequences of 32K at once", fit, False)


def pull(repo_id: str, *, include: Iterable[str] = (), revision: str | None = None,
         machine: Machine | None = None, force: bool = False,
         on_fit: Callable[[FitCheck], None] | None = None,
         on_progress: ProgressCallback | None = None, token: str | None = None) -> PullResult:
    """Download repo_id (files matching include) into the Hub cache; resumes, verifies."""
    import os

    import httpx
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    token = token or os.environ.get("HF_TOKEN") or None
    revision = revision or "main"
    repo = list_repo(repo_id, revision, include, token)
    ggufs = [f.path for f in repo.files if f.path.endswith(".gguf")]
    if len(ggufs) > 1 and not include:  # a quantization zoo: one file is what a person wants
        shown = ", ".join(ggufs[:8]) + (", ..." if len(ggufs) > 8 else "")
        raise PullError(f"{repo_id} holds {len(ggufs)} GGUF files ({shown}); pick one with "
                        "--include, e.g. --include '*Q4_K_M*'")
    cache = hf_hub_cache()
    headers = build_hf_headers(token=token, library_name="homelab-llm")
    by_path = {f.path: f for f in repo.files}
    report = on_progress or (lambda p: None)
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=120.0)) as client:

        def fetch(path: str, index: int = 0) -> Path:
            remote = by_path[path]
            url = hf_hub_url(repo_id, path, revision=repo.commit, endpoint=hub_endpoint())
            return download_file(client, url, headers, cache, repo_id, repo.commit, remote,
                                 lambda p: report(PullProgress(index, len(repo.files), p)))

        fit = check_fit(repo, machine, fetch)
        if on_fit:
            on_fit(fit)
        if fit.blocks and not force:
            raise PullError(f"{repo_id}: not downloaded: {fit.verdict.removeprefix('fit: ')} "
                            "(pass --force to download anyway)")
        for index, remote in enumerate(repo.files, 1):
            fetch(remote.path, index)
    write_ref(cache, repo_id, revision, repo.commit)
    snapshot = repo_cache_dir(cache, repo_id) / "snapshots" / repo.commit
    if fit.fit is None and machine is not None:  # GGUF: its shape is known now
        fit = _fit_downloaded(snapshot, repo, machine) or fit
        if on_fit:
            on_fit(fit)
    return PullResult(snapshot, repo, fit)


def _fit_downloaded(snapshot: Path, repo: RemoteRepo, machine: Machine) -> FitCheck | None:
    from homelab_llm.models.describe import describe_gguf

    for remote in repo.files:
        if remote.path.endswith(".gguf"):
            model = describe_gguf(snapshot / remote.path)
            if model.config is None:
                return FitCheck(f"fit: the engine cannot run {remote.path} ({model.reason})",
                                None, True)
            return verdict_line(model.config, machine)
    return None
