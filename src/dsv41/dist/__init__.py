"""Tensor parallelism: communicators and launch. `LocalComm` is the TP=1 default."""

from .comm import Comm, LocalComm

__all__ = ["Comm", "LocalComm"]
