"""The composition root: `dsv41 serve`'s engine options, and the engine they describe (docs/ENGINE.md).

`build_runner(args, model, max_model_len)` runs on every rank: the KV pool sized from the options and measured
free memory, the forward over it, the runner. `build_engine(args, model, ...)` runs on rank 0 and returns what
the server drives: `SerialEngine` (`--engine reference`, the exact one-request-at-a-time engine over model/) or
`AsyncEngine` over `LLMEngine` over an executor (`--engine batched`, the default). Torch is imported only inside
the builders: registering the options must stay cheap.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

GIB = 1 << 30


def register_engine_args(parser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", choices=("batched", "reference"), default="batched",
                   help="batched: many requests over one paged KV pool (default); reference: one request at a "
                        "time over the reference model (exact by construction)")
    g.add_argument("--parallel", type=int, default=4, metavar="N", help="request slots (default 4)")
    g.add_argument("--pool-tokens", type=int, default=None, metavar="N",
                   help="KV pool positions shared by all slots (default: parallel x context, capped by free "
                        "memory above the floor)")
    g.add_argument("--page-tokens", type=int, default=256, metavar="N", help="positions per pool page (256)")
    g.add_argument("--prefill-chunk", type=int, default=2048, metavar="N",
                   help="most prompt rows prefilled in one step (default 2048)")
    g.add_argument("--prefill-chunk-alone", type=int, default=8192, metavar="N",
                   help="most prompt rows of a step in which no stream decodes (default 8192; never fewer than "
                        "--prefill-chunk; 0 = --prefill-chunk)")
    g.add_argument("--prefill-share", type=float, default=0.5, metavar="F",
                   help="most share of the engine's time prefill takes while others decode (default 0.5)")
    g.add_argument("--prefill", choices=("full", "replay"), default="full",
                   help="full: exact prefill (default); replay: CED bounded replay (approximate, tagged)")
    g.add_argument("--mem-floor-gib", type=float, default=0.0, metavar="G",
                   help="admit nothing new while free memory (MemAvailable on unified memory) is below this")
    g.add_argument("--admit-timeout", type=float, default=30.0, metavar="S",
                   help="a request that cannot be admitted with nothing else running fails after this long")
    g.add_argument("--sessions", choices=("on", "off"), default="on",
                   help="session entries: a prompt that starts with an earlier prompt or reply resumes from its "
                        "state instead of prefilling it again (exact; default on; full prefill only)")
    g.add_argument("--session-ram-mib", type=float, default=256.0, metavar="MIB",
                   help="RAM budget of the session entries' ring-slot snapshots (their pool pages yield to live "
                        "requests; default 256)")
    g.add_argument("--session-min-tokens", type=int, default=16, metavar="N",
                   help="shortest state kept as a session entry (default 16)")
    g.add_argument("--session-dir", default=None, metavar="DIR",
                   help="the NVMe tier of sessions: entries leaving RAM are parked here (one folder per rank) and "
                        "a restarted server resumes them (default: none)")
    g.add_argument("--session-disk-gib", type=float, default=64.0, metavar="GIB",
                   help="byte budget of --session-dir (least recently used files go first; default 64)")
    g.add_argument("--session-disk-min-tokens", type=int, default=1024, metavar="N",
                   help="shortest entry parked on --session-dir (shorter ones are dropped; default 1024)")
    g.add_argument("--session-park-s", type=float, default=30.0, metavar="S",
                   help="a graceful stop parks session entries on --session-dir, newest first, for about this long "
                        "(default 30; keep the drain timeout plus this under the unit's TimeoutStopSec)")
    g.add_argument("--expert-topp", type=float, default=None, metavar="P",
                   help="routed-expert pruning: keep the experts holding this much of the routing mass "
                        "(approximate, tagged; default off)")
    g.add_argument("--expert-min-k", type=int, default=3, metavar="K",
                   help="with --expert-topp: never fewer experts than this (default 3)")
    g.add_argument("--forward", choices=("fast", "reference"), default=None,
                   help="the batched engine's forward: fast (runtime/ FastModel, packed weights and kernels; the "
                        "default on CUDA) or reference (model/ math over the pool; the default on the CPU). "
                        "fast on the CPU runs the Triton interpreter (TRITON_INTERPRET=1 only)")
    import os

    env = os.environ.get
    g.add_argument("--draft-depth", type=int, default=int(env("DSV41_DRAFT_DEPTH", "5")), metavar="K",
                   help="speculative drafting: most drafts a round, 0..5 (DSV41_DRAFT_DEPTH; default 5; 0: off)")
    g.add_argument("--draft-dspark", choices=("auto", "on", "off"), default=env("DSV41_DRAFT_DSPARK", "auto"),
                   help="DSpark drafts when the checkpoint has the draft blocks (DSV41_DRAFT_DSPARK; auto: on a GPU, "
                        "not on the CPU, where every verify row costs what a token is worth)")
    g.add_argument("--draft-lookup", choices=("on", "off"), default=env("DSV41_DRAFT_LOOKUP", "off"),
                   help="lookup drafts: continuations found in the request's own prompt and output "
                        "(DSV41_DRAFT_LOOKUP; default off)")
    g.add_argument("--draft-default", choices=("on", "off"), default="off" if env("DSV41_DRAFT") == "0" else "on",
                   help="whether requests that do not say draft (DSV41_DRAFT=0: off; a request's \"draft\" "
                        "field decides for itself)")
    g.add_argument("--overlap", choices=("on", "off"), default="off" if env("DSV41_OVERLAP") == "0" else "on",
                   help="plan and launch decode step k+1 while step k runs, its token ids handed over from step k's "
                        "sample (DSV41_OVERLAP=0: off; TP=1; docs/ENGINE.md §6)")
    g.add_argument("--draft-cost", default=env("DSV41_DRAFT_COST"), metavar="ROWS:S,...",
                   help="the step cost per row count that sets the draft depth (DSV41_DRAFT_COST; default: "
                        "measured at start)")


def engine_defaults(**overrides) -> argparse.Namespace:
    """The engine options as `dsv41 serve` parses them by default, with `overrides` (tests, benches)."""
    parser = argparse.ArgumentParser(add_help=False)
    register_engine_args(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"no engine option {key!r}")
        setattr(args, key, value)
    return args


def session_config(args, pool, forward=None):
    """The engine's sessions (engine/sessions.py SessionConfig), None with --sessions off. Entries at a reply's end
    only where `forward`'s decode rows are its prefill rows bit for bit (else a resumed turn would not be a fresh
    prefill: ENGINE.md §4)."""
    from ..engine.sessions import SessionConfig

    if getattr(args, "sessions", "on") == "off":
        return None
    return SessionConfig(ram_bytes=int(getattr(args, "session_ram_mib", 256.0) * (1 << 20)),
                         min_tokens=getattr(args, "session_min_tokens", 16), slot_bytes=pool.bytes_per_slot,
                         disk_min_tokens=getattr(args, "session_disk_min_tokens", 1024),
                         reply_entries=bool(getattr(forward, "decode_rows_are_prefill_rows", False)))


def knobs_tag(args) -> str:
    """Every approximate setting in force, as carried by the results it produced ("" = exact)."""
    parts = []
    if args.prefill == "replay":
        parts.append("prefill=replay")
    if args.expert_topp is not None:
        parts.append(f"expert_topp={args.expert_topp:g},min_k={args.expert_min_k}")
    return ";".join(parts)


def draft_config(args, model, executor=None, log=None, *, drafter: bool = False):
    """The engine's drafting (`engine/drafting.py`) from the options: DSpark when the runner has the drafter,
    lookup when asked; the step cost table given, or measured through `executor` before serving (every rank runs
    the scratch steps), and logged."""
    from ..engine.drafting import CostTable, DraftConfig

    depth = max(0, min(int(getattr(args, "draft_depth", 0) or 0), 5))
    dspark = drafter
    lookup = getattr(args, "draft_lookup", "off") == "on"
    block = model.cfg.dspark_block_size or 5
    config = DraftConfig(dspark=dspark, lookup=lookup, depth=depth, block=block,
                         default_on=getattr(args, "draft_default", "on") == "on")
    if config.active:
        if getattr(args, "draft_cost", None):
            config.cost = CostTable.parse(args.draft_cost)
        elif executor is not None:
            from ..engine.drafting import measure_step_costs

            pool = executor.runner.pool
            config.cost = CostTable(measure_step_costs(
                executor.execute, slots=pool.num_slots, pages=pool.num_pages, max_rows=args.parallel * (depth + 1),
                window=depth + 1, knobs_tag=executor.runner.knobs_tag))
        if log is not None:
            log(f"dsv41 engine: drafting {'dspark' if dspark else ''}{'+' if dspark and lookup else ''}"
                f"{'lookup' if lookup else ''}, depth <= {depth}, by default {'on' if config.default_on else 'off'}; "
                f"step cost {config.cost.describe()}")
    return config


def dspark_wanted(args, device) -> bool:
    """Whether the batched engine drafts with DSpark on `device` (the model must then load the draft blocks)."""
    choice = getattr(args, "draft_dspark", "off")
    on = choice == "on" or (choice == "auto" and str(device).startswith("cuda"))
    return on and getattr(args, "engine", "batched") == "batched" and getattr(args, "draft_depth", 0) > 0


def serving_forward(args, device) -> str:
    """The batched engine's forward on `device`: `--forward`, else fast on CUDA and reference elsewhere. Raises
    ConfigError (one line) for fast on the CPU without TRITON_INTERPRET=1."""
    import os

    from ..errors import ConfigError

    forward = getattr(args, "forward", None) or ("fast" if str(device).startswith("cuda") else "reference")
    if forward == "fast":
        if not str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"--forward fast on {device} runs the Triton interpreter: set TRITON_INTERPRET=1 "
                             f"(slow; for tests), or use --forward reference")
    return forward


def build_runner(args, model, max_model_len: int, *, driver: bool = True, log=None):
    """This rank's `ModelRunner` over a pool for `--parallel` slots of `max_model_len` positions. `model`: the
    reference `Model` (the pool forward) or a `FastModel` (runtime/build.py: the fast forward)."""
    from ..errors import ConfigError
    from ..runtime.fast_forward import FastForward, pool_layout
    from ..runtime.graphs import ENV_BOOT, env_boot_budget
    from ..runtime.kv_pool import pool_for_model
    from ..runtime.model import FastModel
    from ..runtime.model_runner import ModelRunner, free_bytes
    from ..runtime.pool_forward import PoolForward

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    fast = isinstance(model, FastModel)
    forward_kind = serving_forward(args, model.device)
    if forward_kind == "fast" and not fast:
        if getattr(args, "forward", None) == "fast":
            raise ConfigError("--forward fast needs the model built by runtime.build.build_fast_model; the "
                             "reference model was loaded")
        log("dsv41 engine: the reference model was loaded: the batched engine runs the reference forward")
        forward_kind = "reference"
    if forward_kind == "reference" and fast:
        raise ConfigError("--forward reference needs the reference model (model/loader.py); a FastModel was built")
    if fast and args.expert_topp is not None:
        raise ConfigError("--forward fast does not run --expert-topp (use --forward reference)")
    # without DSpark drafting the pool has no stage rings, and the fast forward then seeds none
    layout = pool_layout(model, drafting=dspark_wanted(args, model.device)) if fast else model
    if args.parallel < 1 or args.page_tokens < 1:
        raise ValueError("--parallel and --page-tokens must be >= 1")
    context_pages = -(-(max_model_len + 1) // args.page_tokens)
    # ring rows for a verify window (a rejected draft rolls back by length: the ring keeps the window behind it):
    # DSpark's block + 1, also for lookup drafts alone
    drafts = getattr(args, "draft_depth", 0) > 0 and getattr(args, "draft_lookup", "off") == "on"
    verify = (model.cfg.dspark_block_size or 5) + 1 if layout.dspark is not None or drafts else 0
    probe = pool_for_model(layout, num_slots=1, num_pages=1, page_tokens=args.page_tokens, verify_rows=verify)
    if args.pool_tokens is not None:
        pages = -(-args.pool_tokens // args.page_tokens)
    else:
        pages = args.parallel * context_pages
        reserve = 0
        if fast and model.device.type == "cuda":  # the longest chunk's transients stay free (prefill_memory.py)
            from ..runtime.prefill_memory import prefill_reserve

            chunk = max(args.prefill_chunk, getattr(args, "prefill_chunk_alone", 0))
            reserve, note = prefill_reserve(model, chunk, max_model_len)
            log(note)
        room = (free_bytes(model.device) - int(args.mem_floor_gib * GIB) - args.parallel * probe.bytes_per_slot
                - reserve)
        pages = max(min(pages, int(0.9 * room) // max(probe.bytes_per_page, 1)), context_pages)
    pool = pool_for_model(layout, num_slots=args.parallel, num_pages=pages, page_tokens=args.page_tokens,
                          verify_rows=verify)
    d = pool.describe()
    log(f"dsv41 engine: KV pool {d['slots']} slots x {d['bytes_per_slot']} B + {d['pages']} pages x "
        f"{args.page_tokens} tokens ({d['bytes_per_token']} B/token), {d['bytes_total'] / GIB:.3f} GiB; "
        f"stores {d['stores']}")
    if fast:
        if model.graphs is not None:  # captured over another pool: the in-place step's graph writes that pool's
            model.graphs.clear()  # stores (constants of the capture), and its key does not name the pool
        forward = FastForward(model)
        budget = env_boot_budget()
        boot = forward.capture_graphs(pool, max_rows=args.parallel, max_len=max_model_len, budget_s=budget)
        if boot["planned"]:
            log(f"dsv41 engine: {boot['captured']} decode graphs captured before serving ({boot['run']} of "
                f"{boot['planned']} planned) in {boot['seconds']:.1f} s ({ENV_BOOT}={budget:g})")
    else:
        forward = PoolForward(model, replay=args.prefill == "replay", expert_topp=args.expert_topp,
                              expert_min_k=args.expert_min_k)
    log(f"dsv41 engine: {forward_kind} forward")
    drafter = None
    if model.dspark is None and dspark_wanted(args, model.device):
        log("dsv41 engine: the model has no DSpark draft blocks (the checkpoint has none): no DSpark drafts")
    if model.dspark is not None and dspark_wanted(args, model.device):
        if fast:  # the pass on the fast path's kernels (runtime/draft_fast.py)
            from ..runtime.draft_fast import FastDSparkDrafter as DSparkDrafter
        else:
            from ..runtime.draft_dspark import DSparkDrafter

        drafter = DSparkDrafter(model)
        if fast:  # the draft pass's graphs too (runtime/draft_fast.py), within their own boot budget
            boot = drafter.capture_graphs(pool, max_seqs=args.parallel, budget_s=env_boot_budget())
            if boot["planned"]:
                log(f"dsv41 engine: {boot['captured']} draft-pass graphs captured before serving ({boot['run']} of "
                    f"{boot['planned']} planned) in {boot['seconds']:.1f} s")
    from ..runtime.session_disk import session_disk_for

    disk = session_disk_for(args, pool, model, knobs=knobs_tag(args), log=log)
    return ModelRunner(forward, pool, driver=driver, knobs_tag=knobs_tag(args), drafter=drafter, session_disk=disk)


def build_engine(args, model, *, max_model_len: int, encode_text=None, log=None):
    """The server's `Engine`. `model`: the loaded reference model, or (under TP) rank 0's `LeaderExecutor`."""
    if args.engine == "reference":
        from .serial import SerialEngine

        if hasattr(model, "execute"):
            raise ValueError("--engine reference runs at --tp 1 only")
        return SerialEngine(model, max_model_len=max_model_len, max_waiting=args.max_waiting,
                            encode_text=encode_text)
    from ..engine.async_engine import AsyncEngine
    from ..engine.block_manager import BlockManager
    from ..engine.llm_engine import EngineConfig, LLMEngine
    from ..engine.scheduler import SchedulerConfig

    if hasattr(model, "execute"):
        executor = model
    else:
        from dsv41.parallel.executor import LocalExecutor

        executor = LocalExecutor(build_runner(args, model, max_model_len, log=log))
    runner = executor.runner
    pool, cfg = runner.pool, runner.forward.model.cfg
    hasher = runner.forward.model.engram_hasher
    config = EngineConfig(
        scheduler=SchedulerConfig(prefill_chunk=args.prefill_chunk, prefill_share=args.prefill_share,
                                  prefill_chunk_alone=args.prefill_chunk_alone,
                                  mem_floor_bytes=int(args.mem_floor_gib * GIB), admit_timeout_s=args.admit_timeout),
        prefill_mode=args.prefill, window=cfg.sliding_window,
        lookback=hasher.constants.max_ngram - 1 if hasher is not None else 0, knobs_tag=knobs_tag(args),
        draft=draft_config(args, runner.forward.model, executor, log, drafter=runner.drafter is not None),
        sessions=session_config(args, pool, runner.forward), overlap=getattr(args, "overlap", "on") == "on")
    # at TP > 1 the group's fewest pages (parallel/launch.py): each rank sized its pool from its own free memory
    pages = min(pool.num_pages, getattr(executor, "num_pages", None) or pool.num_pages)
    if pages < pool.num_pages and log is not None:
        log(f"dsv41 engine: {pages} of this rank's {pool.num_pages} pages in use (another rank holds fewer)")
    core = LLMEngine(executor, BlockManager(pages, pool.num_slots, pool.page_tokens), config)
    return AsyncEngine(core, vocab_size=cfg.vocab_size, max_model_len=max_model_len,
                       max_waiting=getattr(args, "max_waiting", 64), encode_text=encode_text,
                       describe={"pool": pool.describe()}, park_s=getattr(args, "session_park_s", 30.0))


# ---------------------------------------------------------------------------------------------------- server
class EngineDetail(Mapping):
    """The batched engine's figures as `/health`'s extra `batching` block (read live at every request)."""

    def __init__(self, engine):
        self.engine = engine

    def __getitem__(self, key):
        if key != "batching" or not self.engine.stats().detail:
            raise KeyError(key)
        return self.engine.stats().detail

    def __iter__(self):
        return iter(["batching"] if self.engine.stats().detail else [])

    def __len__(self):
        return len(list(iter(self)))


class EngineCollector:
    """Prometheus figures of the batched engine: slots, pages, queue, tokens, rounds, rows and time per round."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        d = self.engine.stats().detail
        if not d:
            return
        for name, key, text in (("slots_busy", "slots_busy", "Request slots in use"),
                                ("slots", "slots_total", "Request slots"),
                                ("pages_used", "pages_used", "KV pool pages in use"),
                                ("pages", "pages_total", "KV pool pages"),
                                ("queue", "queue", "Requests waiting for a slot, pages or memory"),
                                ("last_round_seconds", "last_round_s", "Duration of the last round")):
            yield GaugeMetricFamily(f"dsv41_engine_{name}", text, value=d[key])
        for name, key, text in (("prefill_tokens", "prefill_tokens_total", "Prompt rows prefilled"),
                                ("decode_tokens", "decode_tokens_total", "Decode rows run"),
                                ("rounds", "rounds", "Engine rounds (steps)"),
                                ("round_seconds", "round_seconds_total", "Time spent in rounds")):
            yield CounterMetricFamily(f"dsv41_engine_{name}", text, value=d[key])
        hist = HistogramMetricFamily("dsv41_engine_rows_per_round", "Rows (tokens) per round")
        counts = {int(k): v for k, v in d["rows_per_round"].items()}
        buckets, running = [], 0
        for bound in sorted(counts):
            running += counts[bound]
            buckets.append((str(float(bound)), running))
        hist.add_metric([], buckets + [("+Inf", running)], sum_value=d["prefill_tokens_total"]
                        + d["decode_tokens_total"])
        yield hist


def attach_server_stats(ctx) -> None:
    """Expose the engine's figures on `/health` (the `batching` block) and `/metrics` (`dsv41_engine_*`)."""
    ctx.config.extra_health = EngineDetail(ctx.engine)
    ctx.metrics.registry.register(EngineCollector(ctx.engine))
