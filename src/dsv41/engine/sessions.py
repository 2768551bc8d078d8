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

Entries are made where the next turn looks: at the prompt's mark (just before its last token: an identical resend
resumes there, and so does a next turn whose history re-encodes that token) and at the end of a reply (S = every
absorbed token). A prompt resumes from
the longest entry whose ids are a strict prefix of it. Lookup walks a chain of digests, one per full page of ids
(`page_tokens` ids each), and compares only the tail after the last full page exactly.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

def session_key(ids) -> str:
    """An entry's name on the NVMe tier: a digest of its ids (the tier's tag keeps other settings apart)."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class DiskHit:
    """A prompt's longest prefix parked on the NVMe tier (loaded into the sequence's own slot and pages)."""
    key: str
    length: int


def chain_digest(previous: bytes, ids) -> bytes:
    """The digest of one full page of ids after the chain `previous` (b"" before the first page)."""
    return hashlib.blake2b(previous + (ids if isinstance(ids, array) else array("q", ids)).tobytes(),
                           digest_size=16).digest()


@dataclass(eq=False)
class SessionEntry:
    entry_id: int
    ids: array  # int64 ids: 8 bytes an id (a list of ints costs ~36 at 300K-token contexts)
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
    disk_min_tokens: int = 1024  # an entry leaving RAM is parked on the NVMe tier from this length on
    disk_gain: int = 64  # a parked entry is loaded only where it resumes this many tokens more than RAM does
    # entries at a reply's end too (else only at the prompt's mark): their rows past the prompt were made by decode
    # steps, so resuming there is a fresh prefill only where the forward's decode rows are its prefill rows bit for
    # bit (the reference pool forward on the CPU; not the fast path, whose phases take other kernels)
    reply_entries: bool = True


@dataclass
class SessionStats:
    queries: int = 0  # prompts looked up
    hits: int = 0
    query_tokens: int = 0  # prompt tokens looked up, and those resumed instead of prefilled
    hit_tokens: int = 0
    made: int = 0
    evicted: int = 0
    parked: int = 0  # entries written to the NVMe tier (asked; a failed write is the store's figure)
    disk_hits: int = 0  # resumed from the NVMe tier, and loads that failed there (damaged, missing on a rank)
    disk_hit_tokens: int = 0
    disk_failed: int = 0

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

    # read from the server's thread (/health, /metrics) while the engine thread changes the entries: over a copy
    @property
    def snapshot_bytes(self) -> int:
        return sum(e.slot_bytes for e in list(self.entries.values()))

    @property
    def pages_held(self) -> int:
        return len({p for e in list(self.entries.values()) for p in e.pages})

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
                        e.ids[k * pt:].tolist() == prompt[k * pt:e.length]:
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
        entry = SessionEntry(next(self._ids), array("q", ids), list(pages), self._chain(ids, full),
                             self.config.slot_bytes)
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
    """Where a prompt's entry is taken: just before its last token. An identical resend (which must absorb at least
    its last token to sample) resumes there, and so does the next turn in thinking mode without tools, whose
    history turns this prompt's last token, `<think>`, into `</think>` (ENCODING.md, drop_thinking): the re-encoded
    history and the ids agree up to here. None when that is under `min_tokens`."""
    mark = prompt_len - 1
    return mark if mark >= max(min_tokens, 1) else None


class SessionCache:
    """The engine's sessions: the index, the references its entries hold in the block manager, and the pool
    operations the next `Batch` carries (saves, restores, drops; the runtime makes them before the step's
    forward, saves first, so a slot freed by a finished sequence is read before anything writes it again)."""

    def __init__(self, config: SessionConfig, blocks, disk=None):
        self.config, self.blocks = config, blocks
        self.disk = disk  # rank 0's parked entries (sessions/files.py SessionFiles), None without an NVMe tier
        self.parks: list[list] = []  # [entry id, key, ids, pages]: written before the pages can be reused
        self.loads: list[list] = []  # [seq id, key, slot, pages]: the sequence's first pages
        self.loading: dict[int, tuple] = {}  # seq id -> (sequence, length) while its load is on its way
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

    def find_disk(self, prompt: list[int], have: int) -> DiskHit | None:
        """A parked entry that resumes at least `disk_gain` tokens more than `have` (the RAM tier's hit)."""
        if self.disk is None:
            return None
        key = self.disk.longest_prefix(prompt, len(prompt) - 1)
        length = self.disk.length(key) if key is not None else None
        if length is None or length < have + self.config.disk_gain:
            return None
        return DiskHit(key, length)

    def shared_pages(self, entry) -> int:
        return entry.length // self.blocks.page_tokens if isinstance(entry, SessionEntry) else 0

    def load(self, seq, hit: DiskHit) -> None:
        """The next batch loads the parked entry into the sequence's slot and first pages; it runs no row until
        the load is reported (`loaded`)."""
        self.loads.append([seq.seq_id, hit.key, seq.slot, seq.pages[:self.blocks.pages_for(hit.length)]])
        self.loading[seq.seq_id] = (seq, hit.length)
        seq.loading = True

    def loaded(self, seq_id: int, ok: bool):
        """The runtime's word on a load: the sequence starts at the entry's length, or from the start."""
        seq, length = self.loading.pop(seq_id, (None, 0))
        if seq is None:
            return
        seq.loading = False
        if ok:
            seq.num_computed = seq.cached = length
            self.stats.disk_hits += 1
            self.stats.disk_hit_tokens += length
        else:
            self.stats.disk_failed += 1

    def cancel_load(self, seq) -> None:
        """A sequence gone before its load ran: nothing may write its freed slot and pages."""
        self.loads = [op for op in self.loads if op[0] != seq.seq_id]
        self.loading.pop(seq.seq_id, None)

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
        self._let_go(entry)
        return True

    def _let_go(self, entry: SessionEntry) -> None:
        """The entry leaves RAM: parked (long enough, a tier there) or dropped; its pages' references go."""
        self.index.remove(entry)
        parks = self.disk is not None and entry.length >= self.config.disk_min_tokens
        if parks:  # written from the snapshot and pages before anything reuses them (the runtime's order)
            key = session_key(entry.ids)
            if key not in self.disk:
                self.parks.append([entry.entry_id, key, entry.ids.tolist(), entry.pages])
                self.stats.parked += 1
            self.drops.append(entry.entry_id)
        elif self.saves.pop(entry.entry_id, None) is None:  # its snapshot exists: the runtime drops it
            self.drops.append(entry.entry_id)
        self.freed_pages += self.blocks.free(None, entry.pages)
        self.stats.evicted += 1

    def clear(self) -> None:
        while self.evict():
            pass

    @property
    def pending(self) -> bool:
        """Pool operations waiting for a batch (an idle engine runs one without rows to make them)."""
        return bool(self.saves or self.restores or self.drops or self.parks or self.loads)

    def batch_ops(self) -> dict:
        """The Batch's session fields and the pages evictions freed, for the batch being built: they are the
        runtime's from now on."""
        out = {"saves": [[e, s] for e, s in self.saves.items()], "parks": self.parks, "restores": self.restores,
               "loads": self.loads, "drops": self.drops}
        freed = self.freed_pages
        self.saves, self.parks, self.restores, self.loads, self.drops, self.freed_pages = {}, [], [], [], [], []
        self._pinned.clear()
        return out, freed

    def park_all(self) -> None:
        """Every entry leaves RAM (parked where it is long enough and a tier exists)."""
        self.clear()

    def park_recent(self) -> bool:
        """The most recently used entry leaves RAM (parked where it is long enough); False when none is left. A
        graceful stop parks one a batch, newest first, until its time is up: the conversations most likely to
        come back are on disk first."""
        newest = next(reversed(self.index.entries.values()), None)
        if newest is None:
            return False
        self._let_go(newest)
        return True

    def figures(self) -> dict:
        return {"entries": len(self.index), "pages": self.index.pages_held,
                "snapshot_bytes": self.index.snapshot_bytes, "ram_bytes": self.config.ram_bytes,
                "min_tokens": self.config.min_tokens, **self.stats.figures(),
                "disk": self.disk.stats() if self.disk is not None else None}
