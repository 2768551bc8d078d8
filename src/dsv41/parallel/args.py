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
