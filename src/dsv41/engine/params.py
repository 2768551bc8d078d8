"""What a request asks of the sampler, torch-free: `SamplingParams` and the seed of a request that gave none.

The keyed sampler itself (tensors) is `runtime/sampling.py`; the policy side (scheduler, block manager, LLM
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
    # logit adjustments before the draw (runtime/sampling.py `adjust_logits`): pure functions of the request and
    # its own tokens, so batched == alone holds with them on
    presence_penalty: float = 0.0  # minus this once for every id already in the output
    frequency_penalty: float = 0.0  # minus this times the id's count in the output
    repetition_penalty: float = 1.0  # ids in prompt or output: positive logits / p, negative * p
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences: the last id is banned after the others
    min_tokens: int = 0  # the stop ids are banned until this many output tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words or self.min_tokens)

    @property
    def uses_prompt(self) -> bool:
        return self.repetition_penalty != 1.0


def banned_ids(params: SamplingParams, output: list[int], stop_ids) -> list[int]:
    """The ids the next draw may not take: stop ids before `min_tokens`, and each bad word's last id once the
    output ends with the rest of it. A pure function of the request and its own output tokens."""
    banned = set(stop_ids) if len(output) < params.min_tokens else set()
    for word in params.bad_words:
        head = list(word[:-1])
        if not head or output[len(output) - len(head):] == head:
            banned.add(word[-1])
    return sorted(banned)


def derive_seed(prompt_ids: list[int]) -> int:
    """The seed of a request that gave none: a digest of its prompt, so identical requests replay identically."""
    digest = hashlib.sha256(b"dsv41-seed\0" + b",".join(str(int(t)).encode() for t in prompt_ids)).digest()
    return int.from_bytes(digest[:8], "little")
