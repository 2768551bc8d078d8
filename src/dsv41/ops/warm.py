"""`dsv41 warm rankN` (dsv41-warm@.service): check a rank's files and build the kernel caches before the rank starts.

It never reads the weights: on GB10 the page cache is GPU memory, so warming must not leave them cached.

- Engram shards: headers and sizes (same check as preflight).
- Kernels: `dsv41.kernels.exl3.warmup.warm(cache_dir)` builds the CUDA EXL3 kernels for this GPU into the cubin
  cache ($DSV41_HOME/cuda; Triton compiles into TRITON_CACHE_DIR on first launch). It needs the GPU, hence here
  and not in the Nix build.
"""

from __future__ import annotations

import logging
from typing import Mapping

from dsv41.ops.knobs import rank_of_instance
from dsv41.ops.preflight import Node, check_engram

log = logging.getLogger(__name__)


def warm(instance: str, env: Mapping[str, str]) -> int:
    rank_of_instance(instance)  # rankN or a ConfigError naming the instance
    engram = check_engram(Node({**env, "DSV41_LOCAL_RANKS": instance}))
    log.log(logging.ERROR if engram.status == "fail" else logging.INFO, "engram: %s %s", engram.status, engram.detail)

    from dsv41.kernels.exl3.warmup import warm as warm_kernels  # imports torch: only when a rank is warmed

    cache = env.get("TRITON_CACHE_DIR", "")
    log.info("kernel cache: building (Triton cache %s)", cache or "Triton's default")
    warm_kernels(cache or None)
    return 1 if engram.status == "fail" else 0
