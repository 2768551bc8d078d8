"""Linear layers of the fast path: every matrix in its stored form on the device, the path chosen by phase.

- `Exl3Linear`: the trellis, suh and svh as the checkpoint stores them (`kernels.exl3.layout.Exl3Tensor`, no
  repack). Decode and verify rows always take the fused row-invariant kernel, whatever their count (CUDA on NVIDIA
  sm_80+, Triton elsewhere and in the CPU interpreter); its launch decisions (backend, split count or Triton config)
  are resolved once when the layer is built (`Exl3Launch`). Prefill rows reconstruct W_eff into the one reused
  `PrefillWorkspace` and run one GEMM (fp16 operands, fp32 accumulation).
- `DequantLinear`: FP8 + 32x32 scales, MXFP4 + 1x32 scales, or native floats (the release's layouts, which have no
  kernels yet): dequantised per call into a temporary of one matrix, then one matmul, exactly the reference's math.

Calls take `x` `[B, in]` with the `n` real rows first (`B` is the decode bucket on the fused path, ENGINE.md §5) and
return `[B, out]`: the kernels compute the real rows only, the padding rows of the result are left unwritten (every
op after them is row-wise, so they never reach a real row). Column- and row-parallel layers are plain slices made
by the reader (`weights.linear.Linear.from_checkpoint`); the caller sums row-parallel partials in rank order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from dsv41.kernels.exl3.backend import interpreting, use_cuda_backend
from dsv41.kernels.exl3.layout import Exl3Tensor
from dsv41.weights import formats

from ..sections import section

PHASES = ("prefill", "decode", "verify")


def is_fused(phase: str) -> bool:
    """True for decode and verify rows (the fused kernels), False for prefill rows (reconstruct + GEMM)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return phase != "prefill"


@dataclass(frozen=True)
class Exl3Launch:
    """How one EXL3 matrix launches on the fused path, fixed at build: never a function of the row count."""

    backend: str  # "cuda" | "triton"
    splits: int | None = None  # CUDA split-K count (kernels.exl3.cuda.linear_splits)
    config: object | None = None  # Triton MatmulConfig

    @classmethod
    def resolve(cls, weight: Exl3Tensor) -> "Exl3Launch":
        if use_cuda_backend(weight.device):
            from dsv41.kernels.exl3.cuda import linear_splits

            return cls("cuda", splits=linear_splits(weight.k, weight.n, weight.K, weight.device))
        from dsv41.kernels.exl3.matmul import MatmulConfig, default_config

        # the interpreter pays per program: one split (any fixed split count keeps rows invariant)
        return cls("triton", config=MatmulConfig(splits=1) if interpreting() else default_config(weight))

    def run(self, x: torch.Tensor, weight: Exl3Tensor, out: torch.Tensor) -> None:
        if self.backend == "cuda":
            from dsv41.kernels.exl3.cuda import fused_matmul_cuda

            fused_matmul_cuda(x, weight, out_dtype=out.dtype, splits=self.splits, out=out)
        else:
            from dsv41.kernels.exl3.matmul import fused_matmul

            fused_matmul(x, weight, out_dtype=out.dtype, config=self.config, out=out)


