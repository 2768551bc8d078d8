"""Start time: each phase of a start from a prepared folder against a start from the checkpoint (issue 35).

    python bench/start.py --synthetic [--layers N]            # GPU: the full-shape synthetic rank 0 of TP 2
    python bench/start.py --model DIR [--tp 2 --rank 0]       # a checkpoint (the tiny model on the CPU)

One rank runs (at TP > 1 its peer is decode_step.py's StubComm: the same shapes, no second GPU). Steps, each start
in a fresh child process (what a restart is): prepare the rank's folder once (timed; skipped
when current), then start from the folder and start from the source, each timed from the child's spawn:
`imports` (python, torch, dsv41), then `manifest` / `read` / `skeleton` (prepared) or `build` (checkpoint:
`build_fast_model`; synthetic: generating the rank on the device, the only "checkpoint" it has), `runner` (KV pool
and CUDA graph capture through the serving engine's `build_runner`; CUDA only), `first_token` (a 16-token prefill
and its argmax). Then the Triton cache is emptied and the warm step runs (`warm`: a start from the folder, the
runner and the first request through it, as `dsv41 warm-kernels` runs them: prepared/warm_kernels.py), and a start
after it (`prepared_after_warm`: its runner should take a restart's seconds). With `--drop-caches` (root) a cold start from the folder is timed too, after dropping the page
cache: its read phase gives the disk's rate. Results (phases, totals, folder size and read rates, the device, the
commit) go to `bench/results/start.json` (`--out`).

On a GPU that cannot hold the whole rank (an H100 holds ~26 of the 40 layers), `--layers N` builds the first N
layers and the results carry `scale`: the bytes a 40-layer rank would hold over the folder's (the folder's layer
parts times 40 / N, plus what does not grow with layers: embedding, head, the DSpark blocks, Engram), and each
start's `total_scaled_s`: the byte-bound phases (read, skeleton, build, runner) times `scale`, the others as
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCALED = ("read", "skeleton", "build", "runner")
PROMPT = 16


def _source(args) -> dict:
    return {"kind": "synthetic", "layers": args.layers, "seed": 0, "tp": args.tp, "rank": args.rank}


def _comm(args):
    """At TP > 1 one rank runs alone: decode_step.py's StubComm stands in for the peer (the same shapes)."""
    if args.tp == 1:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_step import StubComm

    return StubComm()


def _synthetic(args, device, dtype, comm):
    from dsv41.runtime.synthetic import synthetic_rank

    return synthetic_rank(rank=args.rank, world=args.tp, device=device, dtype=dtype, layers=args.layers, comm=comm)


def _placement(args):
    import torch

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


