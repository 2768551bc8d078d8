"""`dsv41 serve`: load the model, then serve the OpenAI-compatible API with hypercorn.

With `--tp N` (options from `dsv41.parallel.args`) the process runs one rank of a tensor-parallel group through
`dsv41.parallel.launch.run_rank`; rank 0 serves HTTP with the group's leader model, the others follow it.

Order (PLATFORM.md §4.3): check the arguments and bind the HTTP socket (not yet listening: a taken port is a
one-line error at once, not after the load), load model, tokenizer and grammar compiler (extending systemd's start
timeout), listen, start hypercorn, run one warm-up token, then report READY=1 and /health 200. SIGTERM/SIGINT
start a drain: STOPPING=1, /health 503, new requests 503, in-flight requests get --drain-timeout seconds, the
rest end with an error event; then hypercorn stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import DSV41Error

DEFAULT_MAX_MODEL_LEN = 8192


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve the model over an OpenAI-compatible HTTP API (hypercorn).")
    p.add_argument("--model", metavar="DIR", help="model folder (default: the built-in tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--allowed-hosts", metavar="NAME", nargs="+", action="extend", default=[],
                   help="Host header names served besides the loopback ones ('*': any); on a loopback bind "
                        "other names get 421 (DNS rebinding), elsewhere the list applies only when given")
    p.add_argument("--allowed-origins", metavar="ORIGIN", nargs="+", action="extend", default=[],
                   help="CORS: browser origins allowed to call the API (e.g. https://app.example; '*': any); "
                        "default none: no CORS headers, browsers refuse cross-origin calls")
    p.add_argument("--served-name", metavar="NAME", help="model id reported by /v1/models (default: folder name)")
    p.add_argument("--alias", metavar="NAME", nargs="+", action="extend", default=[],
                   help="more model ids accepted and listed")
    p.add_argument("--api-key-file", metavar="F", help="file holding the bearer key clients must send")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help=f"prompt + completion limit in tokens (default min(model, {DEFAULT_MAX_MODEL_LEN}))")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="N", help="request body limit (8 MiB)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send its whole request body, else 408 (default 30)")
    p.add_argument("--prompt-special-tokens", choices=("parse", "text"), default="parse",
                   help="/v1/completions text prompts: parse control-token spellings as control tokens "
                        "(default, as vLLM) or keep them plain text (chat message content is always text)")
    p.add_argument("--drain-timeout", type=float, default=20.0, metavar="S",
                   help="seconds in-flight requests get after SIGTERM (default 20)")
    p.add_argument("--request-log", metavar="FILE", help="append one JSON line per request to FILE")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests queued before new ones get 429 (default 64)")
    from ..cli import add_cpu_threads

    add_cpu_threads(p)
    p.add_argument("--device", default="auto",
                   help="torch device: auto (cuda when available, else cpu), cpu, cuda, cuda:N (default auto)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype: auto = bfloat16 on CUDA, float32 on the CPU (default auto)")
    p.add_argument("--no-fake-quant", action="store_true",
                   help="skip the FP8/FP4 KV and index fake quantisation (diagnosis; results then differ from the "
                        "release's forward)")
    p.add_argument("--engram-dir", metavar="DIR",
                   help="folder of this rank's packed Engram shards engram-l{L}-r{R}of{W}.bin (default: "
                        "$DSV41_ENGRAM_DIR, as preflight reads it; unset: the tables in the model folder)")
    from dsv41.compose.build import register_engine_args  # argparse only: no torch import here
    from dsv41.parallel.args import register_tp_args

    from dsv41.prepared.start import add_start_args

    register_engine_args(p)
    register_tp_args(p)
    add_start_args(p)
    p.set_defaults(func=run_serve)
    return p


def _api_key(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise DSV41Error(f"--api-key-file {path}: {exc.strerror}") from None
    if not key:
        raise DSV41Error(f"--api-key-file {path} is empty")
    return key


def _bind(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound but not listening: it holds the port while the model loads, and a client that
    connects meanwhile is refused at once instead of waiting in the backlog. `serve_model` listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DSV41Error(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock


def _model_folder(args) -> Path:
    if args.model:
        folder = Path(args.model)
        if not folder.is_dir():
            raise DSV41Error(f"--model {folder}: no such folder")
        return folder
    from dsv41.tiny.builtin import builtin_model_dir

    return builtin_model_dir()


def _engram_dir(args) -> Path | None:
    if args.engram_dir:
        value, name = args.engram_dir, "--engram-dir"
    else:
        value, name = os.environ.get("DSV41_ENGRAM_DIR", "").strip(), "DSV41_ENGRAM_DIR"
    if not value:
        return None
    if not Path(value).is_dir():
        raise DSV41Error(f"{name} {value}: no such folder")
    return Path(value)


def _model_positions(folder: Path) -> int | None:
    """max_position_embeddings from the folder's config.json (None if it does not say)."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config")
        value = config.get("max_position_embeddings", text.get("max_position_embeddings")
                           if isinstance(text, dict) else None)
    except (OSError, ValueError, AttributeError):
        return None  # the loader reports a missing or broken config.json itself
    return value if isinstance(value, int) and value > 0 else None


