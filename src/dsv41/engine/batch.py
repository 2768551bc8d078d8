"""What crosses from the engine to the runtime each step (docs/ENGINE.md §2): plain dataclasses, no tensors.

A `Row` is one sequence's share of a step: the token ids it absorbs (a prefill chunk, the one token of a decode
step, or a token plus the text a grammar forces), where they go (`start_pos`, its ring `slot`, its `page_ids`),
and what to bring back (a sampled token, logprobs of given next tokens). A row carries everything the runtime
needs; the runtime keeps no per-request policy state. The same `Batch` is what rank 0 sends to every rank
(parallel/plan.py encodes it), so every rank runs the same `ModelRunner.execute(batch)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"
FOLLOWS = -1  # a follow row's token id until the runtime puts in the one its sequence's previous step sampled


@dataclass(slots=True)
class RowSampling:
    """The keyed draw of one token: `sample_token(logits, params(seed), seed, step)` on the row's last logits."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    step: int  # the request's generation step: the keyed noise of token v is a function of (seed, step, v)
    logprobs: int | None = None  # None: no logprob; k: the chosen token's and the k most likely
    mask: bytes | None = None  # allowed ids: int32 words, bit v % 32 of word v // 32 (xgrammar's bitmask)
    # logit adjustments (runtime/sampling.py adjust_logits), None when the request asks none; one plain list so
    # the step message carries it as is: [presence, frequency, repetition, [[id, bias]...], allowed ids or None,
    # this step's banned ids (stop ids before min_tokens, bad words), the output so far, the prompt] (the last
    # two only when a penalty needs them)
    adjust: list | None = None

    def params(self):
        from .params import SamplingParams

        if self.adjust is None:
            return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)
        presence, frequency, repetition, bias, allowed = self.adjust[:5]
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed, presence, frequency,
                              repetition, tuple((int(t), float(b)) for t, b in bias),
                              None if allowed is None else tuple(allowed))


@dataclass(slots=True)
class Row:
    seq_id: int
    slot: int  # ring slot: window KV, open compressor groups, DSpark rings
    token_ids: list[int]  # absorbed at positions start_pos, start_pos + 1, ...
    start_pos: int
    page_ids: list[int]  # the sequence's page table (every growing store: compressed KV, index keys)
    phase: str = DECODE
    lookback: list[int] = field(default_factory=list)  # the ids just before start_pos (Engram n-grams)
    sample: RowSampling | None = None  # draw a token from the last row's logits
    scores: list[tuple[int, int, int]] = field(default_factory=list)  # (row offset, next id, top): logprobs
    replay_start: int = 0  # CED bounded replay: the decoder layers see positions >= this only
    # verify rows (phase VERIFY): the last n_draft token ids are drafts; `sample` draws at the row before them
    # (the window's first row) and `draft_samples[i]` at draft i's row (its mask and adjustments after the drafts
    # before it), each at the request's step sample.step + 1 + i; drafts are kept up to the first that differs
    n_draft: int = 0
    draft_samples: list = field(default_factory=list)  # RowSampling per draft (wire lists on followers)
    propose: int = 0  # DSpark drafts wanted for the next round (from the last kept row and the last token)
    # a follow row (the overlapped loop, docs/ENGINE.md §6): planned before its sequence's previous step finished,
    # its one token id (FOLLOWS here) is the token that step samples for this sequence; the runtime takes it from
    # that step's sample (on the device where it can: no host round trip between the two steps)
    follows: bool = False

    @property
    def first_choice(self) -> int:
        """The offset of the first sampled row: the last row, or the window's first row of a verify row."""
        return len(self.token_ids) - 1 - self.n_draft

    def logit_offsets(self) -> list[int]:
        """The rows of this chunk whose logits the step needs, ascending (scored rows, then the sampled ones)."""
        wanted = {offset for offset, _, _ in self.scores}
        if self.sample is not None:
            wanted.update(range(self.first_choice, len(self.token_ids)))
        return sorted(wanted)


@dataclass(slots=True)
class Batch:
    step: int
    rows: list[Row]
    freed_slots: list[int] = field(default_factory=list)  # released since the last step (all ranks see it)
    freed_pages: list[int] = field(default_factory=list)
    knobs_tag: str = ""  # the approximate settings every rank runs under ("" = exact)
    stop: bool = False  # followers leave their loop
    # forks (a group's siblings, docs/ENGINE.md §3), made before this step's forward: [from slot, to slot, from
    # page, to page] each, the page pair -1 when the fork point ends a page (nothing partial to copy)
    copies: list[list[int]] = field(default_factory=list)
    # sessions (engine/sessions.py), made before the forward in this order: snapshots of ring slots taken as
    # session entries [entry id, slot]; entries parked on the NVMe tier [entry id, key, ids, pages]; entries
    # restored into a resuming sequence's slot [entry id, slot, entry's page, sequence's page] (the page pair -1
    # when the entry ends a page); parked entries loaded into a sequence's slot and first pages [seq id, key, slot,
    # pages]; (then the forks: a resumed leader's siblings copy the restored slot); snapshots let go [entry id]
    saves: list[list[int]] = field(default_factory=list)
    parks: list[list] = field(default_factory=list)
    restores: list[list[int]] = field(default_factory=list)
    loads: list[list] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass(slots=True)
class RowOutput:
    seq_id: int
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)
    scored: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # one per Row.scores entry
    accepted: int = 0  # verify rows: drafts accepted
    error: str | None = None  # this row alone failed because of its request (its grammar allows no token)
    # verify rows: every token the round emits, (id, logprob, top) each: the accepted drafts, then `token`
    emitted: list = field(default_factory=list)
    proposal: list[int] = field(default_factory=list)  # DSpark drafts for the next round (Row.propose)
    confidence: list[float] = field(default_factory=list)  # per proposal: acceptance given the ones before


@dataclass(slots=True)
class StepOutput:
    step: int
    rows: list[RowOutput] = field(default_factory=list)
    free_bytes: int | None = None  # the device's (or host's) free memory after the step, for the memory floor
    loads: list[list] = field(default_factory=list)  # [seq id, whether every rank loaded it] per Batch.loads


class StepAborted(Exception):
    """Raised by a forward that stopped between layers because every request with rows in its step was cancelled
    while it ran (a client that left during a long prefill chunk: runtime/abort.py). Nothing of the step is kept:
    its sequences are being freed. Every rank raises it at the same layer (the decision is one collective)."""
