"""`dsv41 download`: fetch the EXL3 pack (or, for Engram, only the original checkpoint's files that hold the tables)
from the Hugging Face Hub through huggingface_hub, at a pinned revision, and verify every file.

Steps: resolve the revision to its commit and list the files with their sizes and hashes (`model_info(...,
files_metadata=True)`), keep the files the patterns allow, check the free space against what is still to fetch,
then per file: its metadata (`get_hf_file_metadata`: commit, redirect), and `http_get` into
`DIR/.dsv41-partial/NAME.part` from where that part ends (a `Range` request; huggingface_hub retries a cut
connection from where it stopped, in 10 MiB steps). huggingface_hub's own `hf_hub_download` removes a partial
file when a run fails (2.x), so a stopped run would start a 5 GB shard over; the kept `.part` is what lets the next
run continue it. Each finished part's SHA-256 is checked against the Hub's LFS metadata (small files: the git blob
id) while the next file downloads, then moved into place. A file that fails its check is removed and the command
fails naming it. What was verified is recorded in `.dsv41-download.json` in the
folder (repo, commit, SHA-256 per file): a later run skips those files, and `dsv41 prepare` takes the checkpoint's
identity and file hashes from it. HF_ENDPOINT points the command at another Hub (a mirror, or the tests' local one).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsv41.errors import DSV41Error
from dsv41.prepared.manifest import DOWNLOAD_RECORD

PACK_REPO = "Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-2.9bpw"  # EXL3-ENGRAM.md §4.1
PACK_REVISION = "64ba41b6c916a587db06eae2e19b7845f7be6e6b"
SPACE_MARGIN = 1 << 30  # left free beyond the files (metadata, logs, the record)
HASH_BLOCK = 16 << 20


class DownloadError(DSV41Error):
    """A download that cannot go on (the message is the one-line reason)."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1 (small files)


def _endpoint(endpoint: str | None = None) -> str:
    from huggingface_hub import constants

    return endpoint or constants.ENDPOINT


def remote_files(repo: str, revision: str, endpoint: str | None = None) -> tuple[str, list[RemoteFile]]:
    """(commit, files) of `repo` at `revision` (a branch, tag or commit), one-line errors for what is missing."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = _endpoint(endpoint)
    try:
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True)
    except RevisionNotFoundError:
        raise DownloadError(f"revision {revision} not found in {repo} (at {endpoint})") from None
    except RepositoryNotFoundError:
        raise DownloadError(f"repository {repo} not found at {endpoint} (check the name; a private or gated "
                            f"repository needs HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise DownloadError(f"{repo}@{revision}: the Hub answered {exc.response.status_code} "
                            f"({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # network: connection refused, DNS, TLS, timeouts (httpx's own classes)
        raise DownloadError(f"cannot reach {endpoint} for {repo}: {type(exc).__name__}: {exc}") from None
    files = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else (s.size or 0), s.lfs.sha256 if s.lfs else None,
                        s.blob_id) for s in info.siblings or []]
    return info.sha, files


def select(files: list[RemoteFile], patterns: list[str] | None) -> list[RemoteFile]:
    if not patterns:
        return list(files)
    return [f for f in files if any(fnmatch.fnmatch(f.name, p) for p in patterns)]


def file_digests(path: Path) -> tuple[str, str]:
    """(SHA-256, git blob SHA-1) of a file, in one pass."""
    sha256 = hashlib.sha256()
    blob = hashlib.sha1()
    blob.update(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_BLOCK):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


def _record(dest: Path) -> dict:
    try:
        return json.loads((dest / DOWNLOAD_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(dest: Path, record: dict) -> None:
    tmp = dest / (DOWNLOAD_RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, dest / DOWNLOAD_RECORD)


PARTIAL = ".dsv41-partial"


def _part(dest: Path, name: str) -> Path:
    return dest / PARTIAL / (name + ".part")


def _partial_bytes(dest: Path) -> int:
    """Bytes already in kept `.part` files (they count toward what is still to fetch)."""
    parts = dest / PARTIAL
    return sum(p.stat().st_size for p in parts.rglob("*.part")) if parts.is_dir() else 0


def check_space(dest: Path, todo: list[RemoteFile], free: int | None = None) -> None:
    need = max(sum(f.size for f in todo) - _partial_bytes(dest), 0)
    free = shutil.disk_usage(dest).free if free is None else free
    if need + SPACE_MARGIN > free:
        gib = 2 ** 30
        raise DownloadError(f"{dest}: {len(todo)} file(s) need {need / gib:.2f} GiB more (+ {SPACE_MARGIN / gib:.0f} "
                            f"GiB margin), only {free / gib:.2f} GiB free")


def _verify(dest: Path, f: RemoteFile) -> str:
    """Check the finished part against the Hub's hash and move it into place: its SHA-256. A part that fails is
    removed and the run fails."""
    part = _part(dest, f.name)
    sha256, blob = file_digests(part)
    if (f.sha256 is not None and sha256 != f.sha256) or (f.sha256 is None and f.blob_id and blob != f.blob_id):
        want, got = (f.sha256, sha256) if f.sha256 else (f.blob_id, blob)
        part.unlink()
        raise DownloadError(f"{f.name}: checksum {got} differs from the Hub's {want} (file removed; run the same "
                            f"command again to fetch it anew)")
    (dest / f.name).parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest / f.name)
    return sha256


def _fetch(repo: str, commit: str, dest: Path, f: RemoteFile, endpoint: str) -> None:
    """The file into its part, continuing a part a stopped run left."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import get_hf_file_metadata, http_get
    from huggingface_hub.utils import build_hf_headers

    part = _part(dest, f.name)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > f.size:  # not a prefix of this file
        part.unlink()
        have = 0
    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, f.name, revision=commit, endpoint=endpoint))
        if meta.commit_hash and meta.commit_hash != commit:
            raise DownloadError(f"{f.name}: the Hub served commit {meta.commit_hash}, not {commit}")
        with part.open("r+b" if have else "wb") as out:
            out.seek(have)
            http_get(meta.location, out, resume_size=have, headers=build_hf_headers(), expected_size=f.size,
                     displayed_filename=f.name)
    except DSV41Error:
        raise
    except Exception as exc:  # httpx / huggingface_hub errors after their own retries, OSError (disk full)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        kept = part.stat().st_size if part.exists() else 0
        raise DownloadError(f"{f.name}: download interrupted ({type(exc).__name__}: {reason}); {kept} bytes kept, "
                            f"run the same command again to resume it") from None


