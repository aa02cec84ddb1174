"""Download one Hub file into huggingface_hub's cache layout, resuming what an earlier,
interrupted pull left behind.

huggingface_hub (>= 1.x) deletes a partial download when its process ends, so a pull killed at
90% of 40 GB would start over; here the bytes stay in `blobs/<etag>.incomplete` and the next pull
asks only for the rest (HTTP Range). The finished file lands where huggingface_hub puts it
(`blobs/<etag>`, `snapshots/<commit>/<path>` a relative symlink, `refs/<revision>`), so
transformers, vLLM and `huggingface-cli` see the same cache. The etag is the Hub's: the LFS
sha256 for weights, the git blob id for small files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from homelab_llm.models.hub import PullError, RemoteFile, verify_file

ATTEMPTS = 3  # in-process retries for a dropped connection before giving up (the bytes stay)
RETRY_DELAY_S = 0.5
PROGRESS_EVERY_S = 0.2


@dataclass(frozen=True)
class FileProgress:
    filename: str
    done_bytes: int  # including what an earlier pull already had
    total_bytes: int
    rate_bps: float  # bytes per second received in this run
    resumed_from: int = 0
    finished: bool = False


def repo_cache_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _stream_once(client: httpx.Client, url: str, headers: dict[str, str], part: Path,
                 total: int, report: Callable[[int], None]) -> None:
    have = part.stat().st_size if part.exists() else 0
    if have >= total:
        return
    ask = dict(headers, **({"Range": f"bytes={have}-"} if have else {}))
    with client.stream("GET", url, headers=ask) as response:
        if response.status_code == 416:  # the server says our partial is no prefix: start over
            part.unlink(missing_ok=True)
            raise httpx.TransportError("range not satisfiable; restarting the file")
        if response.status_code >= 500 or response.status_code in (408, 429):  # worth a retry
            raise httpx.TransportError(f"HTTP {response.status_code} from the server")
        if response.status_code >= 400:
            response.read()
            raise PullError(f"HTTP {response.status_code} from {url}: {response.text[:200].strip()}")
        mode = "ab" if have and response.status_code == 206 else "wb"  # 200: the whole file again
        with part.open(mode) as f:
            for chunk in response.iter_bytes():  # as received: a drop keeps every byte so far
                f.write(chunk)
                report(len(chunk))


def download_file(client: httpx.Client, url: str, headers: dict[str, str], cache: Path,
                  repo_id: str, commit: str, remote: RemoteFile,
                  on_progress: Callable[[FileProgress], None]) -> Path:
    """The file's path in the snapshot, downloaded (or resumed) and verified."""
    repo_dir = repo_cache_dir(cache, repo_id)
    etag = remote.sha256 or remote.blob_id or f"{commit}-{remote.path}".replace("/", "_")
    blob = repo_dir / "blobs" / etag
    link = repo_dir / "snapshots" / commit / remote.path
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(etag + ".incomplete")
    resumed = part.stat().st_size if part.exists() else 0
    started, received, last = time.monotonic(), 0, 0.0

    def emit(finished: bool = False) -> None:
        rate = received / max(time.monotonic() - started, 1e-6)
        on_progress(FileProgress(remote.path, resumed + received, remote.size, rate, resumed,
                                 finished))

    def report(n: int) -> None:
        nonlocal received, last
        received += n
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            emit()

    if not (blob.is_file() and blob.stat().st_size == remote.size):
        emit()
        for attempt in range(ATTEMPTS):
            try:
                _stream_once(client, url, headers, part, remote.size, report)
                break
            except httpx.TransportError as err:
                if attempt == ATTEMPTS - 1:
                    raise PullError(f"{remote.path}: download interrupted ({err}); "
                                    f"{part.stat().st_size if part.exists() else 0:,} bytes kept, "
                                    "run pull again to resume") from None
                time.sleep(RETRY_DELAY_S)
        verify_file(part, remote)  # a bad file is removed, never moved into place
        os.replace(part, blob)
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(blob, link.parent))
    emit(finished=True)
    return link


def write_ref(cache: Path, repo_id: str, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, so tools asking for "main" find this snapshot offline."""
    if revision == commit:
        return
    ref = repo_cache_dir(cache, repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
