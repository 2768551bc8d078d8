"""`dsv41 prepare`: write (or `--check`) each rank's prepared folder (registered by dsv41.cli when it runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsv41.errors import DSV41Error

from .start import _log


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
    args.prepared_root = args.out
    warm = args.warm_kernels if args.warm_kernels is not None else device.type == "cuda"
    if warm:  # the service's first start is then a restart (no Triton compile); a failure only warns
        import gc

        import torch

        gc.collect()  # the child needs the GPU memory the build held (this process keeps only its CUDA context)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for rank in ranks:
            try:
                _warm_rank(args, rank)
            except (DSV41Error, OSError) as exc:
                _log(f"warning: {exc}\nwarning: the folder is prepared; the service compiles the Triton kernels "
                     f"at its first start instead (or run `dsv41 warm-kernels` again)")
    return 0


# ----------------------------------------------------------------------------------------------- warm-kernels
def _serve_env(args) -> dict[str, str]:
    """The DSV41_* values the service starts with: the env file's, then the options given (as knobs)."""
    from dsv41.ops.knobs import parse_env_file

    from dsv41.cli import _model_dir

    env = dict(parse_env_file(Path(args.env_file))) if args.env_file else {}
    args.model = args.model or env.get("DSV41_MODEL", "").strip() or str(_model_dir(None))
    for option, knob in ENV_DEFAULTS:
        value = getattr(args, option if option != "out" else "prepared_root", None)
        if value not in (None, ""):
            env[knob] = str(value)
    env["DSV41_FORWARD"] = "fast"  # a start from a prepared folder runs the fast forward
    return env


def _warm_rank(args, rank: int) -> dict:
    from dsv41.ops.knobs import serve_argv

    from .warm_kernels import triton_cache_dir, unit_environment, unit_user, warm_kernels

    env = _serve_env(args)
    instance = f"rank{rank}"
    if args.triton_cache_dir:  # a cache of the caller's own: the child runs as the caller
        cache, user = Path(args.triton_cache_dir), None
    else:  # the unit's cache: as the unit's user (when run as root)
        cache, user = triton_cache_dir(instance), unit_user()
    return warm_kernels(serve_argv(env, rank), rank=rank, cache_dir=cache, env=env, user=user,
                        toolchain=unit_environment(instance), log=_log)


def cmd_warm_kernels(args) -> int:
    """`dsv41 warm-kernels`: each rank's start (from its prepared folder) once, filling the unit's Triton cache."""
    from .manifest import read_manifest, rank_folder

    args.prepared_root = args.prepared
    if args.env_file:
        from dsv41.ops.knobs import parse_env_file

        env = parse_env_file(Path(args.env_file))
        args.prepared_root = args.prepared_root or env.get("DSV41_PREPARED", "").strip() or None
        args.tp = args.tp or int(env.get("DSV41_TP", "").strip() or 1)
    args.tp = args.tp or 1
    if not args.prepared_root:
        _log("warm-kernels: skip: no prepared folder (DSV41_PREPARED is empty): the service compiles at its first "
             "start")
        return 0
    ranks = [args.rank] if args.rank is not None else list(range(args.tp))
    failed = 0
    for rank in ranks:
        folder = rank_folder(args.prepared_root, rank, args.tp)
        if not (folder / "manifest.json").is_file():
            _log(f"warm-kernels: skip rank {rank}: {folder} is not prepared (run `dsv41 prepare`)")
            continue
        try:
            read_manifest(folder)
            _warm_rank(args, rank)
        except (DSV41Error, OSError) as exc:
            _log(f"warning: {exc}")
            failed += 1
    return 1 if failed else 0


def _placement_args(p) -> None:
    p.add_argument("--device", default=None, help="device the ranks will serve on: auto, cpu, cuda (default auto)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="compute dtype, as serve's (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--triton-cache-dir", metavar="DIR",
                   help="where the Triton kernels go (default: the TRITON_CACHE_DIR of dsv41@rankR.service, "
                        "written as its User= when run as root)")


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
    from dsv41.cli import number

    p.add_argument("--tp", type=number(int, 1), default=None, metavar="N",
                   help="tensor-parallel world size (default 1)")
    p.add_argument("--rank", type=number(int, 0), metavar="R", help="the rank to prepare (default: every rank of --tp)")
    _placement_args(p)
    p.add_argument("--warm-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="then compile the start's Triton kernels into the service's cache (`dsv41 warm-kernels`; "
                        "default on when the device is CUDA)")
    p.add_argument("--no-fake-quant", action="store_true", help="as serve's --no-fake-quant")
    p.add_argument("--engram-dir", metavar="DIR", help="the packed Engram shards serve will read (as serve's)")
    p.add_argument("--check", action="store_true", help="re-verify every entry's SHA-256 instead of preparing")
    p.add_argument("--force", action="store_true", help="prepare again even when the folder is current")
    p.set_defaults(func=cmd_prepare)

    w = sub.add_parser("warm-kernels", help="compile a rank's Triton kernels into the service's cache (its start "
                                            "from the prepared folder, once, up to the first token)",
                       description="Run each rank's start from its prepared folder in a child process with the "
                                   "TRITON_CACHE_DIR of dsv41@rankR.service (as the unit's user when run as root), "
                                   "so the service's next start compiles nothing. Needs the GPU: the rank must be "
                                   "stopped. Skips (rc 0) when there is no prepared folder.")
    w.add_argument("--env-file", metavar="FILE", help="the appliance's env file (/etc/dsv41/dsv41.env): the "
                                                      "service's DSV41_* values")
    w.add_argument("--prepared", metavar="DIR", help="root of the prepared folders (default DSV41_PREPARED)")
    w.add_argument("--model", metavar="DIR", help="checkpoint folder (default DSV41_MODEL)")
    w.add_argument("--tp", type=number(int, 1), default=None, metavar="N", help="TP size (default DSV41_TP or 1)")
    w.add_argument("--rank", type=number(int, 0), metavar="R", help="the rank (default: every rank of --tp)")
    w.add_argument("--engram-dir", metavar="DIR", help="as serve's (default DSV41_ENGRAM_DIR)")
    _placement_args(w)
    w.set_defaults(func=cmd_warm_kernels)
