"""Time to first token through the real HTTP server, as a user sees it (issues 31 and 34).

The serving stack is the one `dsv41 serve` builds: the serve parser's options, `Startup.check`, then
`server.cli.serve_model(args, startup, sock, model)` (the batched engine over the pool, the starlette app under
hypercorn on 127.0.0.1, a free port, its warm-up token, the SIGTERM drain that parks session entries), here in this
process's main thread with a model the bench supplies:
- CUDA (default where there is one): one full-shape synthetic rank (`runtime/synthetic.py`, rank 0 of TP=2 with
  decode_step.py's StubComm peer, as bench/prefill.py and bench/sessions.py build it; `--layers N`: the first N
  layers). It has no tokenizer of its own: the server gets the tiny model's byte-level BPE tokenizer laid out at
  the real vocabulary size (`tiny.tokenizer.build_tiny_tokenizer(vocab_size=129280)`: placeholders fill the ids the
  BPE does not use, as in the release's tokenizer), so every id the random head samples can be streamed back.
- CPU (`--device cpu`, a smoke test): the built-in tiny model (`--model DIR`: another folder), loaded by serve's
  own `load_serving_model`.
A client thread drives it with the official `openai` client: streaming `/v1/completions` with the prompt as a list
of token ids (the server takes one flat list of ints as `prompt`, checked against the vocabulary), `max_tokens`
(default 8), temperature 0, `ignore_eos` and vLLM's `return_token_ids` (so every sampled token is a chunk, also
one whose text is empty or a partial character, and the reply's ids make turn 2; the first chunk then carries the
prompt's ids too: ~250 KB at 33K ids, 3 ms to encode and 3 ms to parse on a slow CPU), `stream_options.include_usage`.

Measured (TTFT = the request sent -> the first streamed chunk carrying a token; total = -> the end of the stream):
- `prompts`: per `--lengths` (default 8192,32768) one fresh prompt: TTFT, total, prompt tokens/s = length / TTFT,
  decode tokens/s after the first token, `cached_tokens` (0: nothing resumed). Each is preceded by a rehearsal of
  the same length with other ids (`cold_ttft_s`: Triton's compiles and first-use costs land there, not in the
  figure).
- `sessions` (issue 34), on the longest prompt's conversation: turn 2 = turn 1's prompt + its reply + `--new` (256)
  new tokens, its TTFT and `usage.prompt_tokens_details.cached_tokens`:
  - `ram`: on the same server right after turn 1 (resumed from the RAM tier);
  - `nvme`: the server stopped with SIGTERM (the drain parks the RAM tier's entries on `--session-dir`; `park`: the
    stop's seconds, the files' bytes and GB/s), started again on the same folder and the same model (an empty RAM
    tier), a turn 2 with other new tokens (so it resumes from turn 1's parked entry, not from the RAM turn's own);
  - `fresh`: both turns again on a server with `--sessions off` (the whole prompt prefilled), whose tokens the
    resumed turns must equal (`resumed_equals_fresh`, greedy).
  Each turn is also preceded by the same turn of a rehearsal conversation.

Serve flags: `--max-model-len` (the longest turn 2 + slack), `--session-dir` (a temp folder unless `--session-dir`)
and `--session-disk-min-tokens 16` (so the CPU smoke's short entries park too) are set here, and for the restarted
servers `--pool-tokens` of the first one's pages (the same pool for the three measurements; the session files'
tag no longer names the page count, so a pool sized again from free memory would find the entries too); anything after
`--` is passed to `dsv41 serve` as well (e.g. `-- --parallel 1`). `--budget-s`: stages that would start past this many
seconds are skipped and say so. Results are saved after every stage (a run cut short keeps what it measured).

On an H100 (80 GB) the full rank (~98 GiB) does not fit: `--layers 26` builds the first 26 layers; TTFTs are
reported as measured and scaled to 40 layers (`scaled_40_*`: time x 40 / N, an overestimate for the parts that do
not grow with the layers: HTTP, the head, the resume's load).

    # GPU (H100, first 26 layers; ~4-6 min with a cold Triton cache):
    python3 bench/ttft_http.py --layers 26 --budget-s 480 --out bench/results/ttft_http.json
    # CPU smoke run (tiny model):
    python3 bench/ttft_http.py --device cpu --lengths 40,90 --new 20 --out /tmp/ttft_http.json -- --cpu-threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

SERVED_NAME = "dsv41-bench"
READY_TIMEOUT_S = 900.0  # a cold GPU start: the build, the tokenizer, the boot graphs, the warm-up token


def log(*a) -> None:
    print("ttft_http:", *a, flush=True)


def prompt_ids(length: int, salt: int, vocab: int, bos: int = 0) -> list[int]:
    """BOS then `length - 1` ids in [5, vocab - 5) spread by `salt`: two salts share no first page (no session hit
    between them), one salt's shorter prompt is a prefix of its longer one (never used across lengths here)."""
    return [bos] + [((i + 1) * 7919 + salt * 104729) % (vocab - 10) + 5 for i in range(length - 1)]


