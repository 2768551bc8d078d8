"""Ahead-of-time build of the CUDA kernels: every variant's cubin for given GPU architectures (no GPU, no torch).

    python3 -m dsv41.kernels.cuda_build --arch sm_121 --arch sm_90 --out DIR     (or: python3 cuda_build.py ...)

The Nix build runs this for the appliance's cudaCapabilities and ships DIR in the closure; units point
DSV41_CUBIN_DIR at it, and `dsv41.kernels.cuda_module` loads a cubin from there before its own cache, so a node
compiles nothing at start. File names carry a hash of the source text, the defines and the architecture (not the
compiler), so a prebuilt cubin is found exactly when it was built from the same source for the same variant.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
EXL3_SOURCE = SOURCE_DIR / "exl3_fused.cu"
# The kernels' codebook numbering (EXL3_CB here, the CODEBOOK constant of the Triton kernels through
# kernels/exl3/layout.py), in the order of dsv41.weights.exl3.CODEBOOKS; spelled out because the Nix build runs
# this file with a bare python3 (no torch, no dsv41 on the path).
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
# Compile-time options of the EXL3 kernels (docs/perf/exl3.md): 3 cp.async stages of one 128-deep block each, a
# register budget for 4 blocks per SM, and one for 2 in the linear kernel that launches of at most 2 blocks per SM
# use. DSV41_EXL3_TUNING='{"EXL3_STAGES": 4}' overrides them for benchmarks.
DEFAULT_TUNING = {"EXL3_STAGES": 3, "EXL3_MIN_BLOCKS": 4, "EXL3_FEW_MIN_BLOCKS": 2}


def tuning() -> dict[str, int]:
    import json

    extra = os.environ.get("DSV41_EXL3_TUNING")
    return {**DEFAULT_TUNING, **(json.loads(extra) if extra else {})}


def exl3_defines(K: int, codebook: str, tune: dict | None = None) -> dict[str, int]:
    return {"EXL3_K": K, "EXL3_CB": CODEBOOK_IDS[codebook], **(tune if tune is not None else tuning())}


def exl3_variants(tune: dict | None = None, Ks=range(1, 9), codebooks=tuple(CODEBOOK_IDS)) -> list[dict[str, int]]:
    """Every (K, codebook) variant the engine can ask for, with the default tuning (or DEFAULT_TUNING + `tune`)."""
    t = {**DEFAULT_TUNING, **(tune or {})}
    return [exl3_defines(K, cb, t) for K in Ks for cb in codebooks]


def flags_of(defines: dict[str, int]) -> list[str]:
    return [f"-D{k}={v}" for k, v in sorted(defines.items())]


def image_name(source: Path, defines: dict[str, int], arch: str, suffix: str) -> str:
    key = hashlib.sha256("\0".join([source.read_text(), *flags_of(defines), arch]).encode()).hexdigest()[:24]
    return f"{source.stem}-{arch}-{key}.{suffix}"


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("DSV41_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def nvcc_cubin(nvcc: str, source: Path, defines: dict[str, int], arch: str, out: Path) -> None:
    """Compiles one cubin to `out` (written under a temporary name first, so readers never see half a file)."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", *flags_of(defines), "-o", str(tmp), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    tmp.replace(out)


def arch_defines(defines: dict[str, int], arch: str) -> dict[str, int]:
    """An architecture-specific target (sm_90a) builds the image with its own kernels too: on Hopper the prefill
    tiles on warpgroup MMA (EXL3_WGMMA, kernels/exl3/prefill_wgmma.py), which loads the image under these names."""
    return {**defines, "EXL3_WGMMA": 1} if arch == "sm_90a" else defines


def build_all(archs: list[str], out_dir: Path, jobs: int = os.cpu_count() or 1,
              variants: list[dict[str, int]] | None = None) -> list[Path]:
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc found (set DSV41_NVCC or put nvcc on PATH)")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = [(arch_defines(d, a), a, out_dir / image_name(EXL3_SOURCE, arch_defines(d, a), a, "cubin"))
            for a in archs for d in (variants if variants is not None else exl3_variants())]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(lambda w: nvcc_cubin(nvcc, EXL3_SOURCE, w[0], w[1], w[2]), work))
    return [w[2] for w in work]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", required=True, help="sm_XY (repeatable), e.g. sm_121 for GB10")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tuning", action="append", default=[],
                        help="also build these overrides of the default tuning (JSON, repeatable; for benchmarks)")
    parser.add_argument("--K", type=int, action="append", help="only these K (with --tuning)")
    parser.add_argument("--codebook", action="append", choices=list(CODEBOOK_IDS), help="only these codebooks")
    args = parser.parse_args(argv)
    import json

    Ks = args.K or range(1, 9)
    cbs = args.codebook or list(CODEBOOK_IDS)
    variants = exl3_variants(None, Ks, cbs)
    for extra in args.tuning:
        variants += [v for v in exl3_variants(json.loads(extra), Ks, cbs) if v not in variants]
    built = build_all(args.arch, args.out, args.jobs, variants)
    print(f"built {len(built)} cubins for {', '.join(args.arch)} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
