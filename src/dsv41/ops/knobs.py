"""The one config file (`/etc/dsv41/dsv41.env`): every knob, its meaning, and how it becomes `dsv41 serve` argv.

systemd reads the file through `EnvironmentFile=`, so the service process sees the knobs as environment variables;
`dsv41 launch rankN` turns them into the exact `dsv41 serve` command line (one knob = one flag, no hidden
defaults: an empty or unset knob passes no flag, and serve's own default applies). Ops knobs are read only by the
ops commands (watchdog, preflight, warm, deploy); serve ignores them. Preflight and warm read some serve knobs too
(DSV41_MODEL, DSV41_ENGRAM_DIR, DSV41_PORT, ...).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dsv41.errors import ConfigError

DEFAULT_ENV_FILE = Path("/etc/dsv41/dsv41.env")
PROFILE = "/nix/var/nix/profiles/dsv41"


@dataclass(frozen=True)
class ServeKnob:
    """An env var that becomes one `dsv41 serve` flag (`many`: a space-separated list, the flag repeated)."""

    env: str
    flag: str
    doc: str
    many: bool = False


@dataclass(frozen=True)
class EnvKnob:
    """An env var `dsv41 serve` reads from its own environment, never as a flag (a secret must not show in
    the process list)."""

    env: str
    doc: str


@dataclass(frozen=True)
class OpsKnob:
    """An env var read only by the ops commands; `default` applies when it is unset or empty."""

    env: str
    default: str
    doc: str


SERVE_KNOBS: tuple[ServeKnob, ...] = (
    ServeKnob("DSV41_MODEL", "--model", "model folder (config.json, tokenizer, safetensors); byte-identical on both nodes"),
    ServeKnob("DSV41_ENGRAM_DIR", "--engram-dir", "this node's packed Engram shards engram-l{L}-r{R}of{W}.bin (also "
              "checked by preflight and warm)"),
    ServeKnob("DSV41_PREPARED", "--prepared", "root of this node's prepared folders rank{R}-of-{TP} (`dsv41 prepare`); "
              "empty = build from the checkpoint at every start"),
    ServeKnob("DSV41_HOST", "--host", "HTTP bind address of rank 0 (keep loopback and put a proxy in front)"),
    ServeKnob("DSV41_PORT", "--port", "HTTP port of rank 0"),
    ServeKnob("DSV41_ALLOWED_HOSTS", "--allowed-hosts", "Host header names served besides loopback ones "
              "(space-separated; '*' = any)", many=True),
    ServeKnob("DSV41_ALLOWED_ORIGINS", "--allowed-origins", "CORS: browser origins allowed to call the API "
              "(space-separated; '*' = any; empty = no CORS)", many=True),
    ServeKnob("DSV41_SERVED_NAME", "--served-name", "model id reported by /v1/models"),
    ServeKnob("DSV41_ALIASES", "--alias", "extra model ids accepted and listed (space-separated)", many=True),
    ServeKnob("DSV41_API_KEY_FILE", "--api-key-file", "file holding the bearer key; empty = no auth"),
    ServeKnob("DSV41_MAX_MODEL_LEN", "--max-model-len", "prompt + completion limit in tokens"),
    ServeKnob("DSV41_MAX_BODY_BYTES", "--max-body-bytes", "request body limit in bytes"),
    ServeKnob("DSV41_DRAIN_TIMEOUT_S", "--drain-timeout", "seconds in-flight requests get after SIGTERM"),
    ServeKnob("DSV41_REQUEST_LOG", "--request-log", "JSONL request log file"),
    ServeKnob("DSV41_MAX_WAITING", "--max-waiting", "queued requests before new ones get 429"),
    ServeKnob("DSV41_CPU_THREADS", "--cpu-threads", "torch CPU threads"),
    ServeKnob("DSV41_DEVICE", "--device", "torch device: auto, cpu, cuda"),
    ServeKnob("DSV41_DTYPE", "--dtype", "compute dtype: auto (bf16 on CUDA), float32, bfloat16"),
    ServeKnob("DSV41_BODY_TIMEOUT_S", "--body-timeout", "seconds a client has to send its whole body, else 408"),
    ServeKnob("DSV41_PROMPT_SPECIAL_TOKENS", "--prompt-special-tokens", "/v1/completions text prompts: parse "
              "control-token spellings (as vLLM) or keep them text"),
    ServeKnob("DSV41_ENGINE", "--engine", "batched (one paged KV pool, continuous batching) or reference"),
    ServeKnob("DSV41_PARALLEL", "--parallel", "request slots"),
    ServeKnob("DSV41_POOL_TOKENS", "--pool-tokens", "KV pool positions shared by all slots"),
    ServeKnob("DSV41_PAGE_TOKENS", "--page-tokens", "positions per pool page"),
    ServeKnob("DSV41_PREFILL_CHUNK", "--prefill-chunk", "most prompt rows prefilled in one step"),
    ServeKnob("DSV41_PREFILL_SHARE", "--prefill-share", "most share of the engine's time prefill takes while "
              "others decode"),
    ServeKnob("DSV41_PREFILL", "--prefill", "full (exact) or replay (CED bounded replay: approximate, tagged)"),
    ServeKnob("DSV41_MEM_FLOOR_GIB", "--mem-floor-gib", "admit nothing new while free memory is below this"),
    ServeKnob("DSV41_ADMIT_TIMEOUT_S", "--admit-timeout", "a request that cannot be admitted alone fails after this"),
    ServeKnob("DSV41_EXPERT_TOPP", "--expert-topp", "routed-expert pruning mass (approximate, tagged; empty = off)"),
    ServeKnob("DSV41_EXPERT_MIN_K", "--expert-min-k", "with expert pruning: never fewer experts than this"),
    ServeKnob("DSV41_FORWARD", "--forward", "batched engine's forward: fast (runtime/ kernels; default on CUDA) or "
              "reference (model/ math; default on the CPU)"),
    ServeKnob("DSV41_TP", "--tp", "tensor-parallel world size (2 = the two Sparks)"),
    ServeKnob("DSV41_MASTER", "--master", "HEAD_LINK_IP:PORT of rank 0's rendezvous on the direct link"),
    ServeKnob("DSV41_TP_BACKEND", "--tp-backend", "collective backend: nccl or gloo"),
    ServeKnob("DSV41_TP_DEADLINE_S", "--tp-deadline", "seconds to wait for all ranks to join and load"),
    ServeKnob("DSV41_TP_PEER_TIMEOUT_S", "--tp-peer-timeout", "a peer silent this long is lost (fail-fast, exit 70)"),
    ServeKnob("DSV41_TP_COLLECTIVE_TIMEOUT_S", "--tp-collective-timeout", "upper bound on any single collective"),
)

ENV_KNOBS: tuple[EnvKnob, ...] = (
    EnvKnob("DSV41_PREPARED_VERIFY", "what a start re-hashes of its prepared folder: sample (default), full, off"),
    EnvKnob("DSV41_PREPARED_PAGE_CACHE", "a start's read of its prepared folder: drop each piece from the page cache "
            "(default on unified memory, GB10) or keep it"),
    EnvKnob("DSV41_TP_SECRET", "shared secret of the tensor-parallel ranks (same on every host; required when "
            "--master is not loopback)"),
)

OPS_KNOBS: tuple[OpsKnob, ...] = (
    OpsKnob("DSV41_WORKER_SSH", "", "ssh destination of the worker (rank 1) as seen from the head, e.g. root@10.0.0.2"),
    OpsKnob("DSV41_LOCAL_RANKS", "", "ranks this node runs (rank0 on the head, rank1 on the worker); written by deploy"),
    OpsKnob("DSV41_RDMA_PORTS", "", "RoCE devices/ports that must be ACTIVE, e.g. rocep1s0f1:1 roceP2p1s0f1:1"),
    OpsKnob("DSV41_MEM_GATE_GIB", "0", "MemFree (GiB) required on a node before a load; 0 = gate off"),
    OpsKnob("DSV41_READY_TIMEOUT_S", "900", "how long deploy waits for /health ok and the canary"),
    OpsKnob("DSV41_WARM_PREPARED", "auto", "warm unit: read the prepared folder into the page cache (auto: only when "
            "MemAvailable holds twice the folder; 1 always; 0 never)"),
    OpsKnob("DSV41_WATCH_FAILS", "3", "bad watchdog ticks in a row before healing"),
    OpsKnob("DSV41_WATCH_MIN_HEAL_S", "1800", "at most one ordinary heal per this many seconds"),
    OpsKnob("DSV41_WATCH_FF_MIN_HEAL_S", "120", "at most one fail-fast (exit 70) heal per this many seconds"),
    OpsKnob("DSV41_WATCH_GRACE_S", "1800", "a rank started less than this ago is loading, not bad"),
    OpsKnob("DSV41_WATCH_HEAL", "1", "1 = the watchdog restarts the pair; 0 = it only logs"),
)

# Passed to the server untouched (read by NCCL, glibc, Triton); documented in the example file, never flags.
PASSTHROUGH_PREFIXES = ("NCCL_", "MALLOC_", "TRITON_", "TORCH_", "CUDA_", "PYTORCH_")

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env_file(path: Path) -> dict[str, str]:
    """Read a systemd EnvironmentFile subset: `KEY=VALUE` lines, `#`/`;` comments, optional quotes."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the env file ({exc.strerror})") from exc
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            raise ConfigError(f"{path}:{lineno}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def rank_of_instance(instance: str) -> int:
    """`rank0` (the systemd instance name) -> 0."""
    match = re.fullmatch(r"rank(\d+)", instance)
    if not match:
        raise ConfigError(f"instance {instance!r}: expected rankN (dsv41@rank0, dsv41@rank1)")
    return int(match.group(1))


def serve_argv(env: Mapping[str, str], rank: int) -> list[str]:
    """The `dsv41 serve` arguments for this rank: one flag per non-empty serve knob, then `--rank`."""
    argv: list[str] = []
    for knob in SERVE_KNOBS:
        value = env.get(knob.env, "").strip()
        if not value:
            continue
        if knob.many:
            for item in shlex.split(value):
                argv += [knob.flag, item]
        else:
            argv += [knob.flag, value]
    argv += ["--rank", str(rank)]
    return argv


def ops_value(env: Mapping[str, str], name: str) -> str:
    for knob in OPS_KNOBS:
        if knob.env == name:
            value = env.get(name, "").strip()
            return value if value else knob.default
    raise KeyError(name)


def ops_number(env: Mapping[str, str], name: str) -> float:
    value = ops_value(env, name)
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a number") from None


def unknown_keys(env: Mapping[str, str]) -> list[str]:
    """Keys in an env file that no knob or passthrough prefix claims (typos such as DSV41_PROT)."""
    known = {k.env for k in SERVE_KNOBS} | {k.env for k in OPS_KNOBS} | {k.env for k in ENV_KNOBS}
    return sorted(k for k in env if k not in known and not k.startswith(PASSTHROUGH_PREFIXES))
