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
    """An env var that becomes one `dsv41 serve` flag (`many`: a space-separated list, the flag repeated).

    `doc` is the one line OPERATIONS.md's table shows; the example file adds `more` and sets `example`."""

    env: str
    flag: str
    doc: str
    many: bool = False
    example: str = ""
    more: str = ""
    switch: bool = False  # a flag without a value: passed when the knob is 1/yes/true/on


@dataclass(frozen=True)
class EnvKnob:
    """An env var `dsv41 serve` reads from its own environment, never as a flag (a secret must not show in the
    process list; a runtime budget that has no flag)."""

    env: str
    doc: str
    example: str = ""
    more: str = ""
    flag: str = ""  # the serve flag whose default it is, if any


@dataclass(frozen=True)
class OpsKnob:
    """An env var read only by the ops commands; `default` applies when it is unset or empty."""

    env: str
    default: str
    doc: str
    example: str | None = None  # None: the default
    more: str = ""


@dataclass(frozen=True)
class PassthroughExample:
    """A variable of a passthrough prefix the example file sets (commented out when `commented`)."""

    env: str
    example: str
    doc: str
    commented: bool = False


SERVE_KNOBS: tuple[ServeKnob, ...] = (
    ServeKnob("DSV41_MODEL", "--model", "model folder (config.json, tokenizer, safetensors); byte-identical on both "
              "nodes", example="/srv/dsv41/model",
              more="`dsv41 preflight` compares config/tokenizer hashes over ssh. Empty = the built-in tiny model."),
    ServeKnob("DSV41_ENGRAM_DIR", "--engram-dir", "this node's packed Engram shards engram-l{L}-r{R}of{W}.bin (also "
              "checked by preflight and warm)", example="/srv/dsv41/engram",
              more="Same path on both nodes (r0of2 files on the head, r1of2 on the worker). Empty = the tables "
                   "inside the model folder; preflight and warm then skip their shard checks, as serve needs none."),
    ServeKnob("DSV41_PREPARED", "--prepared", "root of this node's prepared folders rank{R}-of-{TP} (`dsv41 prepare`); "
              "empty = build from the checkpoint at every start",
              more="Written by `dsv41 prepare --env-file /etc/dsv41/dsv41.env --rank R` (or `deploy --prepare`): the "
                   "rank then starts by reading one file instead of building from the checkpoint; a folder that does "
                   "not fit (other checkpoint, rank, code) is refused with its reason. E.g. /srv/dsv41/prepared."),
    ServeKnob("DSV41_PREPARED_FALLBACK", "--prepared-fallback", "1 = when the prepared folder does not fit, build "
              "from the checkpoint instead of refusing to start", switch=True, more="Empty = refuse."),
    ServeKnob("DSV41_HOST", "--host", "HTTP bind address of rank 0 (keep loopback and put a proxy in front)",
              example="127.0.0.1", more="Put a TLS proxy in front for other machines."),
    ServeKnob("DSV41_PORT", "--port", "HTTP port of rank 0", example="8000",
              more="The watchdog, canary and the deploy health gate use it too."),
    ServeKnob("DSV41_ALLOWED_HOSTS", "--allowed-hosts", "Host header names served besides loopback ones "
              "(space-separated; '*' = any)", many=True,
              more="On a loopback bind any other Host gets 421 (DNS rebinding from a browser). Set the name your "
                   "proxy forwards if it keeps the client's Host. Empty = loopback names only."),
    ServeKnob("DSV41_ALLOWED_ORIGINS", "--allowed-origins", "CORS: browser origins allowed to call the API "
              "(space-separated; '*' = any; empty = no CORS)", many=True,
              more="Origins are scheme://host[:port]. Empty = no CORS headers: browsers refuse cross-origin calls. "
                   "Allowing an origin also lets its pages send the bearer key they hold; the Host allow-list "
                   "still applies."),
    ServeKnob("DSV41_SERVED_NAME", "--served-name", "model id reported by /v1/models", example="DeepSeek-V4.1-Flash"),
    ServeKnob("DSV41_ALIASES", "--alias", "extra model ids accepted and listed (space-separated)", many=True,
              example='"deepseek-v4.1-flash"', more="Each becomes one --alias flag."),
    ServeKnob("DSV41_API_KEY_FILE", "--api-key-file", "file holding the bearer key; empty = no auth",
              more="Keep it mode 0600, readable by the service user dsv41."),
    ServeKnob("DSV41_MAX_MODEL_LEN", "--max-model-len", "prompt + completion limit in tokens",
              more="Empty = min(model, server default)."),
    ServeKnob("DSV41_MAX_BODY_BYTES", "--max-body-bytes", "request body limit in bytes", more="Empty = 8 MiB."),
    ServeKnob("DSV41_DRAIN_TIMEOUT_S", "--drain-timeout", "seconds in-flight requests get after SIGTERM",
              example="20", more="Keep it well below the unit's TimeoutStopSec (120 s). Empty = 20."),
    ServeKnob("DSV41_REQUEST_LOG", "--request-log", "JSONL request log file", example="/var/lib/dsv41/requests.jsonl",
              more="Must lie under /var/lib/dsv41 (the only place the sandboxed unit writes). Empty = off."),
    ServeKnob("DSV41_MAX_WAITING", "--max-waiting", "queued requests before new ones get 429", more="Empty = 64."),
    ServeKnob("DSV41_CPU_THREADS", "--cpu-threads", "torch CPU threads", more="Empty = torch's choice."),
    ServeKnob("DSV41_DEVICE", "--device", "torch device: auto, cpu, cuda",
              more="auto = cuda when available. Empty = auto."),
    ServeKnob("DSV41_DTYPE", "--dtype", "compute dtype: auto (bf16 on CUDA), float32, bfloat16",
              more="auto = bfloat16 on CUDA, float32 on the CPU. Empty = auto."),
    ServeKnob("DSV41_BODY_TIMEOUT_S", "--body-timeout", "seconds a client has to send its whole body, else 408",
              more="Empty = 30."),
    ServeKnob("DSV41_PROMPT_SPECIAL_TOKENS", "--prompt-special-tokens", "/v1/completions text prompts: parse "
              "control-token spellings (as vLLM) or keep them text",
              more="Chat message content is always text. Empty = parse."),
    ServeKnob("DSV41_ENGINE", "--engine", "batched (one paged KV pool, continuous batching) or reference",
              more="reference = one request at a time over the reference model, TP=1 only. Empty = batched."),
    ServeKnob("DSV41_PARALLEL", "--parallel", "request slots", more="Empty = 4."),
    ServeKnob("DSV41_POOL_TOKENS", "--pool-tokens", "KV pool positions shared by all slots",
              more="Empty = parallel x context, capped by free memory above the floor."),
    ServeKnob("DSV41_PAGE_TOKENS", "--page-tokens", "positions per pool page", more="Empty = 256."),
    ServeKnob("DSV41_PREFILL_CHUNK", "--prefill-chunk", "most prompt rows prefilled in one step", more="Empty = 2048."),
    ServeKnob("DSV41_PREFILL_CHUNK_ALONE", "--prefill-chunk-alone", "most prompt rows of a step in which no stream "
              "decodes", more="Never fewer than the prefill chunk; 0 = the prefill chunk. Empty = 8192."),
    ServeKnob("DSV41_PREFILL_SHARE", "--prefill-share", "most share of the engine's time prefill takes while "
              "others decode", more="A fraction in (0, 1]. Empty = 0.5."),
    ServeKnob("DSV41_PREFILL", "--prefill", "full (exact) or replay (CED bounded replay: approximate, tagged)",
              more="Empty = full."),
    ServeKnob("DSV41_MEM_FLOOR_GIB", "--mem-floor-gib", "admit nothing new while free memory is below this",
              more="MemAvailable on unified memory. Empty = 0."),
    ServeKnob("DSV41_ADMIT_TIMEOUT_S", "--admit-timeout", "a request that cannot be admitted alone fails after this",
              more="Empty = 30."),
    ServeKnob("DSV41_SESSIONS", "--sessions", "session entries: a prompt resumes from an earlier prompt's or "
              "reply's state (exact): on or off", more="Empty = on."),
    ServeKnob("DSV41_SESSION_RAM_MIB", "--session-ram-mib", "RAM budget of the session entries' slot snapshots",
              more="Their pool pages yield to live requests. Empty = 256."),
    ServeKnob("DSV41_SESSION_MIN_TOKENS", "--session-min-tokens", "shortest state kept as a session entry",
              more="Empty = 16."),
    ServeKnob("DSV41_SESSION_DIR", "--session-dir", "the NVMe tier of sessions: entries leaving RAM are parked here",
              example="/var/lib/dsv41/sessions", more="One folder per rank; a restarted server resumes them. Must "
              "lie under /var/lib/dsv41 (the only place the sandboxed unit writes). Empty = no NVMe tier."),
    ServeKnob("DSV41_SESSION_DISK_GIB", "--session-disk-gib", "byte budget of the session directory",
              more="Least recently used files go first. Empty = 64."),
    ServeKnob("DSV41_SESSION_DISK_MIN_TOKENS", "--session-disk-min-tokens", "shortest entry parked on the NVMe "
              "tier", more="Shorter ones are dropped when they leave RAM. Empty = 1024."),
    ServeKnob("DSV41_SESSION_PARK_S", "--session-park-s", "seconds a graceful stop parks session entries, newest "
              "first", more="Keep DSV41_DRAIN_TIMEOUT_S plus this under the unit's TimeoutStopSec (120 s). Empty = 30."),
    ServeKnob("DSV41_EXPERT_TOPP", "--expert-topp", "routed-expert pruning mass (approximate, tagged; empty = off)",
              more="Keeps the experts holding this much routing mass."),
    ServeKnob("DSV41_EXPERT_MIN_K", "--expert-min-k", "with expert pruning: never fewer experts than this",
              more="Empty = 3."),
    ServeKnob("DSV41_FORWARD", "--forward", "batched engine's forward: fast (runtime/ kernels; default on CUDA) or "
              "reference (model/ math; default on the CPU)"),
    ServeKnob("DSV41_DRAFT_DEPTH", "--draft-depth", "speculative drafting: most drafts a round, 0..5 (0 = off)",
              more="Empty = 5."),
    ServeKnob("DSV41_DRAFT_DSPARK", "--draft-dspark", "DSpark drafts when the checkpoint has the draft blocks: auto, "
              "on, off", more="Empty = auto (on a GPU)."),
    ServeKnob("DSV41_DRAFT_LOOKUP", "--draft-lookup", "prompt-lookup drafts: on or off", more="Empty = off."),
    ServeKnob("DSV41_DRAFT_COST", "--draft-cost", "the step cost per row count that sets the draft depth "
              "(ROWS:S,...)", more="Empty = measured."),
    ServeKnob("DSV41_TP", "--tp", "tensor-parallel world size (2 = the two Sparks)", example="2",
              more="1 = one node: status, preflight and the watchdog then look at rank 0 only."),
    ServeKnob("DSV41_MASTER", "--master", "HEAD_LINK_IP:PORT of rank 0's rendezvous on the direct link",
              example="10.0.0.1:29571",
              more="Rank 1 retries until rank 0 is up (within --tp-deadline), so the start order of the two units "
                   "does not decide correctness."),
    ServeKnob("DSV41_TP_BACKEND", "--tp-backend", "collective backend: nccl or gloo", example="nccl",
              more="nccl = GPUs, over RoCE between the Sparks; gloo = CPU. Empty = nccl when CUDA is present."),
    ServeKnob("DSV41_TP_DEADLINE_S", "--tp-deadline", "seconds to wait for all ranks to join and load", example="900",
              more="Empty = 300."),
    ServeKnob("DSV41_TP_PEER_TIMEOUT_S", "--tp-peer-timeout", "a peer silent this long is lost (fail-fast, exit 70)",
              more="Empty = 3."),
    ServeKnob("DSV41_TP_COLLECTIVE_TIMEOUT_S", "--tp-collective-timeout", "upper bound on any single collective",
              more="Empty = 300."),
)

