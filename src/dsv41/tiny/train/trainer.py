"""The training loop: AdamW, bf16 autocast on CUDA, seeded, resumable from the run folder.

A run folder holds everything a later call needs to continue:
  skeleton/      make-tiny's config.json, tokenizer and layout for the trained config (TRAINED_OVERRIDES)
  corpus/        tokens.npz (every source and split as token streams) and corpus.json (counts, digest, Python)
  run.json       the settings the run started with (a later call must agree on what shapes the result)
  state.pt       weights, optimizer, step (written atomically every --ckpt-every steps and when time runs out)
  log.jsonl      one line per logged step (losses, accuracies, lr, tokens/s) and per evaluation
  loss.svg       the loss curves so far (plot.py)
  model/         the exported checkpoint, written when the last step is done (or by --export-now)
Batches and DSpark anchors are functions of (seed, step), so a run continued over several calls draws the same
data as one that never stopped. `--max-minutes` ends a call cleanly (checkpoint, exit 0) before a device limit.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from dsv41.errors import DSV41Error

from . import data as D
from .corpus import DEFAULT_CHATS, DEFAULT_CODE_BYTES, build_corpus
from .export import checkpoint_bytes, export_checkpoint
from .layout import TRAINED_OVERRIDES, make_skeleton, read_layout
from .net import Losses, TinyNet, init_weights
from .plot import loss_svg

# settings that shape the result: a continued run must use the same ones
SHAPING = ("seed", "batch", "seq_len", "lr", "warmup", "min_lr_ratio", "weight_decay", "anchors", "code_bytes",
           "n_chats", "grad_clip", "router_rate", "draft_weight", "confidence_weight", "indexer_weight")


@dataclass
class TrainSettings:
    out: str
    steps: int | None = None  # None: --total-minutes decides it after CALIBRATION steps (then fixed in run.json)
    total_minutes: float | None = None
    batch: int = 16  # 16 x 2048 tokens: a tool conversation (up to ~1,550 tokens) fits one sequence whole
    seq_len: int = 2048
    lr: float = 2e-3
    warmup: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    anchors: int = 128  # DSpark draft blocks per sequence per step
    seed: int = 0
    device: str = "cuda"
    code_bytes: int = DEFAULT_CODE_BYTES
    n_chats: int = DEFAULT_CHATS
    grad_clip: float = 1.0
    router_rate: float = 1e-3
    draft_weight: float = 1.0
    confidence_weight: float = 0.1
    indexer_weight: float = 1.0
    max_minutes: float | None = None
    log_every: int = 10
    eval_every: int = 250
    ckpt_every: int = 250
    eval_docs: int = 32
    export: str | None = None  # default: OUT/model
    compile: bool = False
    micro_batch: int | None = None  # sequences a forward (None: the whole batch); not part of the result
    overrides: dict = field(default_factory=dict)

    @classmethod
    def smoke(cls, out: str, **kw) -> "TrainSettings":
        """`--tiny-batch`: a CPU-sized run of the same code (small corpus, 2 x 64 tokens, 4 anchors)."""
        base = dict(batch=2, seq_len=64, anchors=4, code_bytes=300_000, n_chats=300, warmup=1, log_every=1,
                    eval_every=10**9, ckpt_every=10**9, eval_docs=2, device="cpu")
        return cls(out=out, **{**base, **kw})


CALIBRATION = 8  # steps timed (the last 5) before --total-minutes fixes the step count; all within the warmup


def lr_at(s: TrainSettings, step: int) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    if s.steps is None:
        return s.lr
    progress = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Run:
    """One run folder: prepared once (skeleton, corpus), then trained over any number of calls."""

    def __init__(self, settings: TrainSettings, log=None):
        self.s = settings
        self.dir = Path(settings.out)
        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.device = torch.device(settings.device)
        self.t_start = time.time()  # --max-minutes counts from here (preparation included)

    # ------------------------------------------------------------------ preparation
    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._check_run_json()
        skeleton = self.dir / "skeleton"
        if not (skeleton / "model.safetensors.index.json").is_file():
            t = time.time()
            make_skeleton(skeleton, self.s.overrides)
            self.say(f"train-tiny: skeleton written ({time.time() - t:.1f} s)")
        from dsv41.config import ModelConfig
        from dsv41.engram.hashing import EngramHasher
        from dsv41.tokenizer import Tokenizer
        self.cfg = ModelConfig.from_file(skeleton)
        self.tok = Tokenizer.from_dir(skeleton)
        self.hasher = EngramHasher.from_tokenizer(self.cfg, self.tok) if self.cfg.engram_layer_ids else None
        self.specs = read_layout(skeleton)
        corpus_dir = self.dir / "corpus"
        if not (corpus_dir / "tokens.npz").is_file():
            t = time.time()
            corpus = build_corpus(self.s.seed, self.s.code_bytes, self.s.n_chats)
            streams = D.tokenize_corpus(corpus, self.tok)
            D.save_streams(streams, corpus_dir, corpus.summary())
            self.say(f"train-tiny: corpus built and tokenized ({time.time() - t:.1f} s)")
        self.streams = D.load_streams(corpus_dir)
        self.corpus_info = json.loads((corpus_dir / "corpus.json").read_text())
        self.say("train-tiny: corpus tokens " + ", ".join(f"{k} {v:,}" for k, v in self.corpus_info["tokens"].items()))

    def _check_run_json(self) -> None:
        path = self.dir / "run.json"
        mine = {k: getattr(self.s, k) for k in SHAPING} | {"overrides": {**TRAINED_OVERRIDES, **self.s.overrides}}
        theirs = json.loads(path.read_text()) if path.is_file() else {**mine, "steps": None}
        diff = [k for k in mine if theirs.get(k) != mine[k]]
        if diff:
            raise DSV41Error(f"train-tiny: {self.dir} was started with other settings ({', '.join(diff)}: "
                             f"{[theirs.get(k) for k in diff]}); continue it with the same ones or use a new --out")
        if self.s.steps is not None and theirs["steps"] is not None and self.s.steps != theirs["steps"]:
            raise DSV41Error(f"train-tiny: {self.dir} trains for {theirs['steps']} steps (its learning-rate "
                             f"schedule); --steps {self.s.steps} would change it. Leave --steps out to continue.")
        self.s.steps = self.s.steps if self.s.steps is not None else theirs["steps"]
        self._write_run_json(mine)

    def _check_step_count(self) -> None:
        if self.s.steps is None and self.s.total_minutes is None:
            raise DSV41Error("train-tiny: give --steps N or --total-minutes M (the step count is then measured)")
        if self.s.warmup < 1:
            raise DSV41Error("train-tiny: --warmup must be at least 1")
        if self.s.steps is None and self.s.warmup < CALIBRATION:
            raise DSV41Error(f"train-tiny: --total-minutes needs --warmup >= {CALIBRATION} (the timed steps must "
                             f"not depend on the step count)")

    def _write_run_json(self, shaping: dict) -> None:
        (self.dir / "run.json").write_text(json.dumps({**shaping, "steps": self.s.steps}, indent=2) + "\n")
        self._shaping = shaping

    def _calibrate(self, step_times: list[float], minutes_used: float) -> None:
        """--total-minutes: the step count that fits, from the mean of the last timed steps (5 % kept back for
        evaluations and checkpoints); fixed in run.json from now on."""
        per_step = float(np.mean(step_times[-5:]))
        left = self.s.total_minutes * 60 * 0.95 - minutes_used * 60
        self.s.steps = max(self.step + 1, self.step + int(left / per_step))
        self._write_run_json(self._shaping)
        self.say(f"train-tiny: {per_step:.3f} s a step -> {self.s.steps} steps in {self.s.total_minutes} minutes")

    # ------------------------------------------------------------------ model and optimizer
    def build(self) -> None:
        self._check_step_count()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DSV41Error("train-tiny: --device cuda but CUDA is not available (use --device cpu for a smoke run)")
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 products (mHC mixing, router, head)
        self.net = TinyNet(self.cfg, self.specs).to(self.device)
        decay, plain = [], []
        for name in self.net.names():
            p = self.net.raw(name)
            if not p.requires_grad:
                continue
            (decay if p.dim() == 2 and not name.endswith(("embed.weight",)) else plain).append(p)
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.s.weight_decay},
                                      {"params": plain, "weight_decay": 0.0}], lr=self.s.lr, betas=(0.9, 0.95),
                                     eps=1e-8, **fused)
        self.step = 0
        self.tokens_seen = 0
        state_path = self.dir / "state.pt"
        if state_path.is_file():
            state = torch.load(state_path, map_location=self.device, weights_only=True)
            self.net.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
            self.say(f"train-tiny: resumed {state_path} at step {self.step}")
        else:
            init_weights(self.net, self.s.seed)
            self.net.to(self.device)
        self.micro = self.s.micro_batch or self.s.batch
        self.loss_fn = self.net.losses
        if self.s.compile:
            self.loss_fn = torch.compile(self.net.losses, dynamic=False)

    def save(self) -> None:
        path = self.dir / "state.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"model": self.net.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                    "tokens_seen": self.tokens_seen}, tmp)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ training
    def _batch(self, step: int):
        s = self.s
        b = D.make_batch(self.streams["train"], self.hasher, s.seed, step, s.batch, s.seq_len)
        rng = np.random.default_rng([s.seed, step, 7])
        anchors = torch.from_numpy(np.sort(rng.integers(0, s.seq_len - 1, size=(s.batch, s.anchors)), axis=1))
        return b, anchors

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def train_step(self, batch: D.Batch, anchors: torch.Tensor, lr: float):
        """One optimizer step on `batch`: forward and losses under autocast, backward, clipped AdamW, router
        balancing. Returns (losses, gradient norm before clipping). The batch runs in micro-batches of
        `self.micro` sequences with gradients accumulated (the same step); a CUDA out-of-memory halves it."""
        s = self.s
        batch, anchors = batch.to(self.device), anchors.to(self.device)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.net.train()
        while True:
            try:
                losses = self._accumulate(batch, anchors)
                break
            except torch.cuda.OutOfMemoryError:
                if self.micro <= 1:
                    raise
                self.opt.zero_grad(set_to_none=True)
                self.net.loads = {}
                torch.cuda.empty_cache()
                self.micro //= 2
                self.say(f"train-tiny: out of GPU memory; micro-batches of {self.micro} sequences from now on")
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.net.parameters() if p.requires_grad],
                                                   s.grad_clip)
        self.opt.step()
        self.net.balance_router(s.router_rate)
        return losses, grad_norm

    def _accumulate(self, batch: D.Batch, anchors: torch.Tensor) -> Losses:
        s, n = self.s, batch.ids.shape[0]
        self.opt.zero_grad(set_to_none=True)
        self.net.loads = {}
        total: dict[str, torch.Tensor] = {}
        for i in range(0, n, self.micro):
            part = slice(i, min(n, i + self.micro))
            share = (part.stop - part.start) / n
            with self._autocast():
                losses = self.loss_fn(batch.ids[part], None if batch.engram is None else batch.engram[part],
                                      anchors[part], s.draft_weight, s.confidence_weight, s.indexer_weight)
            (losses.total * share).backward()
            for k, v in losses.__dict__.items():
                total[k] = total.get(k, 0) + v.detach() * share
        return Losses(**total)

    def train(self) -> dict:
        s = self.s
        started = self.t_start
        budget = None if s.max_minutes is None else s.max_minutes * 60
        log = open(self.dir / "log.jsonl", "a")
        pool = ThreadPoolExecutor(max_workers=2)
        pending = {k: pool.submit(self._batch, k) for k in range(self.step, self.step + 2)}
        step_times: list[float] = []
        last = {}
        try:
            while s.steps is None or self.step < s.steps:
                t0 = time.time()
                if s.steps is None and self.step >= CALIBRATION:
                    self._calibrate(step_times, (t0 - started) / 60)
                if budget is not None and step_times and \
                        t0 - started + 2 * max(step_times[-20:]) + 45 > budget:
                    self.say(f"train-tiny: time budget reached at step {self.step}; checkpointing")
                    break
                batch, anchors = pending.pop(self.step).result()
                pending[self.step + 2] = pool.submit(self._batch, self.step + 2)
                losses, grad_norm = self.train_step(batch, anchors, lr_at(s, self.step))
                self.step += 1
                self.tokens_seen += s.batch * s.seq_len
                if self.device.type == "cuda":
                    torch.cuda.synchronize()  # step times are the calibration's and the time budget's measure
                step_times.append(time.time() - t0)
                if self.step % s.log_every == 0 or self.step == s.steps:
                    last = {"step": self.step, **{k: round(v, 5) for k, v in losses.floats().items()},
                            "grad_norm": round(float(grad_norm), 4), "lr": lr_at(s, self.step - 1),
                            "tok_s": round(s.batch * s.seq_len / max(1e-9, np.mean(step_times[-s.log_every:])), 1),
                            "tokens": self.tokens_seen}
                    log.write(json.dumps(last) + "\n")
                    log.flush()
                    self.say(f"step {self.step}/{s.steps} loss {last['total']:.4f} lm {last['lm']:.4f} "
                             f"acc {last['lm_acc']:.3f} draft {last['draft']:.3f}/{last['draft_acc']:.3f} "
                             f"idx {last['indexer']:.3f} {last['tok_s']:.0f} tok/s")
                if not math.isfinite(float(losses.total.detach())):
                    raise DSV41Error(f"train-tiny: loss is {float(losses.total.detach())} at step {self.step}")
                if self.step % s.eval_every == 0 or self.step == s.steps:
                    ev = self.evaluate()
                    log.write(json.dumps({"step": self.step, "eval": ev}) + "\n")
                    log.flush()
                    self.say(f"eval step {self.step}: " + json.dumps(ev))
                if self.step % s.ckpt_every == 0:
                    self.save()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            log.close()
        self.save()
        if last:
            loss_svg(self.dir / "log.jsonl", self.dir / "loss.svg")
        done = s.steps is not None and self.step >= s.steps
        result = {"step": self.step, "steps": s.steps, "done": done, "last": last,
                  "call_seconds": round(time.time() - started, 1),
                  "mean_step_s": round(float(np.mean(step_times)), 4) if step_times else None}
        if done:
            result["export"] = str(self.export())
        return result

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out next-token loss and top-1 accuracy per source, and the DSpark draft agreement on them."""
        s = self.s
        out = {}
        self.net.eval()
        batches = D.eval_batches(self.streams["heldout"], self.hasher, s.seq_len, s.eval_docs,
                                 batch=max(1, self.micro // 2))
        for src, bs in batches.items():
            totals = np.zeros(3)
            for i, b in enumerate(bs):
                b = b.to(self.device)
                rng = np.random.default_rng([s.seed, i, 11])
                anchors = torch.from_numpy(np.sort(rng.integers(0, s.seq_len - 1, size=(b.ids.shape[0],
                                                                                       s.anchors)), axis=1))
                with self._autocast():
                    losses = self.net.losses(b.ids, b.engram, anchors.to(self.device))
                totals += [float(losses.lm), float(losses.lm_acc), float(losses.draft_acc)]
            lm, acc, dacc = totals / max(1, len(bs))
            out[src] = {"loss": round(float(lm), 4), "acc": round(float(acc), 4), "draft_acc": round(float(dacc), 4)}
        chat = self.streams["heldout"].get("chat")
        if chat is not None and chat.answers is not None and "chat" in out:
            out["chat"]["answer_exact"] = self._answer_exact(chat)
        self.net.train()
        return out

    def _answer_exact(self, chat: D.Stream) -> float:
        """Held-out chats whose final answer (and EOS) is every token the model's argmax, the conversation before
        it given (teacher-forced reasoning and tool results): a cheap signal, not the generation accuracy."""
        s = self.s
        batches, spans = D.answer_batches(chat, self.hasher, s.seq_len, s.eval_docs * 4, max(1, self.micro // 2))
        hits, k = 0, 0
        for b in batches:
            b = b.to(self.device)
            with self._autocast():
                hidden, _ = self.net.backbone(b.inputs, b.engram)
                pred = self.net.logits(hidden).argmax(-1).view(b.inputs.shape).cpu()
            ids = b.ids.cpu()
            for row in range(ids.shape[0]):
                first, end = spans[k]
                hits += bool((pred[row, first - 1:end - 1] == ids[row, first:end]).all())
                k += 1
        return round(hits / max(1, k), 4)

    def export(self, out: str | Path | None = None) -> Path:
        target = Path(out or self.s.export or self.dir / "model")
        info = {"steps": self.step, "tokens_seen": self.tokens_seen, "settings": asdict(self.s),
                "overrides": {**TRAINED_OVERRIDES, **self.s.overrides}, "corpus": self.corpus_info,
                "torch": torch.__version__}
        folder = export_checkpoint(self.net, self.dir / "skeleton", target, info)
        self.say(f"train-tiny: exported {folder} ({checkpoint_bytes(folder) / 1e6:.2f} MB)")
        return folder


def train(settings: TrainSettings, log=None, export_now: bool = False, prepare_only: bool = False) -> dict:
    run = Run(settings, log)
    run.prepare()
    if prepare_only:
        return {"prepared": str(run.dir), "corpus": run.corpus_info}
    run.build()
    if export_now:
        return {"step": run.step, "export": str(run.export())}
    return run.train()