def check_limits(args, folder: Path) -> None:
    """Nonsense limits are one line at start, not a server that refuses everything (or a traceback later)."""
    def positive(name: str, value, allow_zero: bool = False) -> None:
        if value is not None and (value < 0 or (value == 0 and not allow_zero) or value != value):
            raise DSV41Error(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value:g}")

    if not 0 <= args.port <= 65535:
        raise DSV41Error(f"--port must be 0..65535, got {args.port}")
    positive("--max-model-len", args.max_model_len)
    positive("--max-body-bytes", args.max_body_bytes)
    positive("--max-waiting", args.max_waiting)
    positive("--cpu-threads", args.cpu_threads)
    positive("--drain-timeout", args.drain_timeout, allow_zero=True)
    positive("--body-timeout", args.body_timeout)
    for name, value in (("--drain-timeout", args.drain_timeout), ("--body-timeout", args.body_timeout)):
        if value == float("inf"):
            raise DSV41Error(f"{name} must be finite, got {value}")
    check_engine_limits(args)
    from dsv41.parallel.args import check_tp_args

    check_tp_args(args)
    positions = _model_positions(folder)
    if args.max_model_len is not None and positions is not None and args.max_model_len > positions:
        raise DSV41Error(f"--max-model-len {args.max_model_len} is beyond the model's {positions} positions "
                         f"({folder / 'config.json'}: max_position_embeddings)")


# The engine's numeric flags (compose/build.py registers them): (dest, flag, kind, low, high, low excluded).
ENGINE_LIMITS = (
    ("parallel", "--parallel", int, 1, None, False),
    ("pool_tokens", "--pool-tokens", int, 1, None, False),
    ("page_tokens", "--page-tokens", int, 1, None, False),
    ("prefill_chunk", "--prefill-chunk", int, 1, None, False),
    ("prefill_chunk_alone", "--prefill-chunk-alone", int, 0, None, False),
    ("prefill_share", "--prefill-share", float, 0, 1, True),
    ("mem_floor_gib", "--mem-floor-gib", float, 0, None, False),
    ("admit_timeout", "--admit-timeout", float, 0, None, True),
    ("session_ram_mib", "--session-ram-mib", float, 0, None, False),
    ("session_min_tokens", "--session-min-tokens", int, 1, None, False),
    ("session_disk_gib", "--session-disk-gib", float, 0, None, False),
    ("session_disk_min_tokens", "--session-disk-min-tokens", int, 1, None, False),
    ("session_park_s", "--session-park-s", float, 0, None, False),
    ("expert_topp", "--expert-topp", float, 0, 1, True),
    ("expert_min_k", "--expert-min-k", int, 1, None, False),
    ("draft_depth", "--draft-depth", int, 0, 5, False),
)


def check_engine_limits(args) -> None:
    """`--parallel 0`, `--page-tokens 0`, `--prefill-share 2` ended in tracebacks from inside the engine build."""
    from ..cli import number

    for dest, flag, kind, low, high, above in ENGINE_LIMITS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            number(kind, low, high, above=above)(str(value) if kind is int else f"{value:g}")
        except argparse.ArgumentTypeError as exc:
            raise DSV41Error(f"{flag} {exc}") from None