ENV_KNOBS: tuple[EnvKnob, ...] = (
    EnvKnob("DSV41_PREPARED_VERIFY", "what a start re-hashes of its prepared folder: sample (default), full, off",
            flag="--prepared-verify"),
    EnvKnob("DSV41_DRAFT", "0 = requests that do not say `draft` are not drafted (the default of --draft-default)",
            flag="--draft-default", more="Empty = drafted."),
    EnvKnob("DSV41_PREPARED_PAGE_CACHE", "a start's read of its prepared folder: drop each piece from the page cache "
            "(default on unified memory, GB10) or keep it"),
    EnvKnob("DSV41_TP_SECRET", "shared secret of the tensor-parallel ranks (same on every host; required when "
            "--master is not loopback)",
            more="Read from the environment, never passed as a flag. Rank 0 refuses a rank with another one. "
                 "Generate with `openssl rand -hex 32`; deploy installs this file mode 0600 for the service user."),
    EnvKnob("DSV41_GRAPHS_BOOT_S", "seconds the server may spend capturing decode CUDA graphs before READY",
            more="0 captures none at start (each on first use). Empty = 15."),
    EnvKnob("DSV41_GRAPHS_BUDGET_S", "seconds of CUDA graph capture one set of step pieces may spend",
            more="Empty = 60."),
    EnvKnob("DSV41_GRAPHS", "1 = capture the decode step's CUDA graphs where allowed; 0 = every piece eager",
            more="For diagnosis. Empty = 1."),
    EnvKnob("DSV41_OVERLAP", "0 = every engine step serial; 1 = step k+1 planned and launched while step k runs "
            "(the default of --overlap)", flag="--overlap",
            more="TP = 1 decode steps; prefill chunks, drafts and grammars run serial either way. Empty = 1."),
    EnvKnob("DSV41_ENGRAM_GATE", "1 = a decode step's graph starts before its Engram rows are read and waits for "
            "them on the GPU before the first Engram layer; 0 = the host reads them before the launch",
            more="CUDA (docs/ENGINE.md §6). Empty = 1 at TP = 1; at TP > 1 only with 1 (not yet run on a GPU there)."),
    EnvKnob("DSV41_ENGRAM_WAIT_S", "seconds the GPU waits at the Engram gate for a step's rows before it gives up "
            "and the step's requests fail", more="Empty = 300."),
)

