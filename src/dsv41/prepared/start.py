"""Starting from a prepared folder: the `--prepared` options of `serve` and `generate`, the load with its checkpoint
fallback, and `generate`'s loop over the fast path. (Imports nothing of the CLI modules: they import it.)"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


from .manifest import PreparedMismatch


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
    from dsv41.compose.build import dspark_wanted

    drafting = dspark_wanted(args, device)
    if root is not None:
        try:
            model = load_prepared(root, model_dir, device=device, dtype=dtype, rank=rank, world=world, comm=comm,
                                  fake_quant=fake_quant, engram_dir=engram_dir,
                                  verify=getattr(args, "prepared_verify", None), phases=phases, progress=progress)
            if not drafting:  # the folder carries the drafter; a start that does not draft
                model.dspark = None  # lets its memory go (as the checkpoint build does not make it)
            return model
        except PreparedMismatch as exc:
            if not getattr(args, "prepared_fallback", False):
                raise
            log(f"dsv41: prepared folder refused ({exc}); building from the checkpoint (--prepared-fallback)")
    model = build_fast_model(model_dir, device=device, dtype=dtype, rank=rank, world=world, comm=comm,
                             fake_quant=fake_quant, engram_dir=engram_dir, progress=progress,
                             dspark=None if drafting else False)  # as the reference load
    phases.done("build", f"from the checkpoint {model_dir}")
    return model


# --------------------------------------------------------------------------------------------------- generate
def wants_fast(args) -> bool:
    """`generate` runs the fast path when started from a prepared folder or with --forward fast."""
    return prepared_root(args) is not None or getattr(args, "forward", "reference") == "fast"


def generate_fast(args, model_dir: Path, device, progress=None) -> int:
    """`dsv41 generate` over the FastModel (prefill, then one decode row a step): the text and tokens/s."""
    import time

    import torch

    from dsv41.runtime.sampling import sample_token

    model = load_fast_model(args, model_dir, device=device, dtype=getattr(torch, args.dtype),
                            engram_dir=getattr(args, "engram_dir", None), progress=progress)
    from dsv41.generation import generation_inputs

    tok, ids, params, seed = generation_inputs(args, model, model_dir)
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