# ------------------------------------------------------------------------------------------------------- child
def child(args) -> None:
    spawned = float(os.environ["START_BENCH_SPAWNED"])
    import torch

    from dsv41.prepared.reader import StartPhases, load_prepared
    from dsv41.runtime.build import build_fast_model

    device, dtype = _placement(args)
    if device.type == "cuda":
        torch.cuda.init()
    phases = StartPhases()
    phases.add("imports", time.time() - spawned)
    comm = _comm(args)
    kw = dict(device=device, dtype=dtype, rank=args.rank, world=args.tp, comm=comm)
    if args.child == "prepare":
        from dsv41.prepared.writer import prepare, prepare_model

        if args.synthetic:
            prepare_model(_synthetic(args, device, dtype, comm), args.root, _source(args), rank=args.rank,
                          world=args.tp)
        else:
            prepare(args.model, args.root, **kw)
        phases.done("prepare")
    elif args.child == "checkpoint":
        model = _synthetic(args, device, dtype, comm) if args.synthetic else build_fast_model(args.model, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        phases.done("build")
    else:
        model = load_prepared(args.root, None if args.synthetic else args.model, phases=phases,
                              source=_source(args) if args.synthetic else None, **kw)
    if args.child == "warm" and args.runner:  # `dsv41 warm-kernels`' start (no checkpoint here for serve's args)
        from dsv41.compose.build import build_runner, engine_defaults
        from dsv41.prepared.warm_kernels import first_request

        runner = build_runner(engine_defaults(parallel=1, forward="fast"), model, 4096, log=lambda line: None)
        phases.done("runner")
        phases.done("first_token", f"token {first_request(runner, device)}")
    elif args.child not in ("prepare", "warm"):
        if args.runner:
            from dsv41.compose.build import build_runner, engine_defaults

            build_runner(engine_defaults(parallel=1, forward="fast"), model, 4096, log=lambda line: None)
            phases.done("runner")
        if args.first_token:
            state = model.new_state()
            ids = [0] + [(i * 37) % 500 + 5 for i in range(PROMPT - 1)]
            token = int(model.forward([(state, ids)], "prefill")[-1].argmax())
            phases.done("first_token", f"token {token}")
    Path(args.result).write_text(json.dumps({"phases": phases.seconds, "since_spawn_s": time.time() - spawned}))


# ------------------------------------------------------------------------------------------------------ parent
def run_child(args, kind: str, root: Path) -> dict:
    result = root.parent / f".start-{kind}.json"
    argv = [sys.executable, __file__, "--child", kind, "--root", str(root), "--result", str(result)]
    for name in ("model", "layers", "tp", "rank", "device"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += ["--synthetic"] * args.synthetic + [f"--{'' if args.runner else 'no-'}runner",
                                                f"--{'' if args.first_token else 'no-'}first-token"]
    env = {**os.environ, "START_BENCH_SPAWNED": repr(time.time()), "PYTHONPATH": str(REPO / "src"),
           "TRITON_CACHE_DIR": str(root.parent / ".start-triton-cache")}
    subprocess.run(argv, check=True, env=env)
    out = json.loads(result.read_text())
    out["total_s"] = round(sum(out["phases"].values()), 3)
    out["phases"] = {k: round(v, 3) for k, v in out["phases"].items()}
    return out


def _scale(manifest: dict, layers: int) -> float:
    """Bytes of a 40-layer rank over the folder's: the layer parts grow with the layers, the rest does not."""
    entries = manifest["entries"]
    total = sum(e["nbytes"] for e in entries)
    per_layer = sum(e["nbytes"] for e in entries if e["part"].startswith("block."))
    return (total - per_layer + per_layer * 40 / layers) / max(total, 1)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _device_name(args) -> str:
    import torch

    device, _ = _placement(args)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the built-in tiny model unless --synthetic)")
    p.add_argument("--synthetic", action="store_true", help="the full-shape synthetic rank (runtime/synthetic.py)")
    p.add_argument("--layers", type=int, help="with --synthetic: the first N layers (default all 40)")
    p.add_argument("--tp", type=int, default=None, help="TP size (default 2 with --synthetic, else 1)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--root", help="where the prepared folder goes (default: a folder beside --out, removed after)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "start.json"))
    p.add_argument("--runner", action=argparse.BooleanOptionalAction, default=None,
                   help="time the KV pool + CUDA graph capture (default on CUDA)")
    p.add_argument("--first-token", action=argparse.BooleanOptionalAction, default=True,
                   help="time a 16-token prefill (default on; the CPU runs EXL3 only in Triton's interpreter)")
    p.add_argument("--drop-caches", action="store_true", help="also a cold start from the folder (needs root)")
    p.add_argument("--child", choices=("prepare", "prepared", "checkpoint", "warm"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tp = args.tp or (2 if args.synthetic else 1)
    if args.child:
        child(args)
        return 0
    if not args.synthetic and not args.model:
        sys.path.insert(0, str(REPO / "src"))
        from dsv41.tiny.model import default_model_dir

        args.model = str(default_model_dir())
    import torch

    if args.runner is None:
        args.runner = _placement(args)[0].type == "cuda"
    keep = args.root is not None
    root = Path(args.root) if keep else Path(args.out).parent / ".start-prepared"
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        prep = run_child(args, "prepare", root)
        folder = next(root.iterdir())
        size = (folder / "data.bin").stat().st_size
        manifest = json.loads((folder / "manifest.json").read_text())
        # the first start after an install compiles the Triton kernels into the unit's cache (TRITON_CACHE_DIR under
        # the state folder: systemd/dsv41@.service.in); every later start, a restart, finds them there
        first = run_child(args, "prepared", root)
        starts = {"prepared": run_child(args, "prepared", root), "checkpoint": run_child(args, "checkpoint", root),
                  "prepared_first_boot": first}
        # `dsv41 prepare` / deploy's warm step into an empty cache, then the service's start after it
        cache = root.parent / ".start-triton-cache"
        shutil.rmtree(cache, ignore_errors=True)
        starts["warm"] = run_child(args, "warm", root)
        starts["warm"]["cache_files"] = sum(len(files) for _, _, files in os.walk(cache))
        starts["prepared_after_warm"] = run_child(args, "prepared", root)
        if args.drop_caches:
            starts["prepared_cold" if drop_caches() else "prepared_cold_not_dropped"] = run_child(args, "prepared",
                                                                                                 root)
    finally:
        shutil.rmtree(root.parent / ".start-triton-cache", ignore_errors=True)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    layers = args.layers or 40 if args.synthetic else None
    scale = _scale(manifest, layers) if args.synthetic else 1.0
    for start in starts.values():
        start["total_scaled_s"] = round(sum(v * (scale if k in SCALED else 1.0) for k, v in start["phases"].items()),
                                        3)
        if "read" in start["phases"]:
            start["read_gib_s"] = round(size / 2**30 / max(start["phases"]["read"], 1e-9), 2)
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                                               capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "device": _device_name(args), "torch": torch.__version__,
              "source": "synthetic" if args.synthetic else args.model, "tp": args.tp, "rank": args.rank,
              "layers": layers, "scale": round(scale, 4), "folder_gib": round(size / 2**30, 3),
              "prepare_s": round(prep["phases"]["prepare"], 3), "starts": starts,
              "note": "seconds from each child's spawn; runner = KV pool + CUDA graphs (build_runner); the children "
                      "share a Triton cache that starts empty: prepared_first_boot compiles (the first start after an "
                      "install), prepared and checkpoint find the kernels compiled (a restart); then the cache is emptied, warm is the "
                      "warm step (`dsv41 warm-kernels`' start: runner + first request through it) and "
                      "prepared_after_warm the service's start after it"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
