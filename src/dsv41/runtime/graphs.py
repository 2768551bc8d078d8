"""Piecewise CUDA graphs of the decode and verify step (ENGINE.md §5, issue 16 item 6).

The step's per-sequence attention work (window append, compressor pooling, index top-k, key gathers) is dynamic
Python that cannot be captured yet; everything between those calls is static-shape (the rows sit in a fixed
`BUCKET`), row-wise and free of host syncs. `FastModel` cuts the step at the dynamic calls into *pieces* — pure
functions of their tensor inputs, the weights captured as constants — and runs each through `PieceGraphs.run`:

- Keyed by `(piece name, phase, n real rows, input signature)` (`piece_key`): the kernels launch over the n real
  rows (`x[:n]`), so each n is its own graph; the signature (shape, stride, dtype, device of every tensor input,
  the value of every other leaf) keeps a changed layout from replaying a graph that does not fit it.
- First use of a key: the piece runs once eagerly on a side stream (the warm-up torch recommends: Triton compiles,
  cubins load, the kernels' cached workspaces and counters are allocated outside any graph), then is captured with
  `torch.cuda.graph` into ONE memory pool shared by every piece (`torch.cuda.graph_pool_handle()`), then replayed.
  Static inputs are clones made outside the capture, except a tensor that is itself a static output of a captured
  piece: it is adopted as is (no copy at replay when the caller passes it on, which is how the forward chains
  pieces). Later uses copy the inputs into the static buffers (`copy_`, skipped for an input that *is* its static
  buffer), replay, and return the static outputs (the same tensor objects every time).
- **Lifetime of the outputs**: valid until that piece replays again, and until a piece captured earlier than it
  replays (the pool is shared: memory one piece's capture freed may hold a later piece's outputs). Within one forward
  the pieces replay in the order they were captured (the first forward of a (phase, n) captures them in forward
  order), so each output stays intact for the pieces after it; the caller must copy what it keeps past the forward
  (`FastModel.forward` copies the logits out with its `torch.cat`; the states only keep copies: `append_window` clones,
  the compressor's open group clones, entries are new tensors). A piece never writes its inputs.
- Refused (the piece runs eagerly, the reason logged once per `PieceGraphs`) when `DSV41_GRAPHS=0`, the device is
  not CUDA, the forward is traced (always eager then, captured or not: the trace records happen inside pieces),
  the comm is not graph-safe (`Comm.graph_safe`: gloo's collectives are host calls; NCCL, `LocalComm` and the
  bench's stub are safe), or the capture budget (seconds spent capturing, `DSV41_GRAPHS_BUDGET_S`, default
  60; and a count, `max_captures`) is spent. A capture that raises (a host sync inside the piece) leaves that key
  eager for good, logged. At TP > 1 every rank must decide alike (a first use runs a piece's collectives twice,
  warm-up and replay, where an eager peer runs them once): there only the count budget applies, not the seconds.
  `refusal` is the whole policy, a plain function (tested on the CPU).

The in-place step over the KV pool (`FastModel._pool_step`) is a single piece, "step": it writes the pool, so its
capture warms up on `run(..., warmup=...)`'s inputs (tables that write nothing) and the replay applies it once.

Replay == eager bitwise: a replay launches the kernels the eager run launched, on the same shapes and the same
static buffers; only the padding rows' unwritten memory differs, and no real row reads it (every op is row-wise).
Python-side counters inside a piece (`TorchComm.calls` / `traffic`, sections) do not advance on replay.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .sections import section

log = logging.getLogger(__name__)

ENV_FLAG = "DSV41_GRAPHS"
ENV_BUDGET = "DSV41_GRAPHS_BUDGET_S"
DEFAULT_BUDGET_S = 60.0
DEFAULT_MAX_CAPTURES = 8192  # ~100 pieces per (phase, n) at full shape, 32 (phase, n) groups, with room


def env_enabled(environ=None) -> bool:
    """`DSV41_GRAPHS`: 1 (default) captures where the policy allows, 0 keeps every piece eager."""
    value = (os.environ if environ is None else environ).get(ENV_FLAG, "1").strip().lower()
    return value not in ("0", "off", "false", "no", "")


def env_budget(environ=None) -> float:
    """`DSV41_GRAPHS_BUDGET_S`: seconds of capture one `PieceGraphs` may spend (default 60; the warm-ups, which
    compile kernels the eager path would compile too, are not counted)."""
    value = (os.environ if environ is None else environ).get(ENV_BUDGET, "")
    return float(value) if value.strip() else DEFAULT_BUDGET_S


ENV_BOOT = "DSV41_GRAPHS_BOOT_S"
DEFAULT_BOOT_S = 15.0  # the recipe's boot warm-up budget (RECIPE.md §2.5)


def env_boot_budget(environ=None) -> float:
    """`DSV41_GRAPHS_BOOT_S`: seconds the server may spend capturing decode graphs before it serves (default 15;
    0 captures none at start: each is then captured on first use)."""
    value = (os.environ if environ is None else environ).get(ENV_BOOT, "")
    budget = float(value) if value.strip() else DEFAULT_BOOT_S
    if not budget >= 0:
        raise ValueError(f"{ENV_BOOT} must be a number of seconds >= 0, got {value!r}")
    return budget


def refusal(*, enabled: bool, device_type: str, tracing: bool, comm_safe: bool, spent_s: float,
            budget_s: float, captures: int = 0, max_captures: int = DEFAULT_MAX_CAPTURES) -> str | None:
    """Why a piece may not be captured now (None: capture it). Checked in this order."""
    if not enabled:
        return f"graphs off ({ENV_FLAG}=0)"
    if device_type != "cuda":
        return "not CUDA"
    if tracing:
        return "tracing"
    if not comm_safe:
        return "comm not graph-safe"
    if spent_s >= budget_s:
        return f"capture budget of {budget_s:g} s spent"
    if captures >= max_captures:
        return f"capture budget of {max_captures} graphs spent"
    return None


# ------------------------------------------------------------------------------------------------ pytrees
_LEAF = "T"


def flatten(obj, leaves: list) -> Any:
    """Tensors of `obj` (nested tuples, lists, dicts) appended to `leaves`; returns the structure's spec."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _LEAF
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(flatten(o, leaves) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple(obj), tuple(flatten(v, leaves) for v in obj.values()))
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return ("const", obj)
    raise TypeError(f"a piece's inputs and outputs are tensors, None and scalars in tuples/lists/dicts, "
                    f"not {type(obj).__name__}")


