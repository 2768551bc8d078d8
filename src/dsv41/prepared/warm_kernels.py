"""`dsv41 warm-kernels`: compile a rank's Triton kernels into the service's TRITON_CACHE_DIR before it starts.

The CUDA EXL3 kernels come prebuilt (cubins in the closure), but the Triton kernels (the step and prefill kernels)
compile on their first launch: ~42 s of the first start after an install (docs/WEIGHTS.md, "Measured"). This step
runs that first start ahead of time, so the service's next start is a restart:

- in a child process (the same start the service runs: `dsv41 serve`'s own arguments from the env file,
  `load_fast_model` from the prepared folder, `build_runner` with its KV pool and CUDA graphs, then two short
  requests through the runner, a prefill and a decode step each, as the engine runs them), then the child exits and frees the GPU;
- with the unit's TRITON_CACHE_DIR: `unit_environment(instance)` reads it (and the Triton toolchain variables)
  from the rendered `dsv41@.service` itself, expanding %i/%C/%S as systemd does, so the two cannot drift;
- as the unit's `User=` when run as root (deploy, `sudo dsv41 prepare`), with the unit's UMask: the files are the
  service's own, exactly as its first start would have written them (systemd's CacheDirectory= would also chown a
  cache left to root back to that user at the next start, but a child running as the user also proves the user can
  read the prepared folder);
- with the env file's DSV41_* values in its environment: switches that change a kernel's constexprs (and so
  Triton's cache key) are the service's. Triton's key also holds the GPU's arch and Triton's own version and
  sources: a deploy that changes a kernel or Triton needs the step again (deploy runs it), the same closure does not.

Counts the cache's files before and after and logs the seconds. `prepare_then_warm` (at the end of `dsv41 prepare`)
and deploy treat a failed warm step as a warning: the service then compiles at its first start, as before.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

from dsv41.errors import ConfigError, DSV41Error
from dsv41.parallel.comm import Comm

SERVICE_UNIT = "dsv41@.service"
CACHE_ROOT, STATE_ROOT = "/var/cache", "/var/lib"  # %C and %S of a system unit
TOOLCHAIN = ("CC", "TRITON_LIBCUDA_PATH", "DSV41_CUBIN_DIR")  # the unit's; taken where their paths exist
AS_UNIT = ("HOME", "TORCHINDUCTOR_CACHE_DIR")  # the unit's too when the child runs as its user
# the first requests: 16 and 17 ids on CUDA (Triton specializes an int argument divisible by 16 apart from one that
# is not: a prompt length of either kind); 2 and 3 elsewhere (Triton's interpreter, tests: nothing compiles there,
# and each prompt row costs seconds)
_IDS = [0] + [(i * 37) % 500 + 5 for i in range(16)]
PROMPTS = (_IDS[:16], _IDS[:17])
PROMPTS_OFF_GPU = (_IDS[:2], _IDS[:3])  # 16 ids (Triton specializes ints divisible by 16)
TIMEOUT_S = 1800.0


class WarmFailed(DSV41Error):
    """The warm child failed; the service will compile at its first start instead."""


# ------------------------------------------------------------------------------------------ the unit's values
def _expand(value: str, instance: str) -> str:
    out, i = [], 0
    table = {"i": instance, "C": CACHE_ROOT, "S": STATE_ROOT, "%": "%"}
    while i < len(value):
        if value[i] == "%" and i + 1 < len(value):
            spec = value[i + 1]
            if spec not in table:
                raise ConfigError(f"{SERVICE_UNIT}: specifier %{spec} in {value!r} is not one warm-kernels expands")
            out.append(table[spec])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _service_lines(unit_text: str | None) -> list[tuple[str, str]]:
    if unit_text is None:
        from dsv41.ops.knobs import PROFILE
        from dsv41.ops.units import render_units

        unit_text = render_units(PROFILE)[SERVICE_UNIT]
    lines = []
    for raw in unit_text.splitlines():
        key, sep, value = raw.strip().partition("=")
        if sep and not raw.lstrip().startswith(("#", ";")):
            lines.append((key, value))
    return lines


def unit_environment(instance: str, unit_text: str | None = None) -> dict[str, str]:
    """The `Environment=` values of `dsv41@<instance>.service` (the rendered unit), specifiers expanded."""
    env = {}
    for key, value in _service_lines(unit_text):
        if key == "Environment":
            name, _, val = value.partition("=")
            env[name] = _expand(val, instance)
    return env


def unit_user(unit_text: str | None = None) -> str | None:
    users = [value for key, value in _service_lines(unit_text) if key == "User"]
    return users[-1] if users else None


def triton_cache_dir(instance: str, unit_text: str | None = None) -> Path:
    """The service's TRITON_CACHE_DIR for this rank (e.g. /var/cache/dsv41/rank0/triton)."""
    try:
        return Path(unit_environment(instance, unit_text)["TRITON_CACHE_DIR"])
    except KeyError:
        raise ConfigError(f"{SERVICE_UNIT} sets no TRITON_CACHE_DIR") from None


