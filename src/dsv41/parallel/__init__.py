"""Tensor parallelism: communicators, rendezvous, round plans, fail-fast, launch (docs/TENSOR_PARALLEL.md).

`LocalComm` is the TP=1 default; everything else needs torch.distributed and is imported from its module
(`dsv41.parallel.launch.run_rank`, `dsv41.parallel.rendezvous.init_tp`, ...) so that TP=1 never pays for it.
"""

from dsv41.parallel.comm import Comm, LocalComm

__all__ = ["Comm", "LocalComm"]
