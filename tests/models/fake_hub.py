"""A fake Hugging Face Hub on 127.0.0.1 (ephemeral port): just the endpoints huggingface_hub
calls for hf_hub_download / repo listing, with Range support, a way to cut a download short
and go down (an interrupted pull), and a way to advertise a wrong checksum.

    GET  /api/models/{repo}/revision/{rev}           repo info (sha = the commit)
    GET  /api/models/{repo}/tree/{rev}?recursive=1    files with size, oid and lfs.sha256
    HEAD /{repo}/resolve/{rev}/{file}                 X-Repo-Commit, ETag / X-Linked-Etag, size
    GET  /{repo}/resolve/{rev}/{file}                 the bytes (206 for a Range request)
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    lfs: set[str] = field(default_factory=set)  # paths stored as LFS (sha256 in the tree)
    commit: str = "c0ffee" + "0" * 34
    advertised_sha256: dict[str, str] = field(default_factory=dict)  # lie about these


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.drop_after: dict[str, int] = {}  # file -> bytes sent before the connection drops
        self.down = False  # after a drop: downloads answer 503 until a test brings it back
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    # ------------------------------------------------------------------ routing

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        path = unquote(url.path)
        with self.lock:
            self.requests.append(Request("HEAD" if head else "GET", path, h.headers.get("Range"),
                                         h.headers.get("Authorization")))
        if path.startswith("/api/models/"):
            rest = path.removeprefix("/api/models/")
            kind = "/revision/" if "/revision/" in rest else "/tree/"
            repo_id, _, rev = rest.partition(kind)
            repo = self.repo(h, repo_id, rev.split("/")[0])
            if repo is None:
                return
            if kind == "/revision/":
                body = {"id": repo_id, "sha": repo.commit,
                        "siblings": [{"rfilename": p} for p in repo.files]}
            else:
                body = [self.tree_entry(repo, p) for p in sorted(repo.files)]
            return self.send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repo(h, "/".join(parts[:2]), parts[3])
            if repo is None:
                return
            return self.resolve(h, repo, "/".join(parts[4:]), head)
        self.send(h, 404, b"not found", {"X-Error-Code": "EntryNotFound"})

    def repo(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self.send(h, 404, b"Repository not found", {"X-Error-Code": "RepoNotFound",
                                                        "X-Error-Message": "Repository not found"})
        elif rev not in ("main", repo.commit):
            self.send(h, 404, b"Revision not found", {"X-Error-Code": "RevisionNotFound",
                                                      "X-Error-Message": "Invalid rev id"})
            return None
        return repo

    def tree_entry(self, repo: FakeRepo, path: str) -> dict[str, object]:
        data = repo.files[path]
        entry: dict[str, object] = {"type": "file", "path": path, "size": len(data), "oid": blob_id(data)}
        if path in repo.lfs:
            entry["lfs"] = {"oid": repo.advertised_sha256.get(path, sha256(data)),
                            "size": len(data), "pointerSize": 134}
        return entry

    def resolve(self, h: BaseHTTPRequestHandler, repo: FakeRepo, file: str, head: bool) -> None:
        if file not in repo.files:
            return self.send(h, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
        data = repo.files[file]
        etag = sha256(data) if file in repo.lfs else blob_id(data)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if file in repo.lfs:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        if head:
            return self.send(h, 200, b"", headers | {"Content-Length": str(len(data))}, head=True)
        if self.down:
            return self.send(h, 503, b"hub is down", {})
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng.removeprefix("bytes=").split("-")[0])
        body = data[start:]
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.drop_after.pop(file, None)
        if cut is not None:  # promise the whole body, send part of it, hang up, go down
            self.down = True
            h.close_connection = True
            h.send_response(status)
            for k, v in (headers | {"Content-Length": str(len(body))}).items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(body[:cut])
            h.wfile.flush()
            return
        self.send(h, status, body, headers)

    @staticmethod
    def send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str],
             head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def gets(self, file: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + file)]