def count_files(folder: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(folder)) if folder.is_dir() else 0


# ------------------------------------------------------------------------------------------------- the parent
def _as_user(user: str | None, cache: Path) -> dict:
    """Popen arguments that run the child as the unit's user (when we are root and it exists), cache made theirs."""
    if user is None or os.geteuid() != 0:
        cache.mkdir(parents=True, exist_ok=True)
        return {}
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        cache.mkdir(parents=True, exist_ok=True)
        return {}
    made = [p for p in (cache, *cache.parents) if not p.exists()]
    cache.mkdir(parents=True, exist_ok=True)
    for path in [cache, *made]:  # what systemd's CacheDirectory= makes: the instance folder and below, the user's
        os.chown(path, entry.pw_uid, entry.pw_gid)
    extra = []
    try:
        import grp

        extra = [grp.getgrnam("video").gr_gid]  # the unit's SupplementaryGroups= (the GPU's device nodes)
    except KeyError:
        pass
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": extra, "umask": 0o027}


def warm_kernels(serve_args: list[str], *, rank: int, cache_dir: Path, env: Mapping[str, str] | None = None,
                 user: str | None = None, toolchain: Mapping[str, str] | None = None,
                 log: Callable[[str], None] = print, timeout: float = TIMEOUT_S) -> dict:
    """Run the start in a child with TRITON_CACHE_DIR=cache_dir; returns {seconds, compiled, files, phases}.
    Raises WarmFailed (with the child's last lines) when the child fails."""
    cache_dir = Path(cache_dir)
    try:
        spawn = _as_user(user, cache_dir)
    except OSError as exc:
        raise WarmFailed(f"warm-kernels: rank {rank}: cannot make {cache_dir} ({exc.strerror}): run as root, or "
                         f"give --triton-cache-dir") from None
    before = count_files(cache_dir)
    child_env = {**os.environ, **(env or {}), "TRITON_CACHE_DIR": str(cache_dir),
                 "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the Nix wrapper's sys.path (launch's)
    child_env.update({k: v for k, v in (toolchain or {}).items() if k in TOOLCHAIN and Path(v).exists()})
    if spawn:  # as the unit's user: its home and caches too (not root's)
        child_env.update({k: v for k, v in (toolchain or {}).items() if k in AS_UNIT})
    log(f"warm-kernels: rank {rank}: compiling the start's Triton kernels into {cache_dir} ({before} files)")
    start = time.perf_counter()
    argv = [sys.executable, "-m", "dsv41.prepared.warm_kernels", "--rank", str(rank), "--", *serve_args]
    try:
        res = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=timeout, **spawn)
    except subprocess.TimeoutExpired:
        raise WarmFailed(f"warm-kernels: rank {rank}: the start did not finish in {timeout:.0f} s") from None
    seconds = time.perf_counter() - start
    for line in res.stderr.splitlines():
        if line.startswith(("start: ", "warm-kernels child: ")):
            log(f"  {line}")
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-8:])
        raise WarmFailed(f"warm-kernels: rank {rank}: the start failed (rc {res.returncode}) after {seconds:.1f} s:"
                         f"\n{tail}")
    after = count_files(cache_dir)
    phases = json.loads(res.stdout.strip().splitlines()[-1])
    log(f"warm-kernels: rank {rank}: {seconds:.1f} s, {after - before} files added to {cache_dir} ({after} in all)")
    return {"seconds": seconds, "compiled": after - before, "files": after, "phases": phases}