# ------------------------------------------------------------------------------------------------- the client
def stream_completion(client, ids: list[int], max_tokens: int) -> dict:
    """One streaming /v1/completions of token ids: TTFT, total, the sampled ids and the usage figures."""
    started = time.perf_counter()
    stream = client.completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
    first = None
    tokens: list[int] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            got = (choice.model_extra or {}).get("token_ids") or []
            if (got or choice.text) and first is None:
                first = time.perf_counter() - started
            tokens += got
    total = time.perf_counter() - started
    if first is None or usage is None:
        raise RuntimeError(f"the stream ended without {'a token' if first is None else 'its usage chunk'}")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    res = {"ttft_s": round(first, 4), "total_s": round(total, 4), "prompt_tokens": usage.prompt_tokens,
           "cached_tokens": cached, "prefilled_tokens": usage.prompt_tokens - cached,
           "completion_tokens": usage.completion_tokens, "tokens": tokens}
    if len(tokens) > 1 and total > first:
        res["decode_tokens_per_s"] = round((len(tokens) - 1) / (total - first), 2)
    return res


def rehearsed(client, rehearsal: list[int], measured: list[int], max_tokens: int) -> dict:
    """`measured` after `rehearsal` (same shape, other ids): the rehearsal's TTFT as `cold_ttft_s`."""
    cold = stream_completion(client, rehearsal, max_tokens)
    res = stream_completion(client, measured, max_tokens)
    res["cold_ttft_s"] = cold["ttft_s"]
    res["rehearsal_tokens"] = cold.pop("tokens")
    return res


def health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=30).json()