def _gemm_for(device: torch.device):
    """`(x16 [T, k], w16 [k, n]) -> fp32 [T, n]` with fp16 operands and fp32 accumulation, chosen once per device:
    cuBLAS with an fp32 output where torch offers it, else fp16 output widened; fp32 products of the fp16 values on
    the CPU (exact products, fp32 sums)."""
    if device.type != "cuda":
        return (lambda x16, w16: x16.float() @ w16.float()), "fp32 products of fp16 values (CPU)"
    a = torch.zeros(16, 16, dtype=torch.float16, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return (lambda x16, w16: torch.mm(x16, w16, out_dtype=torch.float32)), "cuBLAS fp16, fp32 output"
    except (RuntimeError, TypeError, NotImplementedError):
        return (lambda x16, w16: torch.mm(x16, w16).float()), "cuBLAS fp16, fp16 output"


class PrefillWorkspace:
    """The one dense buffer of a rank: each prefill matrix is reconstructed into it right before its GEMM, one
    matrix at a time (stream order keeps the uses apart). Sized at build for the largest matrix that can take the
    prefill path; the only dense form of a quantised matrix the fast path ever holds."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.numel = 0
        self.buf: torch.Tensor | None = None
        self.gemm, self.gemm_mode = _gemm_for(self.device)

    def reserve(self, k: int, n: int) -> None:
        if self.buf is not None and k * n > self.buf.numel():
            raise RuntimeError(f"prefill workspace already allocated for {self.buf.numel()} values, needs {k * n}")
        self.numel = max(self.numel, k * n)

    def allocate(self) -> None:
        if self.buf is None:
            self.buf = torch.empty(self.numel, dtype=torch.float16, device=self.device)

    @property
    def nbytes(self) -> int:
        """The bytes it holds: none until a matrix takes the reconstruct path or the dense GEMM path (the GEMM is on
        by default; with it off the tile kernels need no dense copy)."""
        return 0 if self.buf is None else self.buf.numel() * 2

    def matrix(self, k: int, n: int) -> torch.Tensor:
        self.allocate()
        return self.buf[: k * n].view(k, n)

    def matmul(self, x: torch.Tensor, weight: Exl3Tensor) -> torch.Tensor:
        """`x @ W_eff` through the workspace: fp32 `[T, n]`."""
        from dsv41.kernels.exl3.reconstruct import reconstruct

        w = self.matrix(weight.k, weight.n)
        reconstruct(weight, torch.float16, out=w)
        return self.gemm(x.to(torch.float16), w)


class Exl3Linear:
    """One EXL3 linear (or this rank's slice of it): `y = x @ W_eff`, `W_eff` `[in, out]` as stored."""

    def __init__(self, weight: Exl3Tensor, workspace: PrefillWorkspace, name: str = "", fused_only: bool = False):
        self.weight = weight
        self.name = name
        self.in_features, self.out_features = weight.k, weight.n
        self.workspace = workspace
        self.launch = Exl3Launch.resolve(weight)
        self.fused_only = fused_only  # the head: its rows are sampling rows, on the fused kernel in every phase
        if not fused_only:
            workspace.reserve(weight.k, weight.n)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, n: int | None = None, phase: str = "decode",
                 out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` (fused path only): the [B, out_features] tensor to write, any row stride (e.g. the columns of
        a concatenation, which then needs no copy); its rows from n on are left as they are."""
        out_dtype = out_dtype or x.dtype
        with section("head" if self.fused_only else "exl3"):
            if self.fused_only or is_fused(phase):
                n = x.shape[0] if n is None else n
                if out is None:
                    out = torch.empty((x.shape[0], self.out_features), dtype=out_dtype, device=x.device)
                elif out.shape != (x.shape[0], self.out_features) or out.device != x.device:
                    raise ValueError(f"{self.name}: out must be [{x.shape[0]}, {self.out_features}] on {x.device}, "
                                     f"got {list(out.shape)} on {out.device}")
                if n:
                    self.launch.run(x[:n], self.weight, out[:n])
                return out
            if out is not None:
                raise ValueError(f"{self.name}: out= is for the fused path, not {phase!r}")
            if prefill_tiles_enabled():
                from dsv41.kernels.exl3.prefill import prefill_linear

                # the workspace serves the decode-once GEMM path (DSV41_PREFILL_DENSE_GEMM), allocated on first use
                return prefill_linear(x, self.weight, out_dtype=out_dtype, workspace=self.workspace.matrix)
            return self.workspace.matmul(x, self.weight).to(out_dtype)


def prefill_tiles_enabled() -> bool:
    """Prefill EXL3 products on the tile kernels (`kernels/exl3/prefill.py`: each weight tile decoded once per tile of
    rows, on by default); DSV41_PREFILL_TILES=0 takes the reconstruct-into-the-workspace + cuBLAS path instead (A/B
    runs: other bits, and cuBLAS may pick its kernel by the row count, so chunks are not bitwise one-shot there)."""
    return os.environ.get("DSV41_PREFILL_TILES", "1") not in ("0", "")


def prefill_workspace_needed() -> bool:
    """Whether a prefill path that decodes a matrix into the workspace is on at build (the reconstruct path, or the
    dense projections' decode-once GEMM, on unless `DSV41_PREFILL_DENSE_GEMM=0`): then the buffer is allocated with the
    weights, before the pool is sized (a switch flipped later allocates it at its first prefill)."""
    from dsv41.kernels.exl3.prefill_dense import dense_gemm_enabled

    return not prefill_tiles_enabled() or dense_gemm_enabled()


def dense_group_enabled() -> bool:
    """Prefill products of a group's EXL3 members as one rotation + one GEMM launch a run of them
    (`kernels/exl3/prefill_group.py`, DSV41_PREFILL_DENSE_GROUP=1; off by default until a GPU A/B): the same bits as
    each member alone on the dense GEMM path, which it needs (the tile path and DSV41_PREFILL_DENSE_GEMM=0 keep
    the members one by one)."""
    from dsv41.kernels.exl3.prefill_dense import dense_gemm_enabled
    from dsv41.kernels.exl3.prefill_group import group_enabled

    return group_enabled() and prefill_tiles_enabled() and dense_gemm_enabled()


def grouping_enabled() -> bool:
    """Group launches of the matrices that share a point of the step (on by default; DSV41_EXL3_GROUP=0 for A/B
    runs: each matrix then launches alone with its own split count, other bits)."""
    return os.environ.get("DSV41_EXL3_GROUP", "1") not in ("0", "")


class LinearGroup:
    """Linears whose inputs are all ready at one point of a step (a layer's projections of one x, wo_a's groups,
    the shared expert's gate and up), called together: `group(xs, n, phase)` -> the members' outputs.

    Where the CUDA kernels run, decode and verify windows of 1..8 rows take ONE launch per (K, codebook) among
    the members (`kernels.exl3.cuda.linear_group_cuda`): one launch's latency instead of one per matrix. The
    members' split counts are chosen together at build (`group_splits`: the group's blocks fill the GPU once) and
    made each member's own, so a member that runs alone (windows of more than 8 rows) gives the group's bits.
    Elsewhere (Triton, other formats, prefill) each member runs on its own as before."""

    def __init__(self, linears: Sequence):
        self.linears = list(linears)
        self.parts: list[tuple[list[int], list[int]]] = []  # (member indices, their splits) per group launch
        self._batches: list | None = None  # the prefill group launches' (members, DenseGroup), made at first use
        if not grouping_enabled():
            return
        cuda = [i for i, lin in enumerate(self.linears)
                if isinstance(lin, Exl3Linear) and not lin.fused_only and lin.launch.backend == "cuda"]
        if len(cuda) < 2:
            return
        from dsv41.kernels.exl3.cuda import GROUP_MAX, group_splits

        by_kind: dict[tuple, list[int]] = {}
        for i in cuda:
            w = self.linears[i].weight
            by_kind.setdefault((w.K, w.codebook, str(w.device)), []).append(i)
        for (K, _, _), members in by_kind.items():
            for at in range(0, len(members), GROUP_MAX):
                chunk = members[at:at + GROUP_MAX]
                if len(chunk) < 2:
                    continue
                lins = [self.linears[i] for i in chunk]
                splits = group_splits([(lin.in_features, lin.out_features) for lin in lins], K, lins[0].weight.device)
                for lin, sp in zip(lins, splits):
                    lin.launch = Exl3Launch("cuda", splits=sp)
                self.parts.append((chunk, splits))

    def __call__(self, xs: Sequence[torch.Tensor], n: int, phase: str, out_dtypes: Sequence | None = None,
                 outs: Sequence | None = None) -> list[torch.Tensor]:
        """xs: each member's input [B, in] (the n real rows first); out_dtypes: each output's dtype (default: its
        input's); outs: tensors to write (fused path; None entries are allocated). Returns the outputs [B, out]."""
        count = len(self.linears)
        out_dtypes = list(out_dtypes or [x.dtype for x in xs])
        outs = list(outs or [None] * count)
        if not len(xs) == len(out_dtypes) == len(outs) == count:
            raise ValueError(f"a group of {count} linears takes {count} inputs, dtypes and outputs, got {len(xs)}, "
                             f"{len(out_dtypes)}, {len(outs)}")
        grouped: set[int] = set()
        if not is_fused(phase) and all(o is None for o in outs) and dense_group_enabled():
            grouped = self._prefill_batches(xs, out_dtypes, outs)
        if self.parts and is_fused(phase):
            from dsv41.kernels.exl3.cuda import GROUP_ROWS

            if 1 <= n <= GROUP_ROWS:
                self._launch(xs, n, out_dtypes, outs)
                grouped = {i for chunk, _ in self.parts for i in chunk}
        for i, lin in enumerate(self.linears):
            if i not in grouped:
                kw = {"out": outs[i]} if outs[i] is not None else {}
                if out_dtypes[i] != xs[i].dtype:
                    kw["out_dtype"] = out_dtypes[i]
                outs[i] = lin(xs[i], n, phase, **kw)
        return outs

    def dense_batches(self) -> list:
        """The prefill group launches (`kernels.exl3.prefill_group`): runs of consecutive EXL3 members of one k whose
        decoded matrices fit the rank's workspace together (at most MAX_MEMBERS); a member in no run of two or more
        runs alone. Made once, at the first prefill call with the switch on."""
        if self._batches is None:
            from dsv41.kernels.exl3.prefill_group import MAX_MEMBERS, DenseGroup

            runs: list[list[int]] = [[]]
            for i, lin in enumerate(self.linears):
                if not (isinstance(lin, Exl3Linear) and not lin.fused_only and lin.weight.n % 128 == 0):
                    runs.append([])
                    continue
                run = runs[-1]
                first = self.linears[run[0]] if run else lin
                size = sum(self.linears[j].weight.k * self.linears[j].weight.n for j in run + [i])
                if (run and (lin.weight.k != first.weight.k or lin.workspace is not first.workspace
                             or size > lin.workspace.numel or len(run) == MAX_MEMBERS)):
                    runs.append([])
                runs[-1].append(i)
            self._batches = [(run, DenseGroup([self.linears[i].weight for i in run])) for run in runs if len(run) > 1]
        return self._batches

    def _prefill_batches(self, xs, out_dtypes: list, outs: list) -> set[int]:
        """The members the prefill group launches computed (outs filled): one rotation + one GEMM launch a run."""
        done: set[int] = set()
        with section("exl3"):
            for run, group in self.dense_batches():
                dtypes = [out_dtypes[i] for i in run]
                if len(set(dtypes)) > 2:  # a launch writes two output dtypes at most: these run alone
                    continue
                space = self.linears[run[0]].workspace.matrix(1, group.numel)
                for i, y in zip(run, group([xs[i] for i in run], dtypes, space)):
                    outs[i] = y
                done.update(run)
        return done

    def prefill_concat(self, xs: Sequence[torch.Tensor], phase: str) -> torch.Tensor | None:
        """The members' prefill outputs side by side [B, Σ out] (x's dtype) from one group launch (wo_a's u: no
        concatenation launch), or None where that path is off or the members are not one run."""
        if is_fused(phase) or not dense_group_enabled():
            return None
        runs = self.dense_batches()
        if len(runs) != 1 or runs[0][0] != list(range(len(self.linears))):
            return None
        run, group = runs[0]
        with section("exl3"):
            return group(list(xs), [xs[0].dtype] * len(run), self.linears[0].workspace.matrix(1, group.numel),
                         concat=True)

    def _launch(self, xs, n: int, out_dtypes: list, outs: list) -> None:
        """The group launches (outs filled in place: allocated where None)."""
        from dsv41.kernels.exl3.cuda import linear_group_cuda

        with section("exl3"):
            for chunk, splits in self.parts:
                for i in chunk:
                    if outs[i] is None:
                        outs[i] = torch.empty((xs[i].shape[0], self.linears[i].out_features), dtype=out_dtypes[i],
                                              device=xs[i].device)
                linear_group_cuda([xs[i][:n] for i in chunk], [self.linears[i].weight for i in chunk],
                                  [outs[i][:n] for i in chunk], splits)


class DequantLinear:
    """An FP8, MXFP4 or native linear `[out, in]` (torch convention, as stored): dequantised per call."""

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 name: str = ""):
        if fmt not in ("native", "fp8", "mxfp4"):
            raise ValueError(f"{name}: DequantLinear takes native, fp8 or mxfp4 weights, not {fmt!r}")
        self.fmt, self.tensors, self.name = fmt, tensors, name
        self.in_features, self.out_features = in_features, out_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors
        if self.fmt == "native":
            return t["weight"].to(dtype)
        if self.fmt == "fp8":
            return formats.dequant_fp8_block(t["weight"], t["scale"], dtype)
        return formats.dequant_mxfp4(t["weight"], t["scale"], dtype)

    def __call__(self, x: torch.Tensor, n: int | None = None, phase: str = "decode",
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # on the fused path x is the whole decode bucket: one fixed-shape product, so a row's bits stand alone
        fused = is_fused(phase)
        with section("dense"):
            if not fused and x.is_cuda and prefill_tiles_enabled():
                # prefill rows: cuBLAS would pick its kernel (split-K among them) by the chunk's row count, so a row's
                # bits would depend on the chunking (layer 2's index top-k did: weights_proj is native bf16). The
                # tile product's order is fixed; rounded to x's dtype as the matmul rounds its output.
                from dsv41.kernels.step.router_tiles import rows_product_tiles

                y = rows_product_tiles(x, self.dense(x.dtype).T).to(x.dtype)
            elif fused and x.is_cuda:
                y = fixed_rows_product(x, self.dense(x.dtype).T)
            else:
                y = x @ self.dense(x.dtype).T
            return y if out_dtype is None else y.to(out_dtype)


FIXED_ROWS = 32  # the rows of every cuBLAS product of a decode / verify bucket (STEP_ROWS: the largest bucket)


def fixed_rows_product(x: torch.Tensor, mat_t: torch.Tensor) -> torch.Tensor:
    """x [B, d] @ mat_t on CUDA as products of exactly FIXED_ROWS rows (x copied into a zeroed buffer of that many):
    cuBLAS picks its kernel by the shape (a 1-row bucket another reduction order than a 16-row one), so at one shape
    a row's bits never depend on the bucket it runs in; the copy keeps the operand's alignment the same too."""
    outs = []
    for a in range(0, x.shape[0], FIXED_ROWS):
        part = x[a:a + FIXED_ROWS]
        buf = x.new_zeros(FIXED_ROWS, x.shape[1])
        buf[:part.shape[0]] = part
        outs.append((buf @ mat_t)[:part.shape[0]])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def fast_linear(lin, workspace: PrefillWorkspace, device: torch.device | None = None, fused_only: bool = False):
    """The fast layer for a reference `weights.linear.Linear` holding its stored tensors (moved to `device`); the
    Linear itself is dropped (it would cache a dense copy on first use)."""
    t = {k: v if device is None else v.to(device) for k, v in lin.tensors.items()}
    if lin.fmt == "exl3":
        weight = Exl3Tensor.from_group(t["trellis"], t["suh"], t["svh"], lin.codebook, lin.name)
        return Exl3Linear(weight, workspace, lin.name, fused_only=fused_only)
    return DequantLinear(lin.fmt, t, lin.in_features, lin.out_features, lin.name)