# ------------------------------------------------------------------------------------------------- the child
class PeerlessComm(Comm):
    """One rank of TP > 1 alone (its peer is not there): the collectives' shapes without the peer's values."""

    graph_safe = True  # device work on the current stream only (as the service's NCCL comm)

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def sum_partials(self, x):
        return x * self.world

    def gather_cat(self, x, dim):
        import torch

        return torch.cat([x] * self.world, dim=dim)


def first_request(runner, device) -> int:
    """Requests through the runner as the engine runs them (a prefill row, then a decode row, one sequence after
    the other in slot 0, as a freed slot is reused): the first one's greedy token. (bench/start.py runs it too.)"""
    from dsv41.engine.batch import DECODE, PREFILL, Batch, Row, RowSampling

    greedy = RowSampling(0.0, 1.0, 0, 0.0, 0, 0)
    tokens, step, first_page = [], 0, 0
    for seq, prompt in enumerate(PROMPTS if device.type == "cuda" else PROMPTS_OFF_GPU):
        pages = list(range(first_page, first_page + -(-(len(prompt) + 2) // runner.pool.page_tokens)))
        first_page = pages[-1] + 1
        out = runner.execute(Batch(step, [Row(seq, 0, list(prompt), 0, pages, phase=PREFILL, sample=greedy)]))
        tokens.append(out.rows[0].token)
        runner.execute(Batch(step + 1, [Row(seq, 0, [tokens[-1]], len(prompt), pages, phase=DECODE, sample=greedy)]))
        step += 2
    return tokens[0]


def child(rank: int, serve_args: list[str]) -> None:
    """The service's start (`dsv41 serve` with these arguments) up to its first token, then exit."""
    spawned = time.perf_counter()
    from dsv41.cli import _model_dir, build_parser

    args = build_parser().parse_args(["serve", *serve_args])
    from dsv41.compose.build import build_runner
    from dsv41.prepared.reader import StartPhases
    from dsv41.prepared.start import _log, load_fast_model, prepared_root
    from dsv41.server.cli import model_placement, serving_max_model_len

    if prepared_root(args) is None:
        raise DSV41Error("warm-kernels starts from a prepared folder: DSV41_PREPARED (--prepared) is empty")
    device, dtype = model_placement(args)
    if device.type == "cuda":
        import torch

        torch.cuda.init()
    world = args.tp or 1
    phases = StartPhases(_log)
    phases.add("imports", time.perf_counter() - spawned)
    comm = PeerlessComm(rank, world) if world > 1 else None
    model = load_fast_model(args, _model_dir(args.model), device=device, dtype=dtype, rank=rank, world=world,
                            comm=comm, engram_dir=getattr(args, "engram_dir", None))
    runner = build_runner(args, model, serving_max_model_len(args, model), log=_log)
    phases.done("runner")
    token = first_request(runner, device)
    phases.done("first_token", f"token {token}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({k: round(v, 3) for k, v in phases.seconds.items()}), flush=True)


if __name__ == "__main__":
    _rank = int(sys.argv[sys.argv.index("--rank") + 1])
    child(_rank, sys.argv[sys.argv.index("--") + 1:])
