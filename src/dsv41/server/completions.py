"""POST /v1/completions: a raw prompt (text, or one flat list of token ids), or a list of them, continued by the
model: one choice per (prompt, n), in that order; echo + max_tokens 0 scores the prompt."""

from __future__ import annotations

import dataclasses
import time

from ..engine import GenerationRequest, PromptLogprobsEvent, TokenEvent
from .context import ServerContext
from .errors import bad_request
from .grammar_request import structured_grammar
from .generation import (
    StreamedReply,
    Generation,
    reply_of,
    best_of,
    check_request,
    choice_seed,
    draft_of,
    completion_budget,
    prompt_logprobs_list,
    reply_id,
    sampling_params,
    stop_ids,
    submit_generations,
    truncate_prompt,
)
from .reply_text import reply_text
from .protocol import CompletionRequest
from .stop import StopMatcher


def prompt_ids(ctx: ServerContext, prompt, add_special_tokens: bool) -> tuple[list[int], bool]:
    """(ids, whether the server put a BOS in front). Text is tokenized per --prompt-special-tokens: "parse"
    (vLLM's behaviour: control-token spellings become control tokens) or "text" (plain text, like chat
    content). Blocking work: run it through `ctx.run_cpu`."""
    tokenizer = ctx.tokenizer
    if isinstance(prompt, str):
        literal = ctx.config.prompt_special_tokens == "text"
        ids = tokenizer.encode_literal(prompt) if literal else tokenizer.encode_pieces([(prompt, False)])
        if add_special_tokens and (not ids or ids[0] != tokenizer.bos_id):
            return [tokenizer.bos_id] + ids, True
        return ids, False
    vocab = ctx.vocab_size
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab:
            raise bad_request(f"prompt[{i}] = {token} is not a token id (0 <= id < {vocab})", param="prompt")
    return list(prompt), False


async def create_completion(ctx: ServerContext, req: CompletionRequest) -> tuple[Generation, object]:
    """One Generation per (prompt, index < n); choice prompt_index * n + i draws with seed + i (choice_seed). With
    best_of > n, best_of per prompt (seeds seed + i), the n with the highest cumulative logprob returned."""
    prepared = []
    for k, prompt in enumerate(req.prompts):
        ids, added_bos = await ctx.run_cpu(prompt_ids, ctx, prompt, req.add_special_tokens)
        kept = truncate_prompt(ctx, ids, req)
        if len(kept) < len(ids):  # what is echoed and scored is the prompt as the model saw it
            prompt, ids, added_bos = kept, kept, False
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{k}]"
        prepared.append((prompt, ids, added_bos, completion_budget(ctx, len(ids), req.max_tokens, param)))
    check_request(ctx, req, "completions", min(b for *_, b in prepared))
    ranked = best_of(req, len(prepared))  # None: the n choices in seed order; else generate this many, keep n
    grammar = await ctx.run_cpu(lambda: structured_grammar(ctx, req, thinking=False))
    sampling = await ctx.run_cpu(sampling_params, ctx, req)
    stops = stop_ids(ctx, req)
    scoring = req.max_tokens == 0  # echo + max_tokens 0: the prompt scored, nothing generated
    # best_of ranks by the generated tokens' logprobs: asked for (logprobs=0) even when the reply shows none
    logprobs = req.logprobs if req.logprobs is not None or ranked is None else 0
    replies: list[_Reply] = []
    try:
        for prompt, ids, added_bos, budget in prepared:  # each prompt's choices: one engine group
            requests = [GenerationRequest(
                prompt_ids=ids, max_tokens=max(budget, 1), stop_token_ids=stops, ignore_eos=req.ignore_eos,
                sampling=dataclasses.replace(sampling, seed=choice_seed(sampling.seed, i)),
                logprobs=logprobs, grammar=grammar, request_id=reply_id(req, "cmpl"), draft=draft_of(req),
                prompt_logprobs=_prompt_logprobs(req, scoring))
                for i in range(ranked or req.n)]
            for gen in submit_generations(ctx, "completions", requests, stream=req.stream):
                reply = _Reply(ctx, gen, req, prompt)
                # a BOS the server put in front of a text prompt is not part of the echoed text, nor scored
                reply.hidden_prefix = 1 if added_bos else 0
                replies.append(reply)
    except BaseException:
        for reply in replies:
            reply.gen.close()
        raise
    return reply_of(replies, req, sum(len(ids) for _, ids, _, _ in prepared),
                    None if ranked is None else (ranked, req.n))