# ------------------------------------------------------------------------------------------------- the server
class Server:
    """`dsv41 serve`'s serve_model on this process's main thread (its SIGTERM handlers need it) with `model`;
    `drive(url, client)` runs on a client thread once /health is 200, then the thread sends SIGTERM (the drain)."""

    def __init__(self, argv: list[str], model, device: str):
        from dsv41.cli import build_parser
        from dsv41.server.cli import Startup

        self.args = build_parser().parse_args(["serve", *argv])
        self.startup = Startup.check(self.args)
        self.model, self.device = model, device
        self.info = {"argv": argv, "page_tokens": self.args.page_tokens}  # filled in by run()

    def run(self, drive, before_stop=None) -> dict:
        """Serve until `drive` returns (or raises); `info` with the pool's figures, the free memory at the start and
        the stop's seconds (SIGTERM -> stopped). `before_stop()` runs on the client thread right before its SIGTERM."""
        import openai

        from dsv41.server.cli import _bind, serve_model

        info = self.info
        info["free_gib_at_start"] = free_gib(self.device)
        sock = _bind("127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        done = threading.Event()
        outcome: dict = {}

        def client_side() -> None:
            answered = False
            try:
                deadline = time.monotonic() + READY_TIMEOUT_S
                while not done.is_set():
                    try:
                        ready = health(url).get("ok")
                        answered = True  # hypercorn answers: serve_model's signal handlers are installed
                        if ready:
                            break
                    except Exception:  # noqa: BLE001 - not listening yet
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the server was not ready after {READY_TIMEOUT_S:.0f} s")
                    time.sleep(0.2)
                if done.is_set():
                    return
                info["pool"] = pool_figures(health(url))
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
                try:
                    drive(url, client)
                finally:
                    client.close()  # no idle keep-alive connection for hypercorn's graceful stop to wait on
            except BaseException as exc:  # noqa: BLE001 - raised again by the main thread once the server stopped
                log(f"the client side failed: {exc!r}; stopping the server")
                outcome["error"] = exc
            finally:
                if not done.is_set() and (answered or "error" in outcome):
                    if before_stop is not None:
                        before_stop()
                    outcome["sigterm_at"] = time.perf_counter()
                    os.kill(os.getpid(), signal.SIGTERM)

        thread = threading.Thread(target=client_side, name="ttft-client", daemon=True)
        thread.start()
        try:
            serve_model(self.args, self.startup, sock, self.model)
        finally:
            stopped = time.perf_counter()
            done.set()
            thread.join(60)
            release(self.device)
        if "error" in outcome:
            raise outcome["error"]
        if "sigterm_at" in outcome:
            info["stop_s"] = round(stopped - outcome["sigterm_at"], 3)
        return info


def free_gib(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    return round(free / 2 ** 30, 2)


def release(device: str) -> None:
    """What the stopped server held goes (its pool, graphs): the app's start froze every object out of the
    collector's sight (gc.freeze), so unfreeze before collecting."""
    gc.unfreeze()
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def folder_bytes(folder: Path) -> int:
    """Bytes of the session files under `folder` (its rank folders)."""
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*.ses") if p.is_file())


# ------------------------------------------------------------------------------------------------- the model
def build_model(args, work: Path) -> tuple[object, Path, str, dict]:
    """(model, the folder serve reads the tokenizer from, device, figures for the results)."""
    import torch

    if args.device == "cuda":
        from decode_step import StubComm

        from dsv41.runtime.synthetic import real_config, synthetic_rank
        from dsv41.tiny.tokenizer import build_tiny_tokenizer

        folder = work / "tokenizer"
        t0 = time.perf_counter()
        build_tiny_tokenizer(folder, vocab_size=real_config().vocab_size)
        model = synthetic_rank(None, rank=0, world=2, device="cuda", dtype=torch.bfloat16, comm=StubComm(),
                               layers=args.layers, dspark=False)
        torch.cuda.synchronize()
        n = len(model.blocks)
        figures = {"gpu": torch.cuda.get_device_name(), "layers": n, "scale_to_40": model.cfg.num_hidden_layers / n,
                   "build_s": round(time.perf_counter() - t0, 2), "held_gib": round(model.stored_bytes() / 2 ** 30, 2)}
        if n < model.cfg.num_hidden_layers:
            figures["note"] = (f"first {n} of {model.cfg.num_hidden_layers} layers; per-layer times scale by "
                               f"{model.cfg.num_hidden_layers}/{n} (scaled_40_*)")
        return model, folder, "cuda", figures
    from dsv41.server.cli import load_serving_model

    probe = Server(["--device", "cpu", *(["--model", args.model] if args.model else []), *args.serve_flags],
                   None, "cpu")  # the options serve would parse, for its loader
    model = load_serving_model(probe.args, probe.startup, lambda done, total, what: None)
    return model, probe.startup.folder, "cpu", {"gpu": "cpu", "layers": len(model.blocks), "scale_to_40": 1.0,
                                                "note": "the tiny model on the CPU: a smoke run, nothing scaled"}


# ------------------------------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "ttft_http.json")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: the full-shape synthetic rank; cpu: the built-in tiny model (auto: cuda if present)")
    p.add_argument("--layers", type=int, default=None, help="cuda: build the first N layers (an H100 holds 26)")
    p.add_argument("--model", default=None, help="cpu: the model folder (default: the built-in tiny model)")
    p.add_argument("--lengths", default="8192,32768", help="prompt lengths in tokens (the longest: the conversation)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--new", type=int, default=256, help="turn 2's new tokens after turn 1's prompt and reply")
    p.add_argument("--session-dir", type=Path, default=None, help="the NVMe tier's folder (default: a temp folder)")
    p.add_argument("--no-sessions", action="store_true", help="the prompts only")
    p.add_argument("--budget-s", type=float, default=None, help="skip stages that would start past this many s")
    args = p.parse_args(argv)
    args.serve_flags = serve_flags
    import logging

    import torch

    for name in ("httpx", "httpx2"):  # serve's logging setup shows every request of the client at INFO
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="dsv41-ttft-http-"))  # the tokenizer, the session files unless given
    try:
        return run(args, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path, started: float) -> int:
    from sessions import commit

    lengths = [int(v) for v in args.lengths.split(",") if v.strip()]
    serve_flags = args.serve_flags
    session_dir = args.session_dir or work / "sessions"
    model, folder, device, figures = build_model(args, work)
    vocab = model.cfg.vocab_size
    if device == "cpu":
        from dsv41.tokenizer import Tokenizer

        vocab = min(vocab, Tokenizer.from_dir(folder).vocab_size)
    scale = figures["scale_to_40"]
    turn2_len = max(lengths) + args.max_tokens + args.new
    res = {"commit": commit(), **figures, "device": device, "lengths": lengths, "max_tokens": args.max_tokens,
           "new": args.new, "serve_flags": serve_flags, "prompts": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")

    def over_budget() -> bool:
        return args.budget_s is not None and time.perf_counter() - started > args.budget_s

    def scaled(r: dict, length: int | None = None) -> dict:
        r["scaled_40_ttft_s"] = round(r["ttft_s"] * scale, 4)
        if length is not None:
            r["prompt_tokens_per_s"] = round(length / r["ttft_s"], 1)
            r["scaled_40_prompt_tokens_per_s"] = round(length / r["ttft_s"] / scale, 1)
        return r

    max_model_len = turn2_len + args.max_tokens + 64
    base = ["--model", str(folder), "--served-name", SERVED_NAME, "--max-model-len", str(max_model_len)]
    if device == "cpu":
        base += ["--device", "cpu"]
    parking = ["--session-dir", str(session_dir), "--session-disk-min-tokens", "16"]
    on = base + parking + serve_flags
    save()
    longest = max(lengths)
    # conversations: salt 1 = the rehearsal, 2 = the measured one; new-token blocks a (RAM turn) and b (NVMe turn)
    convo = {s: {"turn1": prompt_ids(longest, 10 * lengths.index(longest) + s, vocab)} for s in (1, 2)}
    new = {k: prompt_ids(args.new + 1, salt, vocab)[1:] for k, salt in (("a", 101), ("b", 102))}

    def turn2(s: int, k: str) -> list[int]:
        return convo[s]["turn1"] + convo[s]["reply"] + new[k]

    def first_server(url, client) -> None:
        pool = first.info["pool"]["pages_total"] * first.info["page_tokens"]
        if not args.no_sessions and pool < 3 * turn2_len:  # entries yield their pages to live requests
            log(f"warning: a pool of {pool} tokens holds fewer than two conversations' entries beside a running turn "
                f"({3 * turn2_len}): turn 2 may find its entry evicted (cached_tokens 0; more --parallel or "
                f"--pool-tokens after --)")
        for i, length in enumerate(lengths):
            if over_budget():
                res["prompts"].append({"length": length, "skipped": "budget"})
                continue
            ids = {s: convo[s]["turn1"] if length == longest else prompt_ids(length, 10 * i + s, vocab)
                   for s in (1, 2)}
            r = rehearsed(client, ids[1], ids[2], args.max_tokens)
            if length == longest:
                convo[1]["reply"], convo[2]["reply"] = r["rehearsal_tokens"], r["tokens"]
            res["prompts"].append(scaled({"length": length, **r}, length))
            log(f"prompt {length}: TTFT {r['ttft_s']:.3f} s ({length / r['ttft_s']:.0f} prompt tok/s), total "
                f"{r['total_s']:.3f} s, cached {r['cached_tokens']}; rehearsal TTFT {r['cold_ttft_s']:.3f} s")
            save()
        if args.no_sessions or "reply" not in convo[2] or over_budget():
            return
        r = rehearsed(client, turn2(1, "a"), turn2(2, "a"), args.max_tokens)
        res["sessions"] = {"context": longest, "turn2_tokens": len(turn2(2, "a")), "ram": scaled(r)}
        log(f"turn 2 from RAM: TTFT {r['ttft_s']:.3f} s, cached {r['cached_tokens']} of {r['prompt_tokens']}")
        save()

    def nvme_server(url, client) -> None:
        r = rehearsed(client, turn2(1, "b"), turn2(2, "b"), args.max_tokens)
        r["health_sessions"] = health(url).get("batching", {}).get("sessions")
        res["sessions"]["nvme"] = scaled(r)
        log(f"turn 2 from NVMe after a restart: TTFT {r['ttft_s']:.3f} s, cached {r['cached_tokens']} of "
            f"{r['prompt_tokens']}")
        save()

    def fresh_server(url, client) -> None:
        r = rehearsed(client, turn2(1, "a"), turn2(2, "a"), args.max_tokens)
        other = stream_completion(client, turn2(2, "b"), args.max_tokens)
        res["sessions"]["fresh"] = scaled(r)
        s = res["sessions"]
        s["resumed_equals_fresh"] = {"ram": s["ram"]["tokens"] == r["tokens"]}
        if "nvme" in s:
            s["resumed_equals_fresh"]["nvme"] = s["nvme"]["tokens"] == other["tokens"]
        log(f"turn 2 fresh (sessions off): TTFT {r['ttft_s']:.3f} s; resumed == fresh: {s['resumed_equals_fresh']}")
        save()

    servers = res["servers"] = {}
    parked = {}
    first = Server(on, model, device)
    servers["sessions_on"] = first.info
    first.run(first_server, before_stop=lambda: parked.update(before=folder_bytes(session_dir)))
    if "sessions" in res:
        written = folder_bytes(session_dir) - parked.get("before", 0)
        stop_s = servers["sessions_on"].get("stop_s")
        res["sessions"]["park"] = {"stop_s": stop_s, "bytes": written, "files": len(list(session_dir.rglob("*.ses"))),
                                   "gb_per_s": round(written / stop_s / 1e9, 3) if stop_s else None,
                                   "note": "bytes the stop wrote / (SIGTERM -> stopped: the drain, the parking of "
                                           "the RAM entries newest first, the shutdown): a lower bound of the rate"}
        save()
        # the restarted servers get the first one's pages: the same pool for the three measurements
        pool = ["--pool-tokens", str(first.info["pool"]["pages_total"] * first.info["page_tokens"])]
        for name, argv2, drive in (("nvme_restart", base + parking + pool + serve_flags, nvme_server),
                                   ("sessions_off", base + ["--sessions", "off"] + pool + serve_flags, fresh_server)):
            if over_budget():
                res["sessions"].setdefault("skipped", []).append(name)
                continue
            server = Server(argv2, model, device)
            servers[name] = server.info
            server.run(drive)
            save()
    res["seconds"] = round(time.perf_counter() - started, 1)
    save()
    summary(res)
    return 0


def pool_figures(body: dict) -> dict:
    batching = body.get("batching") or {}
    return {k: batching.get(k) for k in ("slots_total", "pages_total") if k in batching}


def summary(res: dict) -> None:
    log(f"{res['gpu']}, {res['layers']} layers (x{res['scale_to_40']:.2f} to 40)")
    log("length  TTFT s  total s  prompt tok/s  scaled-40 TTFT s  scaled-40 prompt tok/s  cached")
    for r in res["prompts"]:
        if "ttft_s" in r:
            log(f"{r['length']:6} {r['ttft_s']:7.3f} {r['total_s']:8.3f} {r['prompt_tokens_per_s']:13.0f} "
                f"{r['scaled_40_ttft_s']:17.3f} {r['scaled_40_prompt_tokens_per_s']:23.0f} {r['cached_tokens']:7}")
        else:
            log(f"{r['length']:6} skipped ({r['skipped']})")
    s = res.get("sessions")
    if s:
        log(f"turn 2 of the {s['context']}-token conversation ({s['turn2_tokens']} tokens):")
        for k in ("fresh", "ram", "nvme"):
            if k in s:
                log(f"  {k:5}: TTFT {s[k]['ttft_s']:.3f} s (scaled to 40: {s[k]['scaled_40_ttft_s']:.3f} s), "
                    f"cached {s[k]['cached_tokens']}, prefilled {s[k]['prefilled_tokens']}")
        if s.get("skipped"):
            log(f"  skipped (budget): {', '.join(s['skipped'])}")


if __name__ == "__main__":
    sys.exit(main())
