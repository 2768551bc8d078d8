"""`dsv41 eval PART ... [--write-reference FILE]`: the quality harness (docs/EVAL.md).

The model options are `dsv41 serve`'s (--model, --device, --dtype, --max-model-len, the engine options), so a
run measures what the server would serve. Without `--url` the parts run on the engine in this process, and
`tools` starts `dsv41 serve` as a subprocess with the same options (before the in-process model loads, so the two
never hold the weights at once); with `--url` every part but `drafting` talks to that server.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import DSV41Error

PARTS = ("agreement", "mmlu", "needle", "tools", "drafting")


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated fractions in [0, 1], got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 16 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated lengths >= 16, got {text!r}")
    return values


def _modes(text: str) -> list[bool]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(n not in ("off", "on") for n in names):
        raise argparse.ArgumentTypeError(f"must be off, on or off,on; got {text!r}")
    return [n == "on" for n in dict.fromkeys(names)]


def _names(text: str) -> list[str]:
    from .tools import SCENARIOS

    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"must name chains among {', '.join(SCENARIOS)}; got {text!r}")
    return names


def register(subparsers) -> argparse.ArgumentParser:
    from ..cli import add_cpu_threads, number
    from ..compose.build import register_engine_args
    from ..prepared.start import add_start_args

    p = subparsers.add_parser(
        "eval", help="quality harness: agreement, MMLU, needles, tool chains, drafting (JSON + table)",
        description="Measure a model's quality as the recipe does (docs/EVAL.md). PARTS: " + ", ".join(PARTS)
                    + " (or all).")
    p.add_argument("parts", nargs="*", metavar="PART", help="what to run: " + ", ".join(PARTS) + ", all")
    p.add_argument("--out", metavar="FILE.json", help="write every figure and per-item result here")
    p.add_argument("--url", help="a running server (http://host:port) instead of loading the model here")
    p.add_argument("--api-key-file", metavar="F", help="the server's bearer key (with --url)")
    p.add_argument("--seed", type=number(int, 0), default=0, help="seed of the generated needles and chains")
    g = p.add_argument_group("model (as dsv41 serve)")
    g.add_argument("--model", metavar="DIR", help="model folder (default: the built-in tiny model); with --url its "
                                                  "tokenizer encodes the prompts")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, auto (default auto)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto = bfloat16 on CUDA, float32 on the CPU")
    g.add_argument("--max-model-len", type=number(int, 2), metavar="N",
                   help="prompt + reply limit (default min(model, 8192)); needles need their longest length")
    g.add_argument("--max-waiting", type=number(int, 2), default=64, metavar="N",
                   help="engine queue; half of it is kept in flight (default 64)")
    g.add_argument("--no-fake-quant", action="store_true", help="skip the FP8/FP4 KV fake quantisation")
    g.add_argument("--engram-dir", metavar="DIR", help="packed Engram shards (as serve)")
    add_cpu_threads(g)
    g = p.add_argument_group("agreement")
    g.add_argument("--reference", metavar="REF.jsonl", help="a reference's prompt logprobs (format: docs/EVAL.md)")
    g.add_argument("--write-reference", metavar="REF.jsonl",
                   help="write this model's prompt logprobs as a reference (agreement uses it without --reference)")
    g.add_argument("--prompts", metavar="P.jsonl", help='prompts of --write-reference: {"text"} or {"ids"} lines '
                                                         "(default: built-in code, prose, list, dialogue)")
    g.add_argument("--reference-tokens", type=number(int, 2), default=2048, metavar="N",
                   help="each prompt text repeated to this many ids (default 2048, as the recipe)")
    g.add_argument("--top", type=number(int, 1), default=20, metavar="K",
                   help="top logprobs per position asked of the model (default 20, the server's most)")
    g = p.add_argument_group("mmlu")
    g.add_argument("--mmlu", metavar="CSV|DIR", help="questions in MMLU's CSV layout (question,A,B,C,D,answer)")
    g.add_argument("--mmlu-limit", type=number(int, 1), metavar="N", help="N questions spread over the set (200: "
                                                                        "the recipe's MMLU-200)")
    g = p.add_argument_group("needle")
    g.add_argument("--needle-lengths", type=_ints, default=[4096, 8000], metavar="L,...",
                   help="prompt lengths in tokens (default 4096,8000; the recipe: 32768,131072,299000)")
    g.add_argument("--needle-depths", type=_floats, default=[0.1, 1 / 3, 0.5, 0.9], metavar="D,...",
                   help="needle positions as fractions of the haystack (default 0.1,0.333,0.5,0.9)")
    g.add_argument("--needle-max-tokens", type=number(int, 1), default=16, metavar="N")
    g = p.add_argument_group("tools")
    g.add_argument("--tool-steps", type=number(int, 1), default=3, metavar="N", help="lookups of the key chain")
    g.add_argument("--tool-thinking", type=_modes, default=[False, True], metavar="off,on")
    g.add_argument("--tool-scenarios", type=_names, default=None, metavar="NAME,...",
                   help="the chains to run (default all: key-chain, arithmetic, temperature)")
    g.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                   help="auto: the model decides (default, what the figures mean); required: the grammar forces a "
                        "call every turn (checks the harness and the server, not the model)")
    g.add_argument("--tool-max-tokens", type=number(int, 1), default=2048, metavar="N", help="per turn")
    g.add_argument("--server-timeout", type=number(float, 0, above=True), default=900.0, metavar="S",
                   help="seconds the started server gets to load (default 900)")
    g = p.add_argument_group("drafting")
    g.add_argument("--draft-tokens", type=number(int, 1), default=384, metavar="N",
                   help="reply length per workload (default 384, as the recipe)")
    register_engine_args(p)
    _range_checked(p)
    add_start_args(p)
    p.set_defaults(func=run_eval)
    return p


def eval_args(argv: list[str]) -> argparse.Namespace:
    """`dsv41 eval`'s options parsed from `argv` (scripts and tests that call the parts directly)."""
    from ..cli import OneLineParser

    parser = OneLineParser(prog="dsv41")
    register(parser.add_subparsers())
    return parser.parse_args(["eval", *argv])