OPS_KNOBS: tuple[OpsKnob, ...] = (
    OpsKnob("DSV41_WORKER_SSH", "", "ssh destination of the worker (rank 1) as seen from the head; written by deploy",
            more="deploy writes dsv41@WORKER into the head's node.env (the service user, key-based, BatchMode). "
                 "Used by watchdog, preflight, status. Leave it empty here.", example=""),
    OpsKnob("DSV41_LOCAL_RANKS", "", "ranks this node runs (rank0 on the head, rank1 on the worker); written by deploy",
            more="deploy writes it into /etc/dsv41/node.env; dsv41-boot.service starts exactly these. Leave it "
                 "empty here."),
    OpsKnob("DSV41_RDMA_PORTS", "", "RoCE devices/ports that must be ACTIVE, e.g. rocep1s0f1:1 roceP2p1s0f1:1",
            example='"rocep1s0f1:1 roceP2p1s0f1:1"', more="device:port as in /sys/class/infiniband. Empty = check "
                                                        "skipped."),
    OpsKnob("DSV41_MEM_GATE_GIB", "0", "MemFree (GiB) required on a node before a load; 0 = gate off", example="104",
            more="Unified memory: MemFree, not MemAvailable."),
    OpsKnob("DSV41_READY_TIMEOUT_S", "900", "how long deploy waits for /health ok and the canary",
            more="Then it rolls back."),
    OpsKnob("DSV41_WARM_PREPARED", "auto", "warm unit: read the prepared folder into the page cache (auto: only when "
            "MemAvailable holds twice the folder; 1 always; 0 never)",
            more="On a GB10 the page cache is the GPU's memory: a 95 GB folder is not cached ahead of a 95 GB load."),
    OpsKnob("DSV41_WATCH_FAILS", "3", "bad watchdog ticks in a row before healing"),
    OpsKnob("DSV41_WATCH_MIN_HEAL_S", "1800", "at most one ordinary heal per this many seconds"),
    OpsKnob("DSV41_WATCH_FF_MIN_HEAL_S", "120", "at most one fail-fast (exit 70) heal per this many seconds",
            more="A fail-fast exit heals at the first bad tick."),
    OpsKnob("DSV41_WATCH_GRACE_S", "1800", "a rank started less than this ago is loading, not bad"),
    OpsKnob("DSV41_WATCH_HEAL", "1", "1 = the watchdog restarts the pair; 0 = it only logs"),
)

