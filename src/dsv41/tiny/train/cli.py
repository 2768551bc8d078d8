"""`dsv41 train-tiny`: train the tiny model into a run folder, resumable across calls (docs/TINY_MODEL.md)."""

from __future__ import annotations

import json


def register(sub) -> None:
    from dsv41.cli import number
    p = sub.add_parser("train-tiny", help="train the tiny model (corpus, AdamW, checkpoints, FP8 export)")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder (created; a later call continues it)")
    p.add_argument("--steps", type=number(int, 1), default=None, help="optimizer steps in all (fixed at the start)")
    p.add_argument("--total-minutes", type=number(float, 0, above=True), default=None,
                   help="instead of --steps: time the first steps and fit the step count to this many minutes")
    p.add_argument("--max-minutes", type=number(float, 0, above=True), default=None,
                   help="end this call (checkpointed, exit 0) within this many minutes; run again to continue")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (the default with --tiny-batch)")
    p.add_argument("--batch", type=number(int, 1), default=None, help="sequences a step (default 16)")
    p.add_argument("--seq-len", type=number(int, 2), default=None, help="tokens a sequence (default 2048)")
    p.add_argument("--lr", type=number(float, 0, above=True), default=None, help="peak learning rate (2e-3)")
    p.add_argument("--seed", type=number(int, 0), default=0)
    p.add_argument("--export", metavar="DIR", default=None, help="where the trained checkpoint goes (OUT/model)")
    p.add_argument("--micro-batch", type=number(int, 1), default=None,
                   help="sequences a forward, gradients accumulated (default: the whole batch; halved on OOM)")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the skeleton and the tokenized corpus into OUT and stop (no device needed)")
    p.add_argument("--export-now", action="store_true", help="export the last checkpoint and stop")
    p.add_argument("--compile", action="store_true", help="torch.compile the training step (CUDA; optional)")
    p.add_argument("--tiny-batch", action="store_true",
                   help="smoke-test sizes: small corpus, 2 sequences of 64 tokens (CPU-friendly)")
    p.set_defaults(func=cmd_train_tiny)


def cmd_train_tiny(args) -> int:
    from .trainer import TrainSettings, train
    given = {k: v for k, v in {"steps": args.steps, "total_minutes": args.total_minutes,
                               "max_minutes": args.max_minutes, "device": args.device, "batch": args.batch,
                               "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "export": args.export,
                               "compile": args.compile, "micro_batch": args.micro_batch}.items() if v is not None}
    settings = TrainSettings.smoke(args.out, **given) if args.tiny_batch else TrainSettings(out=args.out, **given)
    print(json.dumps(train(settings, export_now=args.export_now, prepare_only=args.prepare_only)))
    return 0