@dataclass
class Startup:
    """What `serve` checks before it binds or loads anything (each a one-line error when wrong)."""

    folder: Path
    api_key: str | None
    engram_dir: Path | None

    @classmethod
    def check(cls, args) -> "Startup":
        folder = _model_folder(args)
        check_limits(args, folder)
        return cls(folder, _api_key(args.api_key_file), _engram_dir(args))


def apply_http_options(config, args) -> None:
    """The HTTP-side options onto a ServerConfig (Host allow-list, body deadline, prompt tokenization)."""
    from .gate import allowed_hosts

    config.allowed_hosts = allowed_hosts(args.host, args.allowed_hosts)
    config.body_timeout_s = args.body_timeout
    config.prompt_special_tokens = args.prompt_special_tokens
    config.allowed_origins = tuple(args.allowed_origins)


def model_placement(args):
    """(device, dtype) from --device / --dtype. Under TP the rendezvous has already bound the rank to its GPU, so
    plain `cuda` is this rank's device."""
    import torch

    from ..cli import resolve_device

    device = resolve_device(args.device)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype)


def load_progress(notifier, terminal: bool = True):
    """The loader's progress callback: systemd STATUS= lines (ops.notify.LoadProgress) and, when stderr is a
    terminal, a progress bar."""
    from ..cli import LoadBar
    from ..ops.notify import LoadProgress

    sinks = [LoadProgress(notifier).update] + ([LoadBar().update] if terminal else [])

    def report(done: int, total: int, what: str) -> None:
        for sink in sinks:
            sink(done, total, what)

    return report


def _status_line(line: str) -> None:
    """A start phase's line as systemd STATUS= (a no-op outside a notify unit)."""
    from ..ops.notify import Notifier

    Notifier().status(line)


def load_serving_model(args, startup: Startup, progress, **tp):
    """This rank's model (`tp`: rank, world, comm under tensor parallelism). The DSpark drafter is loaded when the
    batched engine drafts with it (--draft-dspark on, --draft-depth > 0) and the checkpoint has it."""
    from ..compose.build import dspark_wanted, serving_forward
    from ..model.loader import load_model

    from ..cli import set_cpu_threads

    set_cpu_threads(args.cpu_threads)
    device, dtype = model_placement(args)
    fast = getattr(args, "engine", "batched") == "batched" and serving_forward(args, device) == "fast"
    from ..prepared.start import load_fast_model, prepared_root

    if prepared_root(args) is not None and not fast:
        raise DSV41Error("--prepared starts the fast forward: use --engine batched with --forward fast (the default "
                         "on CUDA)")
    if fast:  # packed weights driving the kernels (docs/perf/fast_path.md): from the prepared folder or built
        return load_fast_model(args, startup.folder, device=device, dtype=dtype, progress=progress,
                               engram_dir=startup.engram_dir, notify=_status_line, **tp)
    return load_model(startup.folder, dtype=dtype, device=device, fake_quant=not args.no_fake_quant,
                      dspark=None if dspark_wanted(args, device) else False,
                      progress=progress, engram_dir=startup.engram_dir, **tp)


