"""`dsv41 download`: the EXL3 pack, or the original checkpoint's Engram table shards, verified (hub/download.py)."""

from __future__ import annotations


def cmd_download(args) -> int:
    from dsv41.engram.source import RELEASE_REPO, RELEASE_REVISION

    from .download import PACK_REPO, PACK_REVISION, download, download_engram_source

    if args.engram_source:
        repo, revision = args.repo or RELEASE_REPO, args.revision or RELEASE_REVISION
        if args.include:
            download(repo, revision, args.dir, args.include)
        else:
            download_engram_source(repo, revision, args.dir)
        return 0
    download(args.repo or PACK_REPO, args.revision or PACK_REVISION, args.dir, args.include or None)
    return 0


def register(sub) -> None:
    p = sub.add_parser("download", help="fetch the EXL3 pack (or the Engram source shards) from the Hub, verified",
                       description="Download a pinned revision through huggingface_hub (HF_ENDPOINT, HF_TOKEN apply), "
                                   "resuming partial files, then check every file's SHA-256 against the Hub's.")
    p.add_argument("--dir", required=True, metavar="DIR", help="folder to fill (e.g. /srv/dsv41/model)")
    p.add_argument("--engram-source", action="store_true",
                   help="the original FP8 checkpoint instead of the pack, only config, index and the shards holding "
                        "the Engram tables (for `dsv41 engram pack --src DIR`)")
    p.add_argument("--repo", metavar="ORG/NAME", help="repository (default: the EXL3 pack, or the original release "
                                                      "with --engram-source)")
    p.add_argument("--revision", metavar="REV", help="branch, tag or commit (default: the pinned commit)")
    p.add_argument("--include", metavar="PATTERN", nargs="+", action="extend", default=[],
                   help="only files matching these glob patterns (default: every file)")
    p.set_defaults(func=cmd_download)
