"""`dsv41 engram pack`: the Engram shard files of one rank from the original checkpoint (docs/ENGRAM.md).

    dsv41 engram pack --src ORIG --list                           which source shards to download, and how
    dsv41 engram pack --src ORIG --out DIR --rank R --tp N        write engram-l{L}-r{R}of{N}.bin (resumable)
    dsv41 engram pack --src ORIG --check DIR [--rank R --tp N]    compare packed files with the source

`register(subparsers)` adds the command to the main CLI (`dsv41.cli`).
"""

from __future__ import annotations

import argparse

from dsv41.errors import DSV41Error


def register(sub) -> None:
    engram = sub.add_parser("engram", help="Engram tables: pack the original checkpoint's into per-rank shard files")
    commands = engram.add_subparsers(dest="engram_command", required=True)
    p = commands.add_parser("pack", help="write (or --list, --check) one rank's Engram shard files")
    p.add_argument("--src", metavar="ORIG_DIR", required=True,
                   help="the original checkpoint folder (config.json, model.safetensors.index.json, table shards)")
    p.add_argument("--out", metavar="DIR", help="where the shard files go (a local disk of the rank's node)")
    from dsv41.cli import number  # argparse and the stdlib only

    p.add_argument("--rank", type=number(int, 0), help="this node's tensor-parallel rank")
    p.add_argument("--tp", type=number(int, 1), help="the tensor-parallel world size")
    p.add_argument("--layers", help="comma-separated Engram layer ids (default: all of the config's)")
    p.add_argument("--list", action="store_true", help="print which source shards hold the tables and exit")
    p.add_argument("--check", metavar="DIR", help="compare the shard files in DIR with the source and exit")
    p.add_argument("--full", action="store_true", help="with --check: compare every row, not a sample")
    p.add_argument("--sample", type=number(int, 1), default=4096,
                   help="with --check: rows sampled per file (default 4096)")
    p.add_argument("--chunk-rows", type=number(int, 1), default=None, help="rows copied per chunk (default 131072)")
    p.add_argument("--max-mib-s", type=number(float, 0, above=True), default=None,
                   help="limit the copy rate (MiB/s), e.g. beside a server")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar with rate and ETA (default: when stderr is a terminal)")
    p.add_argument("--repo", default=None, help="Hugging Face repository for the --list download command")
    p.set_defaults(func=run_pack)


def _layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DSV41Error(f"--layers {text!r}: expected comma-separated layer ids") from None


def run_pack(args) -> int:
    from .source import RELEASE_REPO, OriginalCheckpoint

    src = OriginalCheckpoint(args.src, repo=args.repo or RELEASE_REPO)
    if args.list:
        for layer_id, file in src.table_files().items():
            weight, _ = src.names(layer_id)
            print(f"layer {layer_id}: {weight} and .scale are in {file}")
        print("download only these (with the config and the index):")
        print(f"  {src.download_hint()}")
        return 0
    if args.check:
        from .check import check_pack

        report = check_pack(src, args.check, rank=args.rank, world=args.tp, sample=args.sample, full=args.full)
        for line in report.passed:
            print(f"ok: {line}")
        for line in report.problems:
            print(f"MISMATCH: {line}")
        return 0 if report.ok else 1
    missing = [flag for flag, value in (("--out", args.out), ("--rank", args.rank), ("--tp", args.tp))
               if value is None]
    if missing:
        raise DSV41Error(f"packing needs {', '.join(missing)} (or use --list / --check)")
    from .pack import CHUNK_ROWS, pack_rank

    report = pack_rank(src, args.out, args.rank, args.tp, layers=_layers(args.layers),
                       chunk_rows=args.chunk_rows or CHUNK_ROWS,
                       max_rate=args.max_mib_s * 2**20 if args.max_mib_s else None, progress=args.progress)
    for path in report.skipped:
        print(f"{path}: already complete")
    for path in report.files:
        print(f"{path}: written")
    print(report.summary())
    return 0
