"""The tensor-parallel options of `dsv41 serve` (argparse only: building the CLI parser must not import torch)."""

from __future__ import annotations


def register_tp_args(parser) -> None:
    """Add the tensor-parallel options to `dsv41 serve`'s parser."""
    group = parser.add_argument_group("tensor parallelism")
    group.add_argument("--tp", type=int, default=1, metavar="N", help="number of ranks (default 1: no TP)")
    group.add_argument("--rank", type=int, default=None, metavar="R",
                       help="this process's rank; without it, `--tp N` starts ranks 1..N-1 on this host")
    group.add_argument("--master", default=None, metavar="HOST:PORT",
                       help="rank 0's rendezvous address (rank 0 listens on PORT; default with local ranks: "
                            "127.0.0.1 and a free port)")
    group.add_argument("--tp-backend", choices=("gloo", "nccl"), default=None,
                       help="collective backend (default: nccl when CUDA is available, else gloo)")
    group.add_argument("--tp-deadline", type=float, default=300.0, metavar="S",
                       help="seconds to wait for all ranks to join and to finish loading (default 300)")
    group.add_argument("--tp-peer-timeout", type=float, default=3.0, metavar="S",
                       help="a rank without heartbeat for this long is lost: the group exits 70 (default 3)")
    group.add_argument("--tp-collective-timeout", type=float, default=300.0, metavar="S",
                       help="upper bound on any single collective (default 300)")


def check_tp_args(args) -> None:
    """One-line refusals for tensor-parallel options that cannot work (before anything binds or loads)."""
    from dsv41.errors import DSV41Error

    if args.tp < 1:
        raise DSV41Error(f"--tp must be a positive integer, got {args.tp}")
    if args.rank is not None and not 0 <= args.rank < args.tp:
        raise DSV41Error(f"--rank {args.rank} is outside --tp {args.tp} (ranks are 0..{args.tp - 1})")
    for flag, value in (("--tp-deadline", args.tp_deadline), ("--tp-peer-timeout", args.tp_peer_timeout),
                        ("--tp-collective-timeout", args.tp_collective_timeout)):
        if not 0 < value < float("inf"):
            raise DSV41Error(f"{flag} must be a positive number of seconds, got {value:g}")
    if args.tp > 1 and args.master is not None:
        from dsv41.parallel.rendezvous import resolve_secret  # imports torch: only when TP is asked for

        resolve_secret(args.master, local_mode=False)  # HOST:PORT syntax, and the secret across hosts