def _prompt_logprobs(req: CompletionRequest, scoring: bool) -> int | None:
    """How many top logprobs per prompt token the engine computes: for echo + logprobs (OpenAI's) and for vLLM's
    prompt_logprobs, the larger of the two."""
    echoed = (req.logprobs or 0) if scoring else (req.logprobs if req.echo else None)
    asked = [k for k in (echoed, req.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


class _Reply(StreamedReply):
    def __init__(self, ctx: ServerContext, gen: Generation, req: CompletionRequest, prompt):
        self.ctx, self.gen, self.req = ctx, gen, req
        self.created = int(time.time())
        self.model = ctx.response_model_name(req.model)
        self.text = reply_text(ctx.tokenizer, parsed=False, skip_special_tokens=req.skip_special_tokens,
                               stop_token_ids=gen.request.stop_token_ids,
                               include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos)
        self.stop = StopMatcher(req.stop_strings, keep=req.include_stop_str_in_output)
        self.offset = 0
        self.hidden_prefix = 0  # leading prompt tokens the server added (not echoed, not scored)
        self.prompt_logprobs = None  # vLLM's prompt_logprobs, when asked for
        if req.echo:
            self.echo = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt)
        else:
            self.echo = ""

    async def pieces(self):
        """(visible text, logprobs dict or None, finish_reason or None, token ids) per token; the last item has the
        tail text and the finish reason."""
        echo_with_logprobs = bool(self.echo) and self.req.logprobs is not None
        if self.echo and not echo_with_logprobs:
            yield self.echo, None, None, []
        async for event in self.gen.events():
            if isinstance(event, PromptLogprobsEvent):  # comes first, only when echo + logprobs were asked
                if self.req.prompt_logprobs is not None:
                    self.prompt_logprobs = prompt_logprobs_list(self.ctx.tokenizer, self.gen.request.prompt_ids,
                                                                event.entries)
                if echo_with_logprobs:
                    yield self.echo, self._prompt_logprobs(event), None, []
                self.offset = len(self.echo)
                if self.req.max_tokens == 0:  # scoring only: the prompt is all there is
                    yield "", None, "length", []
                    return
                continue
            if not isinstance(event, TokenEvent):
                tail = self.stop.feed(self.text.flush())
                tail += self.stop.flush()
                yield tail, None, event.reason if event.reason != "cancelled" else "stop", []
                return
            visible = self.stop.feed(self.text.feed(event.token_id))
            yield visible, self._logprobs(event, visible), None, [event.token_id]
            if self.stop.stopped:
                yield "", None, "stop", []
                return

    def _prompt_logprobs(self, event: PromptLogprobsEvent) -> dict:
        """OpenAI's echo + logprobs: every prompt token, the first one without a logprob."""
        skip = self.hidden_prefix
        tokens = [self.text.token_string(t) for t in self.gen.request.prompt_ids[skip:]]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        entries = event.entries[skip:]
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [None if lp is None else {self.text.token_string(t): v for t, v in top}
                             for lp, top in entries],
            "text_offset": offsets,
        }

    def _logprobs(self, event: TokenEvent, visible: str) -> dict | None:
        if self.req.logprobs is None:
            return None
        lp = {
            "tokens": [self.text.token_string(event.token_id)],
            "token_logprobs": [event.logprob],
            "top_logprobs": [{self.text.token_string(t): v for t, v in event.top_logprobs}],
            "text_offset": [self.offset],
        }
        self.offset += len(visible)
        return lp

    def _chunk(self, text: str, logprobs, finish_reason, token_ids=None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return {
            "id": self.gen.request.request_id, "object": "text_completion", "created": self.created,
            "model": self.model, "seed": self.gen.request.sampling.seed, "choices": [choice],
        }

    async def _chunks(self):
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        first = True
        async for text, logprobs, finish, token_ids in self.pieces():
            if finish is not None:
                self.gen.done(finish)
                yield self._chunk(text, None, finish, token_ids)
            elif text or logprobs or (token_ids and self.req.return_token_ids):
                chunk = self._chunk(text, logprobs, None, token_ids)
                if first and self.req.return_token_ids:  # vLLM's: the prompt's ids in the first chunk
                    chunk["choices"][0]["prompt_token_ids"] = self.gen.request.prompt_ids
                first = False
                yield chunk
        if include_usage:
            chunk = self._chunk("", None, None)
            chunk["choices"] = []
            chunk["usage"] = self.gen.usage()
            yield chunk

    async def complete(self) -> dict:
        parts, merged, finish, token_ids = [], None, "stop", []
        async for text, logprobs, reason, ids in self.pieces():
            parts.append(text)
            token_ids += ids
            if logprobs is not None:
                if merged is None:
                    merged = {k: [] for k in logprobs}
                for key, values in logprobs.items():
                    merged[key].extend(values)
            if reason is not None:
                finish = reason
        self.gen.done(finish)
        if self.req.logprobs is not None and merged is None:
            merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        body = self._chunk("".join(parts), merged, finish, token_ids)
        choice = body["choices"][0]
        if self.req.return_token_ids:  # vLLM's completions: both lists in the choice
            choice["prompt_token_ids"] = self.gen.request.prompt_ids
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        body["usage"] = self.gen.usage()
        return body
