"""What a Hub repo holds (files, sizes, checksums) and checks of downloaded files against it.

The listing comes from huggingface_hub's own API calls (repo info for the commit, the recursive
tree for sizes and hashes), so a private mirror behind HF_ENDPOINT works as the Hub does. A file
is verified by its LFS sha256 when it has one (weights), else by its git blob id (small text
files), both computed while reading the file once.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from homelab_llm.errors import HomelabError

HASH_CHUNK = 8 << 20


class PullError(HomelabError):
    """A repo, revision or file that cannot be fetched or verified; the message says what to do."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # LFS files (weights): the content's sha256
    blob_id: str | None  # every file: git's blob sha1 of the content


@dataclass(frozen=True)
class RemoteRepo:
    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def hub_endpoint() -> str | None:
    """HF_ENDPOINT read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def _api_error(repo_id: str, revision: str, err: Exception) -> PullError:
    from huggingface_hub.errors import (GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if isinstance(err, RevisionNotFoundError):
        return PullError(f"{repo_id}: no revision {revision!r}; check --revision")
    if isinstance(err, GatedRepoError):
        return PullError(f"{repo_id} is gated: accept its terms on the Hub and set HF_TOKEN")
    if isinstance(err, RepositoryNotFoundError):
        return PullError(f"{repo_id}: no such repo (or it is private: set HF_TOKEN)")
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return PullError(f"{repo_id}: the Hub did not answer ({first})")


def list_repo(repo_id: str, revision: str = "main", include: Iterable[str] = (),
              token: str | None = None) -> RemoteRepo:
    """The commit `revision` points at and the files there matching any include pattern."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=hub_endpoint(), token=token)
    try:
        commit = api.repo_info(repo_id, revision=revision).sha
        entries = [f for f in api.list_repo_tree(repo_id, revision=commit, recursive=True)
                   if isinstance(f, RepoFile)]
    except Exception as err:  # huggingface_hub raises many kinds; each becomes one line
        raise _api_error(repo_id, revision, err) from None
    patterns = list(include)
    files = tuple(RemoteFile(f.path, int(f.size), f.lfs.sha256 if f.lfs else None, f.blob_id)
                  for f in entries
                  if not patterns or any(fnmatch.fnmatch(f.path, p) for p in patterns))
    if not files:
        raise PullError(f"{repo_id}@{revision}: no files match --include {' '.join(patterns)}"
                        if patterns else f"{repo_id}@{revision}: the repo holds no files")
    return RemoteRepo(repo_id, str(commit), files)


def file_digests(path: Path) -> tuple[str, str, int]:
    """(sha256, git blob sha1, size) of a file, read once."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest(), size


def verify_file(local: Path, remote: RemoteFile) -> None:
    """Raise PullError when the downloaded file is not the one the Hub lists. The bad file is
    removed (blob and snapshot link) so that pulling again downloads it afresh."""
    sha256, blob_id, size = file_digests(local)
    problem = ""
    if size != remote.size:
        problem = f"size {size} bytes, expected {remote.size}"
    elif remote.sha256 and sha256 != remote.sha256:
        problem = f"sha256 {sha256[:16]}..., expected {remote.sha256[:16]}..."
    elif not remote.sha256 and remote.blob_id and blob_id != remote.blob_id:
        problem = f"git blob id {blob_id[:16]}..., expected {remote.blob_id[:16]}..."
    if problem:
        real = local.resolve()
        for p in {real, local}:
            try:
                p.unlink()
            except OSError:
                pass
        raise PullError(f"{remote.path}: checksum mismatch ({problem}); the corrupt file was "
                        "removed, run pull again")
