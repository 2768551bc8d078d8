"""`dsv41 warm rankN` (dsv41-warm@.service): check a rank's files and build the kernel caches before the rank starts.

- Prepared folder: every `rank<R>/manifest.json` under DSV41_PREPARED_DIR lists chunks
  `{"file", "offset", "size", "sha256"}`; a sample (every 16th chunk and the last) is hashed. Pages are dropped
  behind each read (posix_fadvise DONTNEED): on GB10 the page cache is GPU memory, so warming must never leave the
  weights cached.
- Engram shards: headers and sizes (same check as preflight).
- Kernels: `dsv41.kernels.exl3.warmup.warm(cache_dir)` builds the CUDA EXL3 kernels for this GPU into the cubin
  cache ($DSV41_HOME/cuda; Triton compiles into TRITON_CACHE_DIR on first launch). It needs the GPU, hence here
  and not in the Nix build.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from pathlib import Path
from typing import Mapping

from dsv41.ops.knobs import rank_of_instance
from dsv41.ops.preflight import Node, check_engram

log = logging.getLogger(__name__)
SAMPLE_EVERY = 16


def _hash_range(path: Path, offset: int, size: int) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        position, left = offset, size
        while left > 0:
            block = os.pread(fd, min(left, 8 << 20), position)
            if not block:
                break
            digest.update(block)
            position += len(block)
            left -= len(block)
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return digest.hexdigest()


def verify_manifest(manifest: Path, sample_every: int = SAMPLE_EVERY) -> list[str]:
    """Problems found in a sample of the manifest's chunks ([] = all sampled chunks match)."""
    try:
        chunks = json.loads(manifest.read_text())["chunks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{manifest}: unreadable manifest ({exc})"]
    problems = []
    picked = [c for i, c in enumerate(chunks) if i % sample_every == 0 or i == len(chunks) - 1]
    for chunk in picked:
        path = manifest.parent / chunk["file"]
        try:
            if path.stat().st_size < chunk["offset"] + chunk["size"]:
                problems.append(f"{path}: shorter than chunk at {chunk['offset']}+{chunk['size']}")
                continue
            if _hash_range(path, chunk["offset"], chunk["size"]) != chunk["sha256"]:
                problems.append(f"{path}: chunk at offset {chunk['offset']} fails its sha256")
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror}")
    return problems


def warm(instance: str, env: Mapping[str, str]) -> int:
    rank = rank_of_instance(instance)
    failed = False
    prepared = env.get("DSV41_PREPARED_DIR", "").strip()
    manifests = sorted(Path(prepared).glob(f"**/rank{rank}/manifest.json")) if prepared else []
    for manifest in manifests:
        problems = verify_manifest(manifest)
        for problem in problems:
            log.error("prepared folder: %s", problem)
        failed |= bool(problems)
        if not problems:
            log.info("prepared folder %s: sampled chunks match", manifest.parent)
    if not manifests:
        log.info("no prepared folder for rank %d yet (the first start builds it)", rank)

    engram = check_engram(Node({**env, "DSV41_LOCAL_RANKS": instance}))
    log.log(logging.ERROR if engram.status == "fail" else logging.INFO, "engram: %s %s", engram.status, engram.detail)
    failed |= engram.status == "fail"

    try:
        warmup = importlib.import_module("dsv41.kernels.exl3.warmup")
    except ImportError:
        log.info("kernel cache: skipped (no dsv41.kernels.exl3.warmup module in this build)")
    else:
        cache = env.get("TRITON_CACHE_DIR", "")
        log.info("kernel cache: building (Triton cache %s)", cache or "Triton's default")
        warmup.warm(cache or None)
    return 1 if failed else 0
