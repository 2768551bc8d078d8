"""What a request asks of the sampler, torch-free: `SamplingParams` and the seed of a request that gave none.

The keyed sampler itself (tensors) is `engine/sampling.py`; the policy side (scheduler, block manager, LLM
engine) only carries these values into each `Row`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # temperatures under this are treated as greedy (T=0 would divide by zero)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. `seed=None` means: derive it from the prompt (see `derive_seed`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def derive_seed(prompt_ids: list[int]) -> int:
    """The seed of a request that gave none: a digest of its prompt, so identical requests replay identically."""
    digest = hashlib.sha256(b"dsv41-seed\0" + b",".join(str(int(t)).encode() for t in prompt_ids)).digest()
    return int.from_bytes(digest[:8], "little")
