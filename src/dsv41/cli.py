"""`dsv41` command line. Every user-facing failure is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .errors import DSV41Error
from .generation import generation_inputs

DTYPES = ("float32", "bfloat16")


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one line (`dsv41 generate: error: argument --max-tokens: ...`), no usage dump:
    the same shape as every other refusal of the CLI. `--help` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False):
    """An argparse `type=` that range-checks: `kind` int or float, at least `low` (more than it with `above`), at
    most `high`; floats must be finite. The refusal names the range and the value on one line."""
    noun = "an integer" if kind is int else "a number"
    parts = [f"{'>' if above else '>='} {low:g}"] if low is not None else []
    parts += [f"<= {high:g}"] if high is not None else []
    wanted = f"{noun} {' and '.join(parts)}".strip()

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        bad = value != value or value in (float("inf"), float("-inf"))
        bad = bad or (low is not None and (value <= low if above else value < low))
        bad = bad or (high is not None and value > high)
        if bad:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def add_cpu_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-threads", type=number(int, 1), metavar="N",
                   help="torch CPU threads (default: torch's choice; a busy machine runs faster with fewer)")


def set_cpu_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from dsv41.tiny.builtin import builtin_model_dir
    return builtin_model_dir()


def resolve_device(name: str):
    """`--device` as a torch.device (`auto`: cuda when available, else cpu). A CUDA device this host does not have
    is a one-line DSV41Error before anything loads, not a torch traceback from deep inside the load."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DSV41Error(f"--device {name}: not a torch device (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DSV41Error(f"--device {name}: CUDA is not available on this host ({why}; torch {torch.__version__})")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DSV41Error(f"--device {name}: this host has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


class LoadBar:
    """A progress bar on stderr while a model loads (the loader's `progress(done, total, what)` callback), drawn only
    when stderr is a terminal: under systemd the server reports STATUS= lines instead, and pipes (tests, journald)
    get nothing."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self._bar = None

    def update(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="loading", unit=f" {what}", file=self.stream)
        self._bar.total = total
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()
            self._bar = None


def _load(args, dspark: bool = False):
    import torch

    from .model.loader import load_model
    set_cpu_threads(args.cpu_threads)
    dtype = getattr(torch, args.dtype)
    return load_model(_model_dir(args.model), dtype=dtype, device=resolve_device(args.device),
                      fake_quant=not args.no_fake_quant, dspark=dspark, progress=LoadBar().update)


def _model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", metavar="DIR", required=model_required,
                   help="checkpoint folder" + ("" if model_required else " (default: the built-in tiny model)"))
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N, auto (default cpu)")
    p.add_argument("--no-fake-quant", action="store_true",
                   help="skip the FP8/FP4 KV and index fake quantisation everywhere (diagnosis)")
    add_cpu_threads(p)


# ---------------------------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    import torch

    from .runtime.sampling import sample_token
    from .prepared.start import generate_fast, wants_fast
    if wants_fast(args):  # the serving forward: from a prepared folder (--prepared) or built (--forward fast)
        return generate_fast(args, _model_dir(args.model), resolve_device(args.device), LoadBar().update)
    model = _load(args)
    tok, ids, params, seed = generation_inputs(args, model, _model_dir(args.model))
    state = model.new_state()
    decoder = tok.incremental_decoder()
    start = time.perf_counter()
    with torch.no_grad():
        logits = model.forward(state, torch.tensor(ids))[-1]
        prefill_s = time.perf_counter() - start
        out = []
        for step in range(args.max_tokens):
            nxt = sample_token(logits, params, seed, step)
            out.append(nxt)
            if nxt == tok.eos_id and not args.ignore_eos:
                break
            sys.stdout.write(decoder.feed([nxt]))
            sys.stdout.flush()
            logits = model.forward(state, torch.tensor([nxt]))[-1]
    sys.stdout.write(decoder.flush() + "\n")
    total = time.perf_counter() - start
    decode_s = max(total - prefill_s, 1e-9)
    print(f"[{len(ids)} prompt tokens in {prefill_s:.2f} s ({len(ids) / max(prefill_s, 1e-9):.1f} tok/s); "
          f"{len(out)} generated in {decode_s:.2f} s ({len(out) / decode_s:.2f} tok/s)]", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------------- score
def cmd_score(args) -> int:
    import torch
    from safetensors.torch import save_file

    spec = _read_score_input(Path(args.input))
    model = _load(args)
    ids = torch.tensor(spec["ids"])
    state = model.new_state()
    rows, pos = [], 0
    with torch.no_grad():
        for n in spec["chunks"]:
            rows.append(model.forward(state, ids[pos:pos + n]))
            pos += n
        for i in range(pos, len(ids)):  # the remainder is decoded one token at a time
            rows.append(model.forward(state, ids[i:i + 1]))
    logits = torch.cat(rows).float().contiguous()
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # a missing folder is made, as `make-tiny DIR` does
        save_file({"logits": logits}, str(out))
    except OSError as e:
        raise DSV41Error(f"--out {out}: {e.strerror or e}") from None
    print(f"wrote logits {list(logits.shape)} to {args.out}", file=sys.stderr)
    return 0


def _read_score_input(path: Path) -> dict:
    try:
        spec = json.loads(path.read_text())
    except OSError as e:
        raise DSV41Error(f"--input {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DSV41Error(f"--input {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(spec, dict):
        raise DSV41Error(f"--input {path}: expected an object with 'ids' and 'chunks'")
    ids, chunks = spec.get("ids"), spec.get("chunks", [])
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        raise DSV41Error(f"--input {path}: field 'ids' must be a non-empty list of token ids")
    if not isinstance(chunks, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                                               for c in chunks):
        raise DSV41Error(f"--input {path}: field 'chunks' must be a list of positive chunk lengths")
    if sum(chunks) > len(ids):
        raise DSV41Error(f"--input {path}: chunks add up to {sum(chunks)}, more than the {len(ids)} ids")
    return {"ids": ids, "chunks": chunks}


# ------------------------------------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    """Prefill and decode speed of the engine's forward on this machine, as one JSON line."""
    import torch

    model = _load(args)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen)
    with torch.no_grad():
        model.forward(model.new_state(), prompt[:8], last_only=True)  # first use: weights dequantised
        state = model.new_state()
        start = time.perf_counter()
        for i in range(0, len(prompt), args.chunk):
            logits = model.forward(state, prompt[i:i + args.chunk], last_only=True)
        prefill_s = time.perf_counter() - start
        token = int(logits[-1].argmax())
        start = time.perf_counter()
        for _ in range(args.tokens):
            token = int(model.forward(state, torch.tensor([token]))[-1].argmax())
        decode_s = time.perf_counter() - start
    print(json.dumps({"model": str(_model_dir(args.model)), "device": args.device, "dtype": args.dtype,
                      "prompt_tokens": args.prompt_tokens, "prefill_tok_s": round(args.prompt_tokens / prefill_s, 2),
                      "decode_tokens": args.tokens, "decode_tok_s": round(args.tokens / decode_s, 2),
                      "cpu_threads": torch.get_num_threads()}))
    return 0


# --------------------------------------------------------------------------------------------------- make-tiny
def cmd_make_tiny(args) -> int:
    from dsv41.tiny.model import make_tiny
    out = make_tiny(args.dir, args.format, args.seed)
    print(f"wrote the tiny {args.format} model to {out}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    from dsv41.tiny.model import DEFAULT_FORMAT, FORMATS
    from . import __version__
    parser = OneLineParser(prog="dsv41", description="DeepSeek-V4.1-Flash inference appliance")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="continue a prompt and print tokens/s")
    _model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text (BOS is added unless the text starts with it)")
    p.add_argument("--max-tokens", type=number(int, 1), default=64)
    p.add_argument("--temperature", type=number(float, 0), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=number(float, 0, 1, above=True), default=1.0)
    p.add_argument("--top-k", type=number(int, 0), default=0, help="0 = off (default)")
    p.add_argument("--seed", type=number(int, 0), default=None, help="sampling seed (default: derived from the prompt)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going after the end-of-sentence token")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn in the V4.1 chat encoding (thinking off) and print the reply")
    p.add_argument("--think", action="store_true", help="with --chat: thinking on (the reply starts with reasoning)")
    p.add_argument("--forward", choices=("reference", "fast"), default="reference",
                   help="reference (model/, default) or fast (runtime/ FastModel, as serve on CUDA; implied by "
                        "--prepared)")
    from .prepared.start import add_start_args
    add_start_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("score", help="teacher-forced logits of ids, prefilled in chunks then decoded")
    _model_args(p, model_required=True)
    p.add_argument("--input", required=True, metavar="IN.json", help='{"ids": [...], "chunks": [...]}')
    p.add_argument("--out", required=True, metavar="OUT.safetensors", help="float32 logits [len(ids), vocab]")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("bench", help="prefill and decode tokens/s of the forward (JSON line)")
    _model_args(p)
    p.add_argument("--prompt-tokens", type=number(int, 1), default=256)
    p.add_argument("--chunk", type=number(int, 1), default=128, help="prefill chunk length (default 128)")
    p.add_argument("--tokens", type=number(int, 1), default=32, help="tokens decoded one at a time (default 32)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("make-tiny", help="write the small test model in the real checkpoint formats")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--format", choices=FORMATS, default=DEFAULT_FORMAT)
    p.add_argument("--seed", type=number(int, 0), default=0)
    p.set_defaults(func=cmd_make_tiny)

    for module in ("server.cli", "ops.cli", "engram.cli", "prepared.cli", "hub.cli", "eval.cli", "tiny.train.cli"):
        _register_optional(module, sub)
    return parser


def _register_optional(module: str, sub) -> None:
    """Subcommands of other packages (serve, ops); their heavy imports happen only when they run."""
    import importlib
    import importlib.util
    if importlib.util.find_spec(f"dsv41.{module.split('.')[0]}") is None:
        return
    try:
        mod = importlib.import_module(f"dsv41.{module}")
    except ModuleNotFoundError as e:  # a missing optional dependency must not break the core commands
        if e.name == f"dsv41.{module}":
            return
        print(f"dsv41: {module} commands unavailable ({e})", file=sys.stderr)
        return
    mod.register(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "device", None) is not None:  # generate, score, bench, serve: refused before any load
            resolve_device(args.device)
        return args.func(args) or 0
    except DSV41Error as e:
        print(f"dsv41: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
