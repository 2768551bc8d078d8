"""Where each sequence's cache lives, as numbers: ring slots and ref-counted pages (docs/ENGINE.md §3).

A request holds one ring slot (its window KV, open compressor groups and DSpark rings) and a page table covering
every position it may reach (prompt + max tokens, capped at the context): pages are reserved at admission, so a
running request never waits for memory and nothing is ever preempted. Pages are ref-counted so that a prefix can
be shared; a page returns to the free list when its last holder lets go. A group of sequences over one prompt
(n > 1, best_of) is reserved at once: one slot per sibling, the prompt's full pages once (every sibling holds a
reference on them), and each sibling's own pages from the page the prompt leaves partial onwards. Rollback of
rejected drafts moves the sequence's computed length back and touches nothing here.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_pages: int, num_slots: int, page_tokens: int):
        if num_pages < 1 or num_slots < 1 or page_tokens < 1:
            raise ValueError(f"a pool needs pages, slots and page tokens >= 1, got {num_pages}, {num_slots}, "
                             f"{page_tokens}")
        self.num_pages, self.num_slots, self.page_tokens = num_pages, num_slots, page_tokens
        self.free_pages: deque[int] = deque(range(num_pages))
        self.free_slots: deque[int] = deque(range(num_slots))
        self.ref_counts = [0] * num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    def fits_alone(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_pages

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self.free_slots) and self.pages_for(num_tokens) <= len(self.free_pages)

    def allocate(self, num_tokens: int) -> tuple[int, list[int]]:
        """A ring slot and pages for `num_tokens` positions (check `can_allocate` first)."""
        if not self.can_allocate(num_tokens):
            raise RuntimeError(f"no room for {num_tokens} tokens: {len(self.free_slots)} slots, "
                               f"{len(self.free_pages)} pages free")
        slot = self.free_slots.popleft()
        pages = [self.free_pages.popleft() for _ in range(self.pages_for(num_tokens))]
        for p in pages:
            self.ref_counts[p] = 1
        return slot, pages

    def allocate_after(self, num_tokens: int, shared: list[int]) -> tuple[int, list[int]]:
        """A ring slot and a page table for `num_tokens` positions whose first pages are `shared` (a session
        entry's: one more reference each) and the rest its own."""
        own = self.pages_for(num_tokens) - len(shared)
        if not self.free_slots or own > len(self.free_pages):
            raise RuntimeError(f"no room for {num_tokens} tokens after {len(shared)} shared pages: "
                               f"{len(self.free_slots)} slots, {len(self.free_pages)} pages free")
        self.share(shared)
        slot = self.free_slots.popleft()
        pages = [self.free_pages.popleft() for _ in range(own)]
        for p in pages:
            self.ref_counts[p] = 1
        return slot, list(shared) + pages

    def group_pages(self, num_tokens: int, siblings: int, shared: int) -> int:
        """Pages a group of `siblings` sequences of `num_tokens` positions each needs when the first `shared` pages
        of their tables are one set of pages."""
        return self.pages_for(num_tokens) + (siblings - 1) * (self.pages_for(num_tokens) - shared)

    def group_fits_alone(self, num_tokens: int, siblings: int, shared: int) -> bool:
        return siblings <= self.num_slots and self.group_pages(num_tokens, siblings, shared) <= self.num_pages

    def can_allocate_group(self, num_tokens: int, siblings: int, shared: int) -> bool:
        return len(self.free_slots) >= siblings and \
            self.group_pages(num_tokens, siblings, shared) <= len(self.free_pages)

    def allocate_group(self, num_tokens: int, siblings: int, shared: int,
                       first: list[int] = ()) -> list[tuple[int, list[int]]]:
        """(slot, page table) per sibling: the first `shared` pages of every table are the first sibling's (one
        reference each), the rest are the sibling's own; the first sibling's table starts with `first` (a session
        entry's pages: a reference each; check room first)."""
        own = self.group_pages(num_tokens, siblings, shared) - len(first)
        if len(self.free_slots) < siblings or own > len(self.free_pages):
            raise RuntimeError(f"no room for {siblings} x {num_tokens} tokens: {len(self.free_slots)} slots, "
                               f"{len(self.free_pages)} pages free")
        first_slot, first_pages = self.allocate_after(num_tokens, list(first))
        out = [(first_slot, first_pages)]
        for _ in range(siblings - 1):
            slot = self.free_slots.popleft()
            own = [self.free_pages.popleft() for _ in range(self.pages_for(num_tokens) - shared)]
            for p in own:
                self.ref_counts[p] = 1
            self.share(first_pages[:shared])
            out.append((slot, first_pages[:shared] + own))
        return out

    def share(self, pages: list[int]) -> None:
        """One more holder of `pages` (a shared prefix)."""
        for p in pages:
            if self.ref_counts[p] < 1:
                raise RuntimeError(f"page {p} is free: it cannot be shared")
            self.ref_counts[p] += 1

    def free(self, slot: int | None, pages: list[int]) -> list[int]:
        """Let go of a slot and pages; returns the pages that became free."""
        released = []
        for p in pages:
            if self.ref_counts[p] < 1:
                raise RuntimeError(f"page {p} freed twice")
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self.free_pages.append(p)
                released.append(p)
        if slot is not None:
            if slot in self.free_slots:
                raise RuntimeError(f"slot {slot} freed twice")
            self.free_slots.append(slot)
        return released

    def empty(self) -> bool:
        """Everything is back: the engine's own accounting of an idle pool."""
        return (len(self.free_pages) == self.num_pages and len(self.free_slots) == self.num_slots
                and not any(self.ref_counts))