def unflatten(spec, leaves) -> Any:
    """The structure `spec` with its tensors taken in order from the iterator `leaves`."""
    if spec == _LEAF:
        return next(leaves)
    if spec[0] == "const":
        return spec[1]
    if spec[0] is dict:
        return {k: unflatten(s, leaves) for k, s in zip(spec[1], spec[2])}
    return spec[0](unflatten(s, leaves) for s in spec[1])


def signature(args: tuple, leaves: list | None = None) -> tuple:
    """What a graph is specific to besides the piece: the structure, and each tensor's layout and place (the
    tensors are appended to `leaves` when given, so a replay need not walk the inputs again)."""
    leaves = [] if leaves is None else leaves
    spec = flatten(args, leaves)
    return spec, tuple((tuple(t.shape), t.stride(), t.dtype, str(t.device)) for t in leaves)


def piece_key(name: str, phase: str, n: int, args: tuple, leaves: list | None = None) -> tuple:
    return (name, phase, int(n), signature(args, leaves))


def _kernel_buffers() -> list:
    """Buffers that kernels keep in module caches and may later *replace* (not just add to), which a captured graph
    still points at: kept alive with the graph so their memory is never handed to another tensor. Today: the mHC
    site kernels' per-row arrival counters, regrown for a larger row count (a long prefill chunk) by allocating a
    new tensor (`kernels.step.mhc._Counters`, the attention core's and the router's too). The EXL3 and MoE
    workspaces only grow."""
    from dsv41.kernels.step import mhc as step_mhc

    counters = getattr(step_mhc, "_COUNTERS", None)
    return list(getattr(counters, "_by_device", {}).values())


# ------------------------------------------------------------------------------------------------ graphs
@dataclass
class Piece:
    graph: Any  # torch.cuda.CUDAGraph
    statics: list  # the static input tensors, in flatten order
    adopted: list  # per static: True when it is another piece's static output (never written here)
    out_spec: Any
    outs: list  # the static output tensors
    keep: list = field(default_factory=list)  # kernel buffers the graph holds by pointer (`_kernel_buffers`)

    def outputs(self):
        return unflatten(self.out_spec, iter(self.outs))


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0
    failed: int = 0
    capture_s: float = 0.0
    refused: dict = field(default_factory=dict)  # reason -> eager calls

    def as_dict(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager, "failed": self.failed,
                "capture_s": round(self.capture_s, 3), "refused": dict(self.refused)}


