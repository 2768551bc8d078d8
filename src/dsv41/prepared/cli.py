"""`dsv41 prepare`, and the `--prepared` start of `generate` and `serve` (with its checkpoint fallback)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dsv41.errors import DSV41Error

from .manifest import PreparedMismatch


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _placement(args):
    """(device, dtype) as `serve` resolves them: auto dtype = bfloat16 on CUDA, float32 elsewhere."""
    import torch

    from dsv41.cli import resolve_device

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, dtype)


# ---------------------------------------------------------------------------------------------------- prepare
# (option, knob) pairs `--env-file` fills when the option is not given: the values serve will start with
ENV_DEFAULTS = (("model", "DSV41_MODEL"), ("out", "DSV41_PREPARED"), ("tp", "DSV41_TP"), ("device", "DSV41_DEVICE"),
                ("dtype", "DSV41_DTYPE"), ("engram_dir", "DSV41_ENGRAM_DIR"))


def _apply_env_file(args) -> None:
    if args.env_file:
        from dsv41.ops.knobs import parse_env_file

        env = parse_env_file(Path(args.env_file))
        for option, knob in ENV_DEFAULTS:
            value = env.get(knob, "").strip()
            if getattr(args, option) is None and value:
                setattr(args, option, int(value) if option == "tp" else value)
    args.tp = args.tp or 1
    args.device = args.device or "auto"
    args.dtype = args.dtype or "auto"
    if not args.out:
        raise DSV41Error("--out (or DSV41_PREPARED in --env-file) names where the prepared folders go")


def cmd_prepare(args) -> int:
    from dsv41.cli import _model_dir

    from .writer import check_folder, prepare

    _apply_env_file(args)
    world = args.tp
    ranks = [args.rank] if args.rank is not None else list(range(world))
    if any(not 0 <= r < world for r in ranks) or world < 1:
        raise DSV41Error(f"--rank {args.rank} is outside --tp {world} (ranks are 0..{world - 1})")
    if args.check:
        from .manifest import rank_folder

        bad = 0
        for rank in ranks:
            folder = rank_folder(args.out, rank, world)
            problems = check_folder(folder)
            for line in problems:
                print(line, file=sys.stderr)
            bad += bool(problems)
            if not problems:
                print(f"{folder}: every entry verified", file=sys.stderr)
        return 1 if bad else 0
    device, dtype = _placement(args)
    for rank in ranks:
        prepare(_model_dir(args.model), args.out, rank=rank, world=world, device=device, dtype=dtype,
                fake_quant=not args.no_fake_quant, engram_dir=args.engram_dir, force=args.force, log=_log)
    return 0


def register(sub) -> None:
    p = sub.add_parser("prepare", help="write each rank's prepared folder (the bytes the runtime places on the "
                                       "device) for fast starts",
                       description="Build this rank's fast-path model from the checkpoint and store it as "
                                   "OUT/rank{R}-of-{TP}/{manifest.json,data.bin}; resumable; --check re-verifies.")
    p.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the built-in tiny model)")
    p.add_argument("--out", metavar="DIR", help="root of the prepared folders (required, or from --env-file)")
    p.add_argument("--env-file", metavar="FILE",
                   help="take the options not given from the appliance's env file (/etc/dsv41/dsv41.env: "
                        "DSV41_MODEL, DSV41_PREPARED, DSV41_TP, DSV41_DEVICE, DSV41_DTYPE, DSV41_ENGRAM_DIR), as the "
                        "ranks will start")
    p.add_argument("--tp", type=int, default=None, metavar="N", help="tensor-parallel world size (default 1)")
    p.add_argument("--rank", type=int, metavar="R", help="the rank to prepare (default: every rank of --tp)")
    p.add_argument("--device", default=None, help="device the ranks will serve on: auto, cpu, cuda (default auto)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="compute dtype, as serve's (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--no-fake-quant", action="store_true", help="as serve's --no-fake-quant")
    p.add_argument("--engram-dir", metavar="DIR", help="the packed Engram shards serve will read (as serve's)")
    p.add_argument("--check", action="store_true", help="re-verify every entry's SHA-256 instead of preparing")
    p.add_argument("--force", action="store_true", help="prepare again even when the folder is current")
    p.set_defaults(func=cmd_prepare)


# ---------------------------------------------------------------------------------------------- start options
def add_start_args(p: argparse.ArgumentParser) -> None:
    """--prepared / --prepared-fallback / --prepared-verify on `serve` and `generate`."""
    p.add_argument("--prepared", metavar="DIR", default=None,
                   help="start from the prepared folders under DIR (`dsv41 prepare`; default $DSV41_PREPARED) "
                        "instead of building the model from the checkpoint")
    p.add_argument("--prepared-fallback", action="store_true",
                   help="when the prepared folder does not fit (other checkpoint, rank, layout or code), build from "
                        "the checkpoint instead of refusing to start")
    p.add_argument("--prepared-verify", choices=("sample", "full", "off"), default=None,
                   help="re-hash at start: skeleton + every 16th tensor (sample, default), all, or none "
                        "(default $DSV41_PREPARED_VERIFY or sample)")


def prepared_root(args) -> str | None:
    return getattr(args, "prepared", None) or os.environ.get("DSV41_PREPARED", "").strip() or None


def load_fast_model(args, model_dir: Path, *, device, dtype, rank: int = 0, world: int = 1, comm=None,
                    engram_dir=None, progress=None, log=_log, notify=None):
    """This rank's FastModel from its prepared folder, or from the checkpoint: without --prepared, or (logged)
    when the folder does not fit and --prepared-fallback was given. A folder that does not fit otherwise is a
    one-line PreparedMismatch."""
    from dsv41.runtime.build import build_fast_model

    from .reader import StartPhases, load_prepared

    fake_quant = not args.no_fake_quant
    root = prepared_root(args)
    phases = StartPhases(log, notify)
    if root is not None:
        try:
            return load_prepared(root, model_dir, device=device, dtype=dtype, rank=rank, world=world, comm=comm,
                                 fake_quant=fake_quant, engram_dir=engram_dir,
                                 verify=getattr(args, "prepared_verify", None), phases=phases, progress=progress)
        except PreparedMismatch as exc:
            if not getattr(args, "prepared_fallback", False):
                raise
            log(f"dsv41: prepared folder refused ({exc}); building from the checkpoint (--prepared-fallback)")
    model = build_fast_model(model_dir, device=device, dtype=dtype, rank=rank, world=world, comm=comm,
                             fake_quant=fake_quant, engram_dir=engram_dir, progress=progress)
    phases.done("build", f"from the checkpoint {model_dir}")
    return model


# --------------------------------------------------------------------------------------------------- generate
def wants_fast(args) -> bool:
    """`generate` runs the fast path when started from a prepared folder or with --forward fast."""
    return prepared_root(args) is not None or getattr(args, "forward", "reference") == "fast"


def generate_fast(args) -> int:
    """`dsv41 generate` over the FastModel (prefill, then one decode row a step): the text and tokens/s."""
    import time

    import torch

    from dsv41.cli import LoadBar, _model_dir, resolve_device
    from dsv41.engine.sampling import SamplingParams, derive_seed, sample_token

    device = resolve_device(args.device)
    model_dir = _model_dir(args.model)
    model = load_fast_model(args, model_dir, device=device, dtype=getattr(torch, args.dtype),
                            engram_dir=getattr(args, "engram_dir", None), progress=LoadBar().update)
    tok = model.tokenizer
    if tok is None:
        raise DSV41Error(f"{model_dir}: tokenizer.json is missing")
    ids = tok.encode(args.prompt)
    if not ids or ids[0] != tok.bos_id:
        ids = [tok.bos_id] + ids
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    seed = args.seed if args.seed is not None else derive_seed(ids)
    state, decoder, out = model.new_state(), tok.incremental_decoder(), []
    start = time.perf_counter()
    with torch.no_grad():
        logits = model.forward([(state, ids)], "prefill")[-1]
        prefill_s = time.perf_counter() - start
        for step in range(args.max_tokens):
            nxt = sample_token(logits, params, seed, step)
            out.append(nxt)
            if nxt == tok.eos_id and not args.ignore_eos:
                break
            sys.stdout.write(decoder.feed([nxt]))
            sys.stdout.flush()
            logits = model.forward([(state, [nxt])], "decode")[-1]
    sys.stdout.write(decoder.flush() + "\n")
    decode_s = max(time.perf_counter() - start - prefill_s, 1e-9)
    print(f"[{len(ids)} prompt tokens in {prefill_s:.2f} s; {len(out)} generated in {decode_s:.2f} s "
          f"({len(out) / decode_s:.2f} tok/s); ids {out}]", file=sys.stderr)
    return 0
