"""The fast path (`FastModel`, runtime/model.py) behind the engine's forward seam (docs/ENGINE.md §5).

`FastForward(model).execute(rows, pool)` presents each row's sequence as a `PoolSequence` (the same views
`PoolForward` runs on: pool_forward.load_sequences, Engram history primed from `row.lookback`), makes one
`FastModel.forward` call per phase present in the step (prefill rows as "prefill", decode rows as "decode",
verify rows as "verify"; a decode row of more than `BUCKET` tokens — a token plus a long forced text — goes with
the prefill rows, the fused bucket holding at most BUCKET rows of one sequence), writes the step's new rows back
(pool_forward.store_sequences) and returns, per row, the fp32 logits of `row.logit_offsets()`.

Decode and verify rows run over the pool in place where the step kernels run (`FastModel.pool_runs`: CUDA, the
interpreter) and the chunk fits the ring beside the window (`ring_rows - sliding_window + 1` rows): nothing is
loaded into their views, the forward writes the pool itself. Other chunks (prefill, plain CPU, a forced text longer
than the ring's spare rows) load their state from the pool and store it back.

Prefill calls ask `logits="last"` when no prefill row of the step wants more than its last row, else "all"; the
decode and verify calls return every row's logits. CED bounded replay (MODEL.md §11): a prefill row's tokens before
its `replay_start` run the encoder layers and the first decoder layer's compressor only (`FastModel._replay_cut`,
the reference's `PoolForward._encoder_only_rows`); the views' windows of the decoder layers start at the replay
segment (`PoolSequence.floor`), and rows whose window would reach before it never run in place. Expert pruning is
not built on this path (`compose/build.py` refuses it with `--forward fast`). With the DSpark drafter
(`FastModel.dspark`), every row's taps seed the stage rings: in place inside the step, else through the views.

`pool_layout(model)` presents a FastModel as `kv_pool.pool_for_model` reads a model (its layers' roles, whether
a compressor keeps index keys, the fake quantisers, dtype and device; the DSpark stages when the drafter is built).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from ..engine.batch import DECODE, PREFILL, VERIFY, Row
from .model import BUCKET, ROW_BUCKETS, STEP_ROWS, row_bucket
from .pool_forward import decoder_start, load_sequences, store_sequences
from .step_tables import page_bucket, ring_chunk_rows


def boot_plan(max_rows: int, max_pages: int) -> list[tuple[int, int]]:
    """The decode graphs to capture before serving, in the order they are captured: (page bucket, row bucket) for
    every page bucket from 1 up to the one of `max_pages` (short contexts first: what a fresh server meets
    first), and within each every row bucket (`ROW_BUCKETS`) up to the one of `max_rows`."""
    if max_rows < 1 or max_pages < 1:
        raise ValueError(f"a boot plan needs rows and pages >= 1, got {max_rows} and {max_pages}")
    pages = [1 << i for i in range(page_bucket(max_pages).bit_length())]
    rows = [b for b in ROW_BUCKETS if b <= row_bucket(max_rows)]
    return [(P, n) for P in pages for n in rows]


def pool_layout(model, drafting: bool = True) -> SimpleNamespace:
    """What `pool_for_model` reads of a model, from a FastModel (`drafting=False`: no DSpark stage rings, so the
    forward seeds none even where the drafter is built)."""
    blocks = [SimpleNamespace(index=b.index, attn=SimpleNamespace(role=b.attn.role, p=b.attn.w,
                                                                  fake_quant=b.attn.fq))
              for b in model.blocks]
    dspark = None if model.dspark is None or not drafting else SimpleNamespace(blocks=model.dspark.blocks)
    return SimpleNamespace(cfg=model.cfg, blocks=blocks, dspark=dspark, dtype=model.dtype, device=model.device)


class FastForward:
    abort_watch = None  # runtime/abort.py: set by the ModelRunner; checked between layers of unfused forwards
    # decode and verify rows take the fused kernels, prefill rows the tile kernels: a row decoded is not the same
    # bits as that row prefilled, so a session entry made of decoded rows would not resume as a fresh prefill
    decode_rows_are_prefill_rows = False

    def __init__(self, model, *, in_place: bool = True):
        """`in_place=False` keeps every chunk on the load-and-store path (the comparison the in-place path is
        tested against)."""
        self.model, self.cfg = model, model.cfg
        self.in_place = in_place
        self.decoder_from = decoder_start(model.cfg)

    @torch.inference_mode()  # as `execute` replays them: a second engine over the same model replays pieces whose
    # statics an earlier engine's steps made as inference tensors (copying into one outside inference mode fails)
    def capture_graphs(self, pool, *, max_rows: int, max_len: int, budget_s: float,
                       clock=time.perf_counter) -> dict:
        """Capture the decode step's graphs before serving (ENGINE.md §5: at start, within a time budget, on real
        metadata shapes), in `boot_plan` order, each on scratch sequences whose tables write nothing (the pool is
        left as it was; each sequence at the last position its page bucket holds, at most `max_len` - 1, so every
        read stays inside what a served sequence reads). Stops once `budget_s` is spent; at TP > 1 it runs the
        whole plan (the ranks must capture alike, and their seconds differ). A graph not captured here is
        captured on first use, as before. Returns what was done (counts, seconds)."""
        m = self.model
        if budget_s <= 0 or not (m.piece_graphs().active and m.pool_runs(DECODE)):
            return {"captured": 0, "planned": 0, "run": 0, "seconds": 0.0}
        plan = boot_plan(min(max_rows, STEP_ROWS), -(-max_len // pool.page_tokens))
        t0, before, done = clock(), m.graphs.stats.captures, 0
        for pages, rows in plan:
            if getattr(m.comm, "world", 1) == 1 and clock() - t0 >= budget_s:
                break
            pos = min(pages * pool.page_tokens, max_len) - 1
            scratch = [Row(-1 - i, i % pool.num_slots, [0], pos, [p % pool.num_pages for p in range(pages)])
                       for i in range(rows)]
            views = load_sequences(pool, scratch, self.cfg, self.decoder_from, m.engram_hasher)
            m.forward([(v, r.token_ids) for v, r in zip(views, scratch)], DECODE, logits="all", pool=pool,
                      writes=False)
            done += 1
        return {"captured": m.graphs.stats.captures - before, "planned": len(plan), "run": done,
                "seconds": clock() - t0}

    @staticmethod
    def phase_of(row: Row) -> str:
        if row.phase == DECODE and len(row.token_ids) > BUCKET:
            return PREFILL
        return row.phase

    def replay_cut(self, row: Row) -> int:
        """The row's leading tokens before its replay segment (CED bounded replay): they stop after the encoder
        half (`FastModel.forward(replay_from=)`), so no logits of theirs exist."""
        return min(max(row.replay_start - row.start_pos, 0), len(row.token_ids))

    def in_place_fits(self, row: Row, fits: int) -> bool:
        """Whether the row may run over the pool in place: its chunk fits the ring beside the window, and under
        replay its window reaches no position before the replay segment (the in-place kernels read the ring
        from position 0 on; the loaded views stop at the floor). The engine's replay segment is one window long,
        so decode and verify rows after a replayed prompt always fit."""
        return len(row.token_ids) <= fits and (not row.replay_start
                                               or row.start_pos - self.cfg.sliding_window + 1 >= row.replay_start)

    def takes_handoff(self, rows: list[Row]) -> bool:
        """Whether this step's follow rows (`Row.follows`) can take their ids from the previous step's sample
        inside the forward (`execute(handoff=)`): every one runs in place (a one-token decode row over the pool),
        where the tables are planned before the ids are needed and the ids stay on the device (with Engram and no
        Engram gate the host reads them just before the hash: runtime/pool_step.py `forward_pool`)."""
        m = self.model
        return self.in_place and m.pool_runs(DECODE) and \
            all(self.phase_of(r) == DECODE and self.in_place_fits(r, 1) for r in rows if r.follows)

    @torch.inference_mode()
    def execute(self, rows: list[Row], pool, handoff=None) -> list[torch.Tensor | None]:
        """`handoff` (runtime/step_handoff.py, where `takes_handoff`): the follow rows' ids are the previous step's
        sample, taken by the forward once the step's tables are planned (on the device where no Engram row is
        hashed from them)."""
        m = self.model
        views = load_sequences(pool, rows, self.cfg, self.decoder_from, m.engram_hasher)
        out: list[torch.Tensor | None] = [None] * len(rows)
        fits = ring_chunk_rows(pool, self.cfg.sliding_window)
        for phase, in_place in ((PREFILL, False), (DECODE, True), (DECODE, False), (VERIFY, True), (VERIFY, False)):
            members = [i for i, r in enumerate(rows) if self.phase_of(r) == phase
                       and in_place == (self.in_place and m.pool_runs(phase) and self.in_place_fits(r, fits))]
            if not members:
                continue
            cuts = [self.replay_cut(rows[i]) for i in members]
            if any(cuts) and phase != PREFILL:
                raise ValueError(f"{phase} rows before their replay segment: only prefill rows are replayed")
            wanted = [rows[i].logit_offsets() for i in members]
            for i, c, offsets in zip(members, cuts, wanted):
                if offsets and offsets[0] < c:
                    raise ValueError(f"sequence {rows[i].seq_id}: logits asked for rows that replay leaves out")
            last_only = phase == PREFILL and all(o in ([], [len(rows[i].token_ids) - 1])
                                                 for i, o in zip(members, wanted))
            mode = "last" if last_only else "all"
            follow = [handoff.source.get(i, -1) for i in members] if handoff is not None else []
            if any(f >= 0 for f in follow) and not (in_place and phase == DECODE):
                raise ValueError("follow rows take their ids on the device only in place (takes_handoff)")
            logits = m.forward([(views[i], rows[i].token_ids) for i in members], phase, logits=mode,
                               pool=pool if in_place else None, watch=self.abort_watch,
                               replay_from=[rows[i].replay_start for i in members] if any(cuts) else None,
                               follow=(handoff, follow) if any(f >= 0 for f in follow) else None)
            at = 0
            for i, c, offsets in zip(members, cuts, wanted):
                left = len(rows[i].token_ids) - c  # the rows the decoder layers ran (all but replay's cut)
                n = min(left, 1) if mode == "last" else left
                if offsets:
                    pick = [0] if mode == "last" else [o - c for o in offsets]
                    if pick == list(range(pick[0], pick[-1] + 1)):  # a slice: no index copied up (a copy from
                        out[i] = logits[at + pick[0]:at + pick[-1] + 1]  # pageable memory waits for the stream)
                    else:
                        out[i] = logits[at + torch.tensor(pick, dtype=torch.long, device=logits.device)]
                at += n
            if at != logits.shape[0]:
                raise RuntimeError(f"{phase}: {logits.shape[0]} logit rows for {at} asked")
        store_sequences(views)
        return out