class PieceGraphs:
    """The captured pieces of one model: `run(name, phase, n, fn, *args)` returns `fn(*args)`, from a replay
    where it can (module docstring)."""

    def __init__(self, device, comm=None, *, enabled: bool | None = None, budget_s: float | None = None,
                 max_captures: int = DEFAULT_MAX_CAPTURES):
        self.device = torch.device(device)
        self.comm = comm
        self.enabled = env_enabled() if enabled is None else bool(enabled)
        self.budget_s = env_budget() if budget_s is None else float(budget_s)
        if getattr(comm, "world", 1) > 1:  # ranks must agree: seconds differ between them, counts do not
            self.budget_s = float("inf")
        self.max_captures = int(max_captures)
        self.stats = GraphStats()
        self._pieces: dict[tuple, Piece] = {}
        self._failed: set = set()
        self._owned: dict[int, torch.Tensor] = {}  # id -> a captured piece's static output (kept alive here)
        self._logged: set = set()
        self._pool = None
        self._stream = None

    @property
    def comm_safe(self) -> bool:
        return self.comm is None or bool(getattr(self.comm, "graph_safe", False))

    @property
    def active(self) -> bool:
        """Whether any piece can be captured or replayed at all (ignoring tracing and the budget)."""
        return self.enabled and self.device.type == "cuda" and self.comm_safe

    def decide(self, key: tuple, tracing: bool = False) -> str:
        """'replay', 'capture', or the reason the call runs eagerly (a captured piece replays once the budget is
        spent; a traced forward runs every piece eagerly)."""
        policy = dict(enabled=self.enabled, device_type=self.device.type, tracing=tracing, comm_safe=self.comm_safe)
        why = refusal(**policy, spent_s=0.0, budget_s=float("inf"), captures=0)
        if why is not None:
            return why
        if key in self._pieces:
            return "replay"
        if key in self._failed:
            return "capture failed"
        return refusal(**policy, spent_s=self.stats.capture_s, budget_s=self.budget_s,
                       captures=self.stats.captures + self.stats.failed, max_captures=self.max_captures) or "capture"

    def run(self, name: str, phase: str, n: int, fn: Callable, *args, tracing: bool = False, warmup=None):
        """`warmup`: a function returning the inputs of the capture's warm-up run, when they must differ from
        `args` (a piece with side effects: the whole pool step warms up on tables that write nothing, so the step
        is applied once, by the replay); same structure and shapes as `args`."""
        leaves: list = []
        key = piece_key(name, phase, n, args, leaves)
        what = self.decide(key, tracing)
        if what == "replay":
            return self._replay(self._pieces[key], fn, args, leaves)
        if what == "capture":
            return self._capture(key, fn, args, warmup)
        self._eager(what)
        return fn(*args)

    def clear(self) -> None:
        """Drop every graph (their pool memory goes back when nothing else holds it)."""
        self._pieces.clear()
        self._owned.clear()
        self._failed.clear()

    # ------------------------------------------------------------------ internals
    def _eager(self, reason: str) -> None:
        self.stats.eager += 1
        self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
        self._log_once(reason, f"CUDA graphs: pieces run eagerly ({reason})")

    def _log_once(self, tag: str, message: str) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            log.info(message)

    def _replay(self, piece: Piece, fn: Callable, args: tuple, leaves: list | None = None):
        if leaves is None:
            leaves = []
            flatten(args, leaves)
        for static, adopted, t in zip(piece.statics, piece.adopted, leaves):
            if t is static:
                continue
            if adopted:  # it would overwrite another piece's output: stay exact, run this call eagerly
                self._eager("adopted input not passed on")
                return fn(*args)
        for static, t in zip(piece.statics, leaves):
            if t is not static:
                static.copy_(t)
        with section("graph"):
            piece.graph.replay()
        self.stats.replays += 1
        return piece.outputs()

    def _capture(self, key: tuple, fn: Callable, args: tuple, warmup=None):
        try:
            piece = self._make(fn, args, warmup)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the piece eager, exactly as before
            self._failed.add(key)
            self.stats.failed += 1
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self._log_once(("failed", type(exc).__name__, first),  # once per distinct error
                           f"CUDA graphs: capture of {key[0]} ({key[1]}, n={key[2]}) failed, it runs eagerly "
                           f"(and so does any other piece failing alike): {type(exc).__name__}: {first}")
            self._eager("capture failed")
            return fn(*args)
        self._pieces[key] = piece
        self.stats.captures += 1
        for t in piece.outs:
            self._owned[id(t)] = t
        with section("graph"):
            piece.graph.replay()
        self.stats.replays += 1
        return piece.outputs()

    def _make(self, fn: Callable, args: tuple, warmup=None) -> Piece:
        leaves: list = []
        in_spec = flatten(args, leaves)
        adopted = [self._owned.get(id(t)) is t for t in leaves]
        statics = [t if a else t.clone() for t, a in zip(leaves, adopted)]
        static_args = unflatten(in_spec, iter(statics))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # the warm-up: lazy compiles and workspaces happen outside the graph
            fn(*(static_args if warmup is None else warmup()))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()  # the budget counts captures, not the warm-up's one-off compiles
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                out = fn(*static_args)
        finally:
            self.stats.capture_s += time.perf_counter() - t0
        outs: list = []
        out_spec = flatten(out, outs)
        return Piece(graph, statics, adopted, out_spec, outs, keep=_kernel_buffers())