def serving_max_model_len(args, model) -> int:
    """--max-model-len, or the model's positions capped at DEFAULT_MAX_MODEL_LEN (`model`: a model or an executor)."""
    model_config = getattr(model, "config", None) or model.cfg
    limit = getattr(model_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    return args.max_model_len or min(int(limit), DEFAULT_MAX_MODEL_LEN)


def build_server(args, startup: Startup, model):
    """The ServerContext around a loaded model (the folder's, or the TP leader on rank 0)."""
    from dsv41.structured.grammar import Grammars
    from ..compose.build import attach_server_stats, build_engine
    from ..tokenizer import Tokenizer
    from .context import ServerConfig, ServerContext

    folder = startup.folder
    tokenizer = Tokenizer.from_dir(folder)
    max_model_len = serving_max_model_len(args, model)
    engine = build_engine(args, model, max_model_len=max_model_len, encode_text=tokenizer.encode)
    grammars = Grammars(folder / "tokenizer.json", vocab_size=engine.vocab_size, stop_token_ids=[tokenizer.eos_id])
    config = ServerConfig(
        served_name=args.served_name or folder.name, aliases=tuple(args.alias), max_model_len=max_model_len,
        max_body_bytes=args.max_body_bytes, api_key=startup.api_key, drain_timeout_s=args.drain_timeout,
        request_log=args.request_log)
    ctx = ServerContext(config, engine, tokenizer, grammars)
    attach_server_stats(ctx)
    return ctx


def run_serve(args) -> int:
    """`dsv41 serve`: TP=1 in this process, or one rank of a tensor-parallel group (rank 0 serves HTTP)."""
    tp, rank = args.tp or 1, args.rank
    if tp == 1 and rank not in (None, 0):
        raise DSV41Error(f"--rank {rank} is outside --tp 1 (ranks are 0..tp-1)")
    if tp > 1 and args.engine == "reference":
        raise DSV41Error("--engine reference runs at --tp 1 only (the batched engine runs every TP degree)")
    startup = Startup.check(args)
    sock = _bind(args.host, args.port) if rank in (None, 0) else None  # only rank 0 serves HTTP
    if tp == 1:  # TP=1 with --rank 0 (what a single-node unit passes) is the plain server
        return serve_model(args, startup, sock)
    from dsv41.parallel.launch import run_rank

    from ..ops.notify import Notifier
    notifier = Notifier()
    notifier.extend_timeout(600, status="joining the tensor-parallel group")
    progress = load_progress(notifier, terminal=rank in (None, 0))  # one bar per terminal: rank 0's

    def load(rank: int, world: int, comm):
        model = load_serving_model(args, startup, progress, rank=rank, world=world, comm=comm)
        from ..compose.build import build_runner

        return build_runner(args, model, serving_max_model_len(args, model), driver=rank == 0)

    return run_rank(args, load=load, serve=lambda leader: serve_model(args, startup, sock, leader),
                    on_ready=notifier.ready, watchdog=notifier.watchdog)


def serve_model(args, startup: Startup, sock: socket.socket, model=None) -> int:
    """Serve HTTP on `sock` until SIGTERM/SIGINT (with `model` already loaded, or loading the folder's)."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from ..ops.journal import setup_logging
    from ..ops.notify import Notifier, WatchdogPinger
    from .app import build_app

    setup_logging()
    notifier = Notifier()
    if model is None:
        notifier.extend_timeout(600, status="loading model")
        model = load_serving_model(args, startup, load_progress(notifier))
    ctx = build_server(args, startup, model)
    apply_http_options(ctx.config, args)
    # WATCHDOG=1 only while the engine loop makes progress, not merely while this process is alive
    pinger = WatchdogPinger(notifier, ctx.engine.healthy)
    sock.listen(512)
    host, port = sock.getsockname()[:2]

    hc = Config()
    hc.bind = [f"fd://{sock.fileno()}"]
    hc.graceful_timeout = 3.0  # after our own drain; only stragglers are cut here
    hc.keep_alive_timeout = 30.0
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        draining: list[asyncio.Task] = []

        async def drain_then_stop() -> None:
            pinger.stop()
            notifier.stopping()
            print("dsv41: draining", file=sys.stderr, flush=True)
            await ctx.drain()
            stop.set()

        async def abort_then_stop() -> None:
            await ctx.abort_now()  # every stream still ends with an error event and [DONE]
            stop.set()

        def on_signal() -> None:
            if not draining:
                draining.append(loop.create_task(drain_then_stop()))
            elif len(draining) == 1:  # a second signal: end in-flight requests now, without the grace
                print("dsv41: second signal, ending in-flight requests now", file=sys.stderr, flush=True)
                draining.append(loop.create_task(abort_then_stop()))
            else:  # a third: stop at once
                stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)

        app = build_app(ctx)

        async def announce_ready() -> None:
            while ctx.status == "loading":
                await asyncio.sleep(0.02)
            if ctx.status != "ready":  # stopped before it ever served: no READY=1 after STOPPING=1
                return
            notifier.ready(f"serving {ctx.config.served_name} on {host}:{port}")
            pinger.start()
            print(f"dsv41: serving {ctx.config.served_name} on http://{host}:{port}", flush=True)

        ready_task = loop.create_task(announce_ready())
        try:
            await serve(app, hc, shutdown_trigger=stop.wait)
        finally:
            ready_task.cancel()
            pinger.stop()

    asyncio.run(main())
    sock.detach()  # hypercorn closed the descriptor it was handed
    return 0
