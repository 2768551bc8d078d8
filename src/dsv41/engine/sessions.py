"""Session entries in RAM: a sequence's state at position S, kept so a later prompt that starts with the same ids
resumes there instead of prefilling again (docs/ENGINE.md §3, docs/SESSIONS.md). Torch-free policy: which
entries exist, what they hold, which one a prompt resumes from, which go when memory is short.

An entry holds
- the pool pages covering positions [0, S) (a reference each: shared with the sequence it was taken from and with
  every sequence that resumes from it, never copied in RAM; the page S falls inside is copied on resume, because
  the resumed sequence writes entries after S into it),
- a snapshot of the ring slot at S (window rows of every layer, the open compressor groups, the DSpark rings),
  taken by the runtime from the slot (`Batch.saves`) and put back into the resuming sequence's slot
  (`Batch.restores`); dropped with `Batch.drops`. The Engram look-back ids are the entry's last ids.

Entries are made where the next turn looks: at the prompt's mark (the last 16-token grid point before its end, so
an identical resend resumes there) and at the end of a reply (S = every absorbed token). A prompt resumes from
the longest entry whose ids are a strict prefix of it. Lookup walks a chain of digests, one per full page of ids
(`page_tokens` ids each), and compares only the tail after the last full page exactly.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

MARK_GRID = 16  # the prompt's entry sits on this grid, below the prompt's end


def chain_digest(previous: bytes, ids) -> bytes:
    """The digest of one full page of ids after the chain `previous` (b"" before the first page)."""
    return hashlib.blake2b(previous + array("q", ids).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class SessionEntry:
    entry_id: int
    ids: list[int]
    pages: list[int]  # the pages covering [0, S): a reference each
    chain: list[bytes]  # digest after each full page of ids
    slot_bytes: int
    hits: int = 0

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass
class SessionConfig:
    ram_bytes: int = 256 << 20  # slot snapshots kept in RAM (the pages they hold yield to live requests)
    min_tokens: int = 16  # shorter states are not worth an entry
    slot_bytes: int = 0  # one ring slot's bytes (the snapshot's size), from the pool


@dataclass
class SessionStats:
    queries: int = 0  # prompts looked up
    hits: int = 0
    query_tokens: int = 0  # prompt tokens looked up, and those resumed instead of prefilled
    hit_tokens: int = 0
    made: int = 0
    evicted: int = 0

    def figures(self) -> dict:
        return dict(vars(self))


class SessionIndex:
    def __init__(self, config: SessionConfig, page_tokens: int):
        self.config, self.page_tokens = config, page_tokens
        self.entries: OrderedDict[int, SessionEntry] = OrderedDict()  # least recently used first
        self._ends: dict[bytes, list[SessionEntry]] = {}  # chain digest at floor(S / page) pages -> entries
        self._through: dict[bytes, int] = {}  # chain digest -> entries whose chain passes through it
        self._ids = itertools.count(1)
        self.stats = SessionStats()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def snapshot_bytes(self) -> int:
        return sum(e.slot_bytes for e in self.entries.values())

    @property
    def pages_held(self) -> int:
        return len({p for e in self.entries.values() for p in e.pages})

    def _chain(self, ids, pages: int) -> list[bytes]:
        out, h, pt = [], b"", self.page_tokens
        for k in range(pages):
            h = chain_digest(h, ids[k * pt:(k + 1) * pt])
            out.append(h)
        return out

    def find(self, prompt: list[int], max_len: int) -> SessionEntry | None:
        """The longest entry whose ids are a prefix of `prompt` and at most `max_len` long."""
        pt, best, h, k = self.page_tokens, None, b"", 0
        while True:
            for e in self._ends.get(h, ()):
                if e.length <= max_len and (best is None or e.length > best.length) and \
                        e.ids[k * pt:] == prompt[k * pt:e.length]:
                    best = e
            if (k + 1) * pt > min(max_len, len(prompt)):
                break
            h = chain_digest(h, prompt[k * pt:(k + 1) * pt])
            if h not in self._through:
                break
            k += 1
        return best

    def exact(self, ids: list[int]) -> SessionEntry | None:
        e = self.find(ids, len(ids))
        return e if e is not None and e.length == len(ids) else None

    def add(self, ids: list[int], pages: list[int]) -> SessionEntry:
        """A new entry over `ids` holding `pages` (the caller took a reference on each)."""
        full = len(ids) // self.page_tokens
        entry = SessionEntry(next(self._ids), list(ids), list(pages), self._chain(ids, full), self.config.slot_bytes)
        self.entries[entry.entry_id] = entry
        self._ends.setdefault(entry.chain[-1] if full else b"", []).append(entry)
        for h in entry.chain:
            self._through[h] = self._through.get(h, 0) + 1
        self.stats.made += 1
        return entry

    def touch(self, entry: SessionEntry) -> None:
        self.entries.move_to_end(entry.entry_id)

    def remove(self, entry: SessionEntry) -> None:
        del self.entries[entry.entry_id]
        end = entry.chain[-1] if entry.chain else b""
        self._ends[end].remove(entry)
        if not self._ends[end]:
            del self._ends[end]
        for h in entry.chain:
            self._through[h] -= 1
            if not self._through[h]:
                del self._through[h]

    def coldest(self, keep: SessionEntry | None = None) -> SessionEntry | None:
        return next((e for e in self.entries.values() if e is not keep), None)


def prompt_mark(prompt_len: int, min_tokens: int) -> int | None:
    """Where a prompt's entry is taken: the last grid point strictly before its end (an identical resend, which
    must absorb at least its last token to sample, resumes there); None when that is under `min_tokens`."""
    mark = (prompt_len - 1) // MARK_GRID * MARK_GRID
    return mark if mark >= max(min_tokens, 1) else None


class SessionCache:
    """The engine's sessions: the index, the references its entries hold in the block manager, and the pool
    operations the next `Batch` carries (saves, restores, drops; the runtime makes them before the step's
    forward, saves first, so a slot freed by a finished sequence is read before anything writes it again)."""

    def __init__(self, config: SessionConfig, blocks):
        self.config, self.blocks = config, blocks
        self.index = SessionIndex(config, blocks.page_tokens)
        self.saves: dict[int, int] = {}  # entry id -> slot, snapshot taken at the start of the next batch
        self.restores: list[list[int]] = []  # [entry id, slot, entry's page, sequence's page] (-1, -1: none)
        self.drops: list[int] = []
        self.freed_pages: list[int] = []  # pages an eviction let go of (reported in the next batch)
        self._pinned: set[int] = set()  # entries a planned restore reads: kept until its batch is built

    @property
    def stats(self) -> SessionStats:
        return self.index.stats

    # ------------------------------------------------------------------ lookup and resume
    def find(self, prompt: list[int]) -> SessionEntry | None:
        """The entry a prompt resumes from: the longest strict prefix (at least the last prompt token is
        absorbed, so the first token is sampled from fresh logits)."""
        return self.index.find(prompt, len(prompt) - 1)

    def shared_pages(self, entry: SessionEntry | None) -> int:
        return 0 if entry is None else entry.length // self.blocks.page_tokens

    def resume(self, entry: SessionEntry, slot: int, pages: list[int]) -> None:
        """A sequence in `slot` with page table `pages` (its first `shared_pages` are the entry's, referenced)
        starts at the entry's length: the next batch restores the slot and copies the page S falls inside."""
        k, S = self.shared_pages(entry), entry.length
        partial = [entry.pages[k], pages[k]] if S % self.blocks.page_tokens else [-1, -1]
        self.restores.append([entry.entry_id, slot, *partial])
        self._pinned.add(entry.entry_id)
        entry.hits += 1
        self.index.touch(entry)
        self.stats.hits += 1
        self.stats.hit_tokens += S

    def looked_up(self, prompt_len: int) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += prompt_len

    # ------------------------------------------------------------------ making entries
    def take(self, ids: list[int], pages: list[int], slot: int) -> SessionEntry | None:
        """An entry over `ids` (the state of `slot` now, which the next batch snapshots before anything writes the
        slot again) holding references on the pages covering them; None when too short or already kept."""
        S = len(ids)
        if S < max(self.config.min_tokens, 1) or self.config.slot_bytes > self.config.ram_bytes:
            return None
        same = self.index.exact(ids)
        if same is not None:
            self.index.touch(same)
            return None
        held = pages[:self.blocks.pages_for(S)]
        self.blocks.share(held)
        entry = self.index.add(ids, held)
        self.saves[entry.entry_id] = slot
        while self.index.snapshot_bytes > self.config.ram_bytes and self.evict(keep=entry):
            pass
        return entry

    # ------------------------------------------------------------------ letting go
    def evict(self, keep: SessionEntry | None = None) -> bool:
        """Drop the least recently used entry (not `keep`, not one a planned restore reads); False if none."""
        entry = next((e for e in self.index.entries.values()
                      if e is not keep and e.entry_id not in self._pinned), None)
        if entry is None:
            return False
        self.index.remove(entry)
        if self.saves.pop(entry.entry_id, None) is None:  # its snapshot exists: the runtime drops it
            self.drops.append(entry.entry_id)
        self.freed_pages += self.blocks.free(None, entry.pages)
        self.stats.evicted += 1
        return True

    def clear(self) -> None:
        while self.evict():
            pass

    @property
    def pending(self) -> bool:
        """Pool operations waiting for a batch (an idle engine runs one without rows to make them)."""
        return bool(self.saves or self.restores or self.drops)

    def batch_ops(self) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
        """(saves, restores, drops, freed pages) for the batch being built; they are the runtime's from now on."""
        out = ([[e, s] for e, s in self.saves.items()], self.restores, self.drops, self.freed_pages)
        self.saves, self.restores, self.drops, self.freed_pages = {}, [], [], []
        self._pinned.clear()
        return out

    def figures(self) -> dict:
        return {"entries": len(self.index), "pages": self.index.pages_held,
                "snapshot_bytes": self.index.snapshot_bytes, "ram_bytes": self.config.ram_bytes,
                "min_tokens": self.config.min_tokens, **self.stats.figures()}
