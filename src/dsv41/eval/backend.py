"""What the parts run their prompts through: the engine in this process, or a running server over HTTP.

Both take `Query`s (token ids in, greedy) and give `Answer`s, so a part never knows which one it talks to:

- `EngineBackend` loads the model as `dsv41 serve` does (`server.cli.load_serving_model`: the same forward, the
  same DSpark choice) and drives the engine `--engine` names (batched by default) through its async interface,
  every query of a part submitted at once (at most `--max-waiting` in flight), as the server would see them.
- `ServerBackend` sends each query to `POST /v1/completions` as a list of token ids (vLLM's `prompt_logprobs`,
  `allowed_token_ids` and this server's `draft` extensions), several at a time: the way to evaluate a deployment
  that only runs as a server (`--tp 2` on two Sparks). Token ids are encoded here, with the tokenizer of `--model`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import DSV41Error


@dataclass(frozen=True)
class Query:
    prompt_ids: list[int]
    max_tokens: int
    allowed_ids: tuple[int, ...] | None = None  # the reply's tokens restricted to these (MMLU's letters)
    prompt_logprobs: int | None = None  # top logprobs per prompt position (agreement)
    draft: int | None = None  # None: the engine's default; 0: off; k: at most k drafts a round


@dataclass
class Answer:
    text: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0
    # per prompt position: None for the first, else {id: logprob} of the top ones (plus the prompt's own token)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    tokens_per_round: float | None = None  # drafting: decode tokens per engine round (in-process only)
    seconds: float = 0.0
    error: str | None = None  # the query failed (engine or HTTP error); the part reports it and goes on


def progress(total: int, desc: str):
    """A tqdm bar on stderr, drawn only in a terminal (pipes and CI logs get nothing)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)


class EngineBackend:
    """The model loaded in this process behind the engine the server would run (options as `dsv41 serve`'s)."""

    kind = "engine"

    def __init__(self, args, folder: Path, tokenizer, log=None):
        from ..compose.build import build_engine
        from ..server.cli import Startup, check_engine_limits, load_serving_model, serving_max_model_len

        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        check_engine_limits(args)
        engram_dir = Path(args.engram_dir) if getattr(args, "engram_dir", None) else None
        from ..cli import LoadBar

        model = load_serving_model(args, Startup(folder, None, engram_dir), LoadBar().update)
        self.max_model_len = serving_max_model_len(args, model)
        self.tokenizer = tokenizer
        self.engine = build_engine(args, model, max_model_len=self.max_model_len, encode_text=tokenizer.encode,
                                   log=self.log)
        self.max_in_flight = max(1, int(getattr(args, "max_waiting", 64)) // 2)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.engine.start())

    def run(self, queries: list[Query], desc: str = "") -> list[Answer]:
        return self.loop.run_until_complete(self._run_all(queries, desc))

    def drafting_figures(self) -> dict | None:
        """The batched engine's drafting counters (vLLM's spec-decode figures per drafter), None without them."""
        detail = self.engine.stats().detail
        return detail.get("drafting") if detail else None

    async def _run_all(self, queries: list[Query], desc: str) -> list[Answer]:
        gate = asyncio.Semaphore(self.max_in_flight)
        with progress(len(queries), desc) as bar:
            async def one(query: Query) -> Answer:
                async with gate:
                    answer = await self._run_one(query)
                bar.update(1)
                return answer

            return list(await asyncio.gather(*(one(q) for q in queries)))

    async def _run_one(self, query: Query) -> Answer:
        import time

        from ..engine import FinishEvent, GenerationRequest, PromptLogprobsEvent, SamplingParams, TokenEvent

        sampling = SamplingParams(temperature=0.0, allowed_token_ids=query.allowed_ids)
        request = GenerationRequest(prompt_ids=list(query.prompt_ids), max_tokens=query.max_tokens,
                                    sampling=sampling, stop_token_ids=frozenset({self.tokenizer.eos_id}),
                                    prompt_logprobs=query.prompt_logprobs, draft=query.draft)
        answer, tokens, start = Answer(), [], time.perf_counter()
        if len(query.prompt_ids) >= self.max_model_len:  # what the server answers 400 for
            answer.error = (f"a prompt of {len(query.prompt_ids)} tokens leaves no room for a reply within "
                            f"--max-model-len {self.max_model_len}")
            return answer
        try:
            stream = self.engine.submit(request)
            async for event in stream:
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                elif isinstance(event, PromptLogprobsEvent):
                    answer.prompt_logprobs = [None if chosen is None else dict(top)
                                              for chosen, top in event.entries]
                elif isinstance(event, FinishEvent):
                    answer.finish_reason = event.reason
                    answer.tokens_per_round = event.tokens_per_round
        except Exception as exc:  # an engine failure or refusal is this query's result, not the run's end
            answer.error = f"{type(exc).__name__}: {exc}"
        answer.seconds = time.perf_counter() - start
        answer.completion_tokens = len(tokens)
        answer.text = self.tokenizer.decode([t for t in tokens if t != self.tokenizer.eos_id],
                                            skip_special_tokens=True)
        return answer

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


class ServerBackend:
    """A running `dsv41 serve` (or any server with vLLM's completion extensions) at `url`."""

    kind = "server"

    def __init__(self, url: str, api_key: str | None = None, concurrency: int = 4, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.api_key = api_key
        self.concurrency = max(1, concurrency)
        self.timeout_s = timeout_s
        models = self._request("GET", "/v1/models")
        try:
            self.model_name = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise DSV41Error(f"--url {url}: /v1/models lists no model") from None
        self.max_model_len = models["data"][0].get("max_model_len")

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise DSV41Error(f"{method} {self.url}{path}: HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise DSV41Error(f"{method} {self.url}{path}: {getattr(exc, 'reason', exc)}") from None

    def run(self, queries: list[Query], desc: str = "") -> list[Answer]:
        with progress(len(queries), desc) as bar, ThreadPoolExecutor(self.concurrency) as pool:
            def one(query: Query) -> Answer:
                answer = self._run_one(query)
                bar.update(1)
                return answer

            return list(pool.map(one, queries))

    def _run_one(self, query: Query) -> Answer:
        import time

        body = {"model": self.model_name, "prompt": list(query.prompt_ids), "max_tokens": query.max_tokens,
                "temperature": 0.0}
        if query.allowed_ids is not None:
            body["allowed_token_ids"] = list(query.allowed_ids)
        if query.prompt_logprobs is not None:
            body["prompt_logprobs"] = query.prompt_logprobs
        if query.draft is not None:
            body["draft"] = query.draft
        answer, start = Answer(), time.perf_counter()
        try:
            reply = self._request("POST", "/v1/completions", body)
            choice = reply["choices"][0]
            answer.text = choice.get("text") or ""
            answer.finish_reason = choice.get("finish_reason") or ""
            answer.completion_tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
            if query.prompt_logprobs is not None:
                answer.prompt_logprobs = [None if row is None else logprob_row(row)
                                          for row in choice.get("prompt_logprobs") or []]
        except DSV41Error as exc:
            answer.error = str(exc)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            answer.error = f"malformed reply: {exc}"
        answer.seconds = time.perf_counter() - start
        return answer

    def drafting_figures(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


def logprob_row(row: dict) -> dict[int, float]:
    """One position of vLLM's `prompt_logprobs` ({id: {"logprob": x, ...}} or {id: x}) as {id: logprob}."""
    out = {}
    for key, value in row.items():
        out[int(key)] = float(value["logprob"] if isinstance(value, dict) else value)
    return out