def _range_checked(p: argparse.ArgumentParser) -> None:
    """The engine options range-checked as they parse (serve checks the same limits at its start)."""
    from ..cli import number
    from ..server.cli import ENGINE_LIMITS

    limits = {flag: (kind, low, high, above) for _, flag, kind, low, high, above in ENGINE_LIMITS}
    for action in p._actions:
        for flag in action.option_strings:
            if flag in limits:
                kind, low, high, above = limits[flag]
                action.type = number(kind, low, high, above=above)


def _tokenizer(args):
    from ..cli import _model_dir
    from ..tokenizer import Tokenizer

    folder = _model_dir(args.model)
    return folder, Tokenizer.from_dir(folder)


def _api_key(args) -> str | None:
    if not args.api_key_file:
        return None
    try:
        return Path(args.api_key_file).read_text().strip() or None
    except OSError as e:
        raise DSV41Error(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None


def _serve_argv(args, folder: Path) -> list[str]:
    """`dsv41 serve`'s flags for the same model and engine as this run (only the options not at their default)."""
    from ..compose.build import register_engine_args
    from ..prepared.start import add_start_args

    argv = ["--model", str(folder), "--device", args.device, "--dtype", args.dtype]
    for flag, value in (("--max-model-len", args.max_model_len), ("--cpu-threads", args.cpu_threads),
                        ("--engram-dir", args.engram_dir), ("--max-waiting", args.max_waiting)):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_fake_quant:
        argv.append("--no-fake-quant")
    probe = argparse.ArgumentParser(add_help=False)
    register_engine_args(probe)
    add_start_args(probe)
    for action in probe._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def _parts(args) -> list[str]:
    """The parts to run, with what can be refused before anything loads."""
    unknown = [p for p in args.parts if p not in (*PARTS, "all")]
    if unknown:
        raise DSV41Error(f"eval: no part {unknown[0]!r} (parts: {', '.join(PARTS)}, all)")
    parts = list(PARTS) if "all" in args.parts else list(dict.fromkeys(args.parts))
    if not parts and not args.write_reference:
        raise DSV41Error("eval: name at least one part (" + ", ".join(PARTS) + ", all) or --write-reference FILE")
    if "agreement" in parts and not (args.reference or args.write_reference):
        raise DSV41Error("eval agreement: needs --reference FILE (or --write-reference FILE to check the model "
                         "against itself)")
    if "mmlu" in parts and not args.mmlu:
        raise DSV41Error("eval mmlu: needs --mmlu CSV|DIR (MMLU's layout: question,A,B,C,D,answer)")
    if "drafting" in parts and (args.url or args.engine != "batched"):
        raise DSV41Error("eval drafting: reads the batched engine's figures in this process: drop --url and "
                         "--engine reference")
    return parts


def run_eval(args) -> int:
    from .. import __version__
    from . import report

    parts = _parts(args)
    folder, tokenizer = _tokenizer(args)
    questions = None
    if "mmlu" in parts:
        from .mmlu import read_questions

        questions = read_questions(args.mmlu, args.mmlu_limit)
    api_key = _api_key(args)
    results = {"version": __version__, "model": str(folder), "url": args.url, "device": args.device,
               "dtype": args.dtype, "parts": {}}
    failed = False

    def record(name: str, work) -> None:
        nonlocal failed
        start = time.perf_counter()
        try:
            result = work()
        except DSV41Error as exc:
            failed = True
            result = {"error": str(exc)}
        result["seconds"] = round(time.perf_counter() - start, 3)
        results["parts"][name] = result

    if "tools" in parts:  # first: its server must be gone before this process loads the model
        from . import tools

        def run_tools():
            server = None
            url = args.url
            if url is None:
                server = tools.ServeProcess(_serve_argv(args, folder), start_timeout_s=args.server_timeout)
                url = server.url
            try:
                return tools.evaluate(url, api_key, steps=args.tool_steps, modes=args.tool_thinking,
                                      max_tokens=args.tool_max_tokens, seed=args.seed,
                                      tool_choice=args.tool_choice, only=args.tool_scenarios)
            finally:
                if server is not None:
                    server.stop()

        record("tools", run_tools)

    local = [p for p in parts if p != "tools"]
    if local or args.write_reference:
        backend = _backend(args, folder, tokenizer, api_key)
        results["backend"] = backend.kind
        try:
            _run_local(args, local, backend, tokenizer, questions, record)
        finally:
            backend.close()

    print(report.table(results["parts"]))
    if args.out:
        report.write_json(args.out, results)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


def _backend(args, folder: Path, tokenizer, api_key):
    from .backend import EngineBackend, ServerBackend

    if args.url:
        return ServerBackend(args.url, api_key)
    return EngineBackend(args, folder, tokenizer)


def _run_local(args, parts: list[str], backend, tokenizer, questions, record) -> None:
    from . import agreement, drafting, mmlu, needle

    if args.write_reference:
        prompts = agreement.reference_prompts(tokenizer, args.prompts, args.reference_tokens)
        record("write-reference", lambda: agreement.write_reference(backend, prompts, args.write_reference,
                                                                    args.top))
    if "agreement" in parts:
        ref = args.reference or args.write_reference
        record("agreement", lambda: agreement.evaluate(
            backend, agreement.read_reference(ref, tokenizer.vocab_size), args.top))
    if "mmlu" in parts:
        record("mmlu", lambda: mmlu.evaluate(backend, tokenizer, questions))
    if "needle" in parts:
        def run_needle():
            longest = max(args.needle_lengths) + args.needle_max_tokens
            if backend.max_model_len is not None and longest > backend.max_model_len:
                raise DSV41Error(f"needle: {max(args.needle_lengths)} tokens + {args.needle_max_tokens} of reply "
                                 f"is beyond --max-model-len {backend.max_model_len}")
            return needle.evaluate(backend, tokenizer, args.needle_lengths, args.needle_depths, seed=args.seed,
                                   max_tokens=args.needle_max_tokens)

        record("needle", run_needle)
    if "drafting" in parts:
        record("drafting", lambda: drafting.evaluate(backend, tokenizer, max_tokens=args.draft_tokens,
                                                     depth=args.draft_depth))
