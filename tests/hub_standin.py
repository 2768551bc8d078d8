"""A local stand-in of the Hugging Face Hub's HTTP file endpoints, for `dsv41 download` tests (HF_ENDPOINT).

A real HTTP/1.1 server on 127.0.0.1 (http.server, one thread per connection) serving what huggingface_hub calls:
- `GET /api/models/{repo}/revision/{rev}` (`model_info(files_metadata=True)`): `sha` and `siblings` with sizes, git
  blob ids and, for LFS files, `lfs.sha256`; a missing repo or revision is a 404 with the Hub's `X-Error-Code`
  (`RepoNotFound`, `RevisionNotFound`), which huggingface_hub turns into its own exceptions;
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: `X-Repo-Commit`, `ETag` (the LFS sha256, else the blob id),
  `Content-Length`, `Accept-Ranges`, and `Range: bytes=N-` answered 206 with `Content-Range`.
Faults, per file: `cut[name] = n` sends the headers of the whole file, then n bytes, then drops the connection
(once); `refuse_after_cut` answers later requests for that file 503 (the run stops; a later run resumes);
`corrupt[name]` serves a flipped byte while the metadata keeps the true hash. `requests` logs
(method, path, Range) of every file request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class Repo:
    def __init__(self, files: dict[str, bytes], lfs: set[str], commit: str, refs: dict[str, str]):
        self.files, self.lfs, self.commit, self.refs = files, lfs, commit, refs

    def resolve(self, rev: str) -> str | None:
        return self.commit if rev == self.commit else self.refs.get(rev)

    def sibling(self, name: str) -> dict:
        data = self.files[name]
        out = {"rfilename": name, "size": len(data), "blobId": blob_id(data)}
        if name in self.lfs:
            out["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return out

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if name in self.lfs else blob_id(data)


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.cut: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.refuse_after_cut = False
        self.requests: list[tuple[str, str, str | None]] = []
        self._cut_done: set[str] = set()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                stand_in._handle(self, head=False)

            def do_HEAD(self):
                stand_in._handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add_repo(self, name: str, files: dict[str, bytes], lfs: set[str], commit: str, refs: dict[str, str]):
        self.repos[name] = Repo(files, lfs, commit, refs)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ routes
    def _error(self, h, status: int, code: str | None, message: str, head: bool = False) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(0 if head else len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _handle(self, h, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
        if m:
            return self._info(h, m.group(1), m.group(2), head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(h, m.group(1), m.group(2), m.group(3), head)
        self._error(h, 404, None, f"no route {path}", head)

    def _info(self, h, name: str, rev: str, head: bool) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        commit = repo.resolve(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        body = json.dumps({"id": name, "modelId": name, "sha": commit, "private": False,
                           "siblings": [repo.sibling(n) for n in sorted(repo.files)]}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _file(self, h, name: str, rev: str, filename: str, head: bool) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        commit = repo.resolve(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if filename not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{filename} does not exist", head)
        rng = h.headers.get("Range")
        if not head:
            self.requests.append(("GET", filename, rng))
        if not head and self.refuse_after_cut and filename in self._cut_done:
            return self._error(h, 503, None, "Service Unavailable", head)
        data = repo.files[filename]
        if filename in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-", rng.strip())
            start = int(m.group(1)) if m else 0
        part = data[start:]
        h.send_response(206 if rng else 200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{repo.etag(filename)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(part)))
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        cut = self.cut.get(filename)
        if cut is not None and filename not in self._cut_done and cut < len(part):
            self._cut_done.add(filename)
            h.wfile.write(part[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the connection drops mid-file
            return
        h.wfile.write(part)
