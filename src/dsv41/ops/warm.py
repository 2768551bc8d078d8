"""`dsv41 warm rankN` (dsv41-warm@.service): check a rank's files and build the kernel caches before the rank starts.

- Prepared folder (DSV41_PREPARED): its manifest checked and, when memory allows, its data.bin read once into the
  page cache, so the rank's start reads it at memory speed. DSV41_WARM_PREPARED: `auto` (default) reads it only
  when MemAvailable holds twice the folder (the cached file and the loaded weights side by side); on a GB10 the page
  cache is the GPU's own memory, so a 95 GB folder is not cached there ahead of a 95 GB load; `1` always, `0` never.
- Engram shards: headers and sizes (same check as preflight).
- Kernels: `dsv41.kernels.exl3.warmup.warm(cache_dir)` builds the CUDA EXL3 kernels for this GPU into the cubin
  cache ($DSV41_HOME/cuda; Triton compiles into TRITON_CACHE_DIR on first launch). It needs the GPU, hence here
  and not in the Nix build.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

from dsv41.errors import ConfigError, DSV41Error
from dsv41.ops.knobs import ops_value, rank_of_instance
from dsv41.ops.preflight import Node, check_engram

log = logging.getLogger(__name__)


def _mem_available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def warm_prepared(env: Mapping[str, str], rank: int, meminfo: Path = Path("/proc/meminfo"),
                  block: int = 64 << 20) -> str:
    """Read this rank's prepared data.bin into the page cache when the policy allows; returns what was done."""
    from dsv41.prepared import manifest as mf

    root = env.get("DSV41_PREPARED", "").strip()
    if not root:
        return "skip: DSV41_PREPARED is empty"
    world = int(env.get("DSV41_TP", "").strip() or 1)
    folder = mf.rank_folder(root, rank, world)
    manifest = mf.read_manifest(folder)  # PreparedMismatch (one line) when it is not a prepared folder
    if not manifest.get("complete"):
        return f"skip: {folder} is incomplete (run `dsv41 prepare`)"
    size = manifest["data"]["bytes"]
    policy = ops_value(env, "DSV41_WARM_PREPARED")
    if policy not in ("auto", "0", "1"):
        raise ConfigError(f"DSV41_WARM_PREPARED={policy!r}: expected auto, 0 or 1")
    available = _mem_available(meminfo)
    if policy == "0" or (policy == "auto" and available < 2 * size):
        why = "DSV41_WARM_PREPARED=0" if policy == "0" else (
            f"MemAvailable {available / 2**30:.1f} GiB < 2 x {size / 2**30:.1f} GiB: the page cache would take the "
            f"memory the weights load into")
        return f"skip: not caching {folder / mf.DATA} ({why})"
    start = time.perf_counter()
    buf = bytearray(block)
    with open(folder / mf.DATA, "rb", buffering=0) as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while handle.readinto(buf):
            pass
    seconds = max(time.perf_counter() - start, 1e-9)
    return f"read {folder / mf.DATA} into the page cache: {size / 2**30:.2f} GiB in {seconds:.1f} s " \
           f"({size / 2**30 / seconds:.2f} GiB/s)"


def warm(instance: str, env: Mapping[str, str]) -> int:
    rank = rank_of_instance(instance)  # rankN or a ConfigError naming the instance
    try:
        log.info("prepared: %s", warm_prepared(env, rank))
    except DSV41Error as exc:  # the rank's start refuses (or falls back) with the same reason
        log.error("prepared: %s", exc)
    engram = check_engram(Node({**env, "DSV41_LOCAL_RANKS": instance}))
    log.log(logging.ERROR if engram.status == "fail" else logging.INFO, "engram: %s %s", engram.status, engram.detail)

    from dsv41.kernels.exl3.warmup import warm as warm_kernels  # imports torch: only when a rank is warmed

    cache = env.get("TRITON_CACHE_DIR", "")
    log.info("kernel cache: building (Triton cache %s)", cache or "Triton's default")
    warm_kernels(cache or None)
    return 1 if engram.status == "fail" else 0