def download(repo: str, revision: str, dest: str | Path, patterns: list[str] | None = None,
             log: Callable[[str], None] | None = None, endpoint: str | None = None) -> dict:
    """Fetch and verify the files of `repo`@`revision` matching `patterns` into `dest` (from `endpoint`, default
    HF_ENDPOINT or the Hub); returns the record."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    endpoint = _endpoint(endpoint)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # one bar per file in a terminal; none in logs
    commit, files = remote_files(repo, revision, endpoint)
    if len(revision) == 40 and commit != revision:
        raise DownloadError(f"{repo}: revision {revision} resolved to commit {commit}")
    wanted = select(files, patterns)
    if not wanted:
        raise DownloadError(f"no file of {repo}@{revision} matches {', '.join(patterns or [])}")
    record = _record(dest)
    if record.get("repo") != repo or record.get("revision") != commit:
        record = {"repo": repo, "revision": commit, "sha256": {}, "sizes": {}}
    record.update(requested_revision=revision, endpoint=endpoint)
    done = {f.name for f in wanted if record["sha256"].get(f.name) and (dest / f.name).is_file()
            and (dest / f.name).stat().st_size == f.size}
    todo = [f for f in wanted if f.name not in done]
    total = sum(f.size for f in wanted)
    log(f"download: {repo}@{commit[:12]}: {len(wanted)} file(s), {total / 2**30:.2f} GiB; {len(done)} already "
        f"verified, {len(todo)} to fetch")
    check_space(dest, todo)
    start = time.perf_counter()
    with ThreadPoolExecutor(1, thread_name_prefix="download-verify") as hasher:
        pending: list[tuple[RemoteFile, Future]] = []

        def settle(keep: int) -> None:
            while len(pending) > keep:
                f, fut = pending.pop(0)
                record["sha256"][f.name] = fut.result()
                record["sizes"][f.name] = f.size
                _write_record(dest, record)

        try:
            for f in todo:
                _fetch(repo, commit, dest, f, endpoint)
                pending.append((f, hasher.submit(_verify, dest, f)))  # hashed while the next one downloads
                settle(1)
            settle(0)
        finally:
            for _, fut in pending:
                fut.cancel()
    seconds = time.perf_counter() - start
    fetched = sum(f.size for f in todo)
    log(f"download: {dest} complete and verified ({fetched / 2**30:.2f} GiB in {seconds:.1f} s"
        f"{f', {fetched / 2**20 / max(seconds, 1e-9):.1f} MiB/s' if todo else ''})")
    return record


def download_engram_source(repo: str, revision: str, dest: str | Path, log=None, endpoint: str | None = None
                           ) -> dict:
    """The original checkpoint's small files, then only the shards holding the Engram tables (`dsv41 engram pack
    --src DEST` reads them)."""
    from dsv41.engram.source import SMALL_FILES, OriginalCheckpoint

    download(repo, revision, dest, list(SMALL_FILES), log, endpoint)
    tables = sorted(set(OriginalCheckpoint(dest, repo=repo, revision=revision).table_files().values()))
    return download(repo, revision, dest, list(SMALL_FILES) + tables, log, endpoint)