# Passed to the server untouched (read by NCCL, gloo, glibc, Triton, torch, CUDA); never flags.
PASSTHROUGH_PREFIXES = ("NCCL_", "GLOO_", "MALLOC_", "TRITON_", "TORCH_", "CUDA_", "PYTORCH_")

PASSTHROUGH_EXAMPLES: tuple[PassthroughExample, ...] = (
    PassthroughExample("NCCL_SOCKET_IFNAME", "enp1s0f1np1", "the linked CX7 netdev for NCCL's bootstrap socket"),
    PassthroughExample("NCCL_IB_HCA", "rocep1s0f1,roceP2p1s0f1", "both RoCE functions of the port"),
    PassthroughExample("GLOO_SOCKET_IFNAME", "enp1s0f1np1", "the same netdev for gloo (only with "
                       "DSV41_TP_BACKEND=gloo)", commented=True),
    PassthroughExample("MALLOC_ARENA_MAX", "4", "fewer glibc malloc arenas: less fragmentation in a long-lived "
                       "multi-threaded server"),
)

# DSV41_* variables that are NOT appliance knobs (deploy refuses them in the env file); every DSV41_* name the
# code reads is a knob or listed here (tests/test_ops_knobs.py).
UNIT_SET = {  # set by the units themselves
    "DSV41_CUBIN_DIR": "the profile's prebuilt CUDA kernels (Environment= in the units)",
    "DSV41_HOME": "caches of the tiny model and built kernels (defaults under HOME = the state directory)",
}
DEVELOPER_SWITCHES = {  # A/B switches of the kernels for benches (docs/perf); the defaults are the tested paths
    name: "kernel A/B switch" for name in (
        "DSV41_EXL3_GROUP", "DSV41_EXL3_BACKEND", "DSV41_EXL3_NO_ASM", "DSV41_EXL3_CLUSTER",
        "DSV41_EXL3_WARP_EPILOGUE", "DSV41_EXL3_PERSIST", "DSV41_EXL3_TUNING", "DSV41_NVCC", "DSV41_PDL",
        "DSV41_CUDA_PDL", "DSV41_ATTN_FOLD", "DSV41_ATTN_ALIGNED", "DSV41_MHC_PIPELINE", "DSV41_ROUTER_FOLD",
        "DSV41_PREFILL_TILES", "DSV41_PREFILL_CORE_INDEXED", "DSV41_PREFILL_CORE_ONEPASS", "DSV41_TOPK_RADIX",
        "DSV41_PREFILL_DENSE_GEMM", "DSV41_PREFILL_TILE_ROWS", "DSV41_PREFILL_TILE_ORDER", "DSV41_PREFILL_MHC_TILES",
        "DSV41_PREFILL_MHC_BLOCKS", "DSV41_DECODE_CORE_TILING", "DSV41_PREFILL_WGMMA", "DSV41_PREFILL_DENSE_TILE",
        "DSV41_PREFILL_DENSE_GROUP", "DSV41_INDEX_TILE", "DSV41_PREFILL_MHC_SPLIT", "DSV41_TOPK_SHAPE",
        "DSV41_PREFILL_PV_PARTS")
}
INTERNAL = {  # between processes of one run, or test hooks
    "DSV41_TP_LOCAL_CHILD": "set by `serve --tp N` for the ranks it starts itself",
    "DSV41_TEST_FAIL_AT_ROUND": "fault injection for the fail-fast tests",
}


def tp_ranks(env: Mapping[str, str]) -> list[str]:
    """The pair's rank instances at `DSV41_TP` (rank0 only at TP=1; empty or unparsable: the two Sparks)."""
    try:
        world = int(env.get("DSV41_TP", "").strip() or 2)
    except ValueError:
        world = 2
    return [f"rank{r}" for r in range(max(world, 1))]


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
        if knob.switch:
            argv += [knob.flag] if value.lower() in ("1", "yes", "true", "on") else []
        elif knob.many:
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
    known = knob_names()
    return sorted(k for k in env if k not in known and not k.startswith(PASSTHROUGH_PREFIXES))


def knob_names() -> set[str]:
    """Every variable the env file may set by name (passthrough prefixes aside)."""
    return {k.env for k in SERVE_KNOBS} | {k.env for k in OPS_KNOBS} | {k.env for k in ENV_KNOBS}
