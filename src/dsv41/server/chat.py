"""POST /v1/chat/completions: V4.1 encoding in, reasoning / content / DSML tool calls out.

The prompt comes from `dsv41.chat.build_chat_prompt` (the official encoding; effort and thinking rules), the
reply goes through `dsv41.chat.StreamParser` token by token. Grammars (xgrammar) enforce `tool_choice`
required / named and `response_format` / `structured_outputs`, after `</think>` when thinking. Stop strings cut
the visible answer only, never reasoning or tool-call text.
"""

from __future__ import annotations

import dataclasses
import time

from ..chat import (
    ContentDelta,
    Finished,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    build_chat_prompt,
)
from ..chat.errors import RequestError
from ..engine import GenerationRequest, TokenEvent
from dsv41.structured.grammar import GrammarError
from .context import ServerContext
from .errors import bad_request
from .generation import (
    StreamedReply,
    Generation,
    reply_of,
    submit_generations,
    draft_of,
    TokenText,
    check_request,
    choice_seed,
    completion_budget,
    new_id,
    sampling_params,
    stop_ids,
    structured_grammar,
    usage,
)
from .protocol import ChatCompletionRequest
from .stop import StopMatcher


def _refuse_images(body: dict) -> None:
    """The encoder can place image placeholders, but this server runs the text model only: a reply about an
    image the model never saw would be invented, so such requests are refused."""
    from ..chat.encoding import IMAGE_PART_TYPES

    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise bad_request("image inputs are not supported: this server runs the text model only",
                                  param=f"messages[{i}].content[{j}]")


def render_chat(ctx: ServerContext, body: dict):
    """(ChatPrompt, prompt ids) exactly as a chat request renders them (also used by /tokenize).

    Blocking work (a long conversation): run it through `ctx.run_cpu`. Message content is tokenized as plain
    text, so a control token spelled in it cannot forge a turn (Tokenizer.encode_pieces)."""
    _refuse_images(body)
    try:
        prompt = build_chat_prompt(body)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return prompt, ctx.tokenizer.encode_pieces(prompt.pieces)


def _tool_grammar(ctx: ServerContext, req: ChatCompletionRequest, prompt, thinking: bool):
    choice = prompt.tool_choice
    if choice in ("none", "auto") or not prompt.tools:
        return None
    if isinstance(choice, dict) and (req.response_format or req.structured_outputs or req.guided_json):
        raise bad_request("a named tool_choice cannot be combined with structured outputs", param="tool_choice")
    try:
        return ctx.grammars.tool_calls(prompt.tools, choice, parallel=req.parallel_tool_calls, thinking=thinking)
    except GrammarError as exc:
        raise bad_request(str(exc), param="tools") from None


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, body: dict):
    prompt, ids = await ctx.run_cpu(render_chat, ctx, body)
    # the reply starts in reasoning only when the prompt ends in <think> (a continued answer is past </think>)
    thinking = prompt.reply_in_reasoning
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = completion_budget(ctx, len(ids), req.completion_limit, "messages", limit_param)
    check_request(ctx, req, "chat", budget)
    # compiling a grammar can take a while for a big schema: keep it off the event loop
    grammar = await ctx.run_cpu(
        lambda: _tool_grammar(ctx, req, prompt, thinking) or structured_grammar(ctx, req, thinking=thinking))
    top = req.top_logprobs or 0
    sampling = await ctx.run_cpu(sampling_params, ctx, req)
    stops = stop_ids(ctx, req)
    # choice i draws with seed + i (choice_seed): equal to a single request with it; the n choices are one engine
    # group (the prompt prefilled once, its pages shared)
    requests = [GenerationRequest(
        prompt_ids=ids, max_tokens=budget, stop_token_ids=stops, ignore_eos=req.ignore_eos,
        sampling=dataclasses.replace(sampling, seed=choice_seed(sampling.seed, i)),
        logprobs=top if req.logprobs else None, grammar=grammar, request_id=new_id("chatcmpl"), draft=draft_of(req))
        for i in range(req.n)]
    gens = submit_generations(ctx, "chat", requests, stream=req.stream)
    try:
        replies = [_ChatReply(ctx, gen, req, prompt) for gen in gens]
    except BaseException:
        for gen in gens:
            gen.close()
        raise
    return reply_of(replies, req, len(ids))


class _ChatReply(StreamedReply):
    def __init__(self, ctx: ServerContext, gen: Generation, req: ChatCompletionRequest, prompt):
        self.ctx, self.gen, self.req = ctx, gen, req
        self.created = int(time.time())
        self.model = ctx.response_model_name(req.model)
        # the parser needs every marker (EOS, </think>, DSML), so the decoder skips nothing; skip_special_tokens
        # hides the other special tokens (<｜User｜>, place-holders, ...) instead. A stop_token_ids id other than EOS
        # is not shown (unless include_stop_str_in_output), as in completions
        eos = ctx.tokenizer.eos_id
        hidden = frozenset() if req.include_stop_str_in_output or req.ignore_eos else \
            gen.request.stop_token_ids - {eos}
        if req.skip_special_tokens:
            hidden |= {i for i, tok in ctx.tokenizer.added_tokens.items() if tok.special and i != eos}
        self.text = TokenText(ctx, skip_special_tokens=False, hidden_ids=frozenset(hidden))
        self.parser = prompt.new_parser()
        self.stop = StopMatcher(req.stop_strings, keep=req.include_stop_str_in_output)
        self.calls_seen = 0

    def _logprob_entries(self, event: TokenEvent) -> list[dict]:
        if not self.req.logprobs:
            return []
        t = self.text
        return [{
            "token": t.token_string(event.token_id), "logprob": event.logprob,
            "bytes": t.token_bytes(event.token_id),
            "top_logprobs": [{"token": t.token_string(i), "logprob": v, "bytes": t.token_bytes(i)}
                             for i, v in event.top_logprobs],
        }]

    def _deltas(self, events) -> list[dict]:
        """Parser events -> OpenAI delta dicts (stop strings applied to content)."""
        deltas: list[dict] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                deltas.append({"reasoning_content": ev.text, "reasoning": ev.text})
            elif isinstance(ev, ContentDelta):
                visible = self.stop.feed(ev.text)
                if visible:
                    deltas.append({"content": visible})
                if self.stop.stopped:
                    break
            elif isinstance(ev, ToolCallStart):
                self.calls_seen += 1
                deltas.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ToolCallArgumentsDelta):
                deltas.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
            elif isinstance(ev, (ToolCallEnd, Finished)):
                pass
        return deltas

    async def steps(self):
        """(deltas, logprob entries, finish_reason or None) per engine event."""
        async for event in self.gen.events():
            if isinstance(event, TokenEvent):
                deltas = self._deltas(self.parser.feed(self.text.feed(event.token_id)))
                entries = self._logprob_entries(event)
                if self.stop.stopped:
                    yield deltas, entries, "stop"
                    return
                yield deltas, entries, None
            else:
                cut = event.reason == "length"  # a tool call cut here keeps what was written, nothing invented
                tail = self._deltas(self.parser.feed(self.text.flush()) + self.parser.finish(truncated=cut))
                if not self.stop.stopped:
                    rest = self.stop.flush()
                    if rest:
                        tail.append({"content": rest})
                yield tail, [], self._finish_reason(event.reason)
                return

    def _finish_reason(self, engine_reason: str) -> str:
        if engine_reason == "length":
            return "length"
        return "tool_calls" if self.calls_seen else "stop"

    def _chunk(self, delta: dict, entries: list[dict] | None, finish_reason) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": entries} if entries else None,
                  "finish_reason": finish_reason}
        return {"id": self.gen.request.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "seed": self.gen.request.sampling.seed, "choices": [choice]}

    async def _chunks(self):
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        yield self._chunk({"role": "assistant", "content": ""}, None, None)
        async for deltas, entries, finish in self.steps():
            if finish is not None:
                for delta in deltas:
                    yield self._chunk(delta, None, None)
                self.gen.done(finish)
                yield self._chunk({}, entries, finish)
                break
            if not deltas and entries:
                deltas = [{}]
            for i, delta in enumerate(deltas):
                yield self._chunk(delta, entries if i == 0 else None, None)
        if include_usage:
            chunk = self._chunk({}, None, None)
            chunk["choices"] = []
            chunk["usage"] = usage(self.gen.prompt_tokens, self.gen.completion_tokens)
            yield chunk

    async def complete(self) -> dict:
        content, reasoning, calls, entries, finish = [], [], {}, [], "stop"
        async for deltas, step_entries, reason in self.steps():
            entries += step_entries
            for delta in deltas:
                if "content" in delta:
                    content.append(delta["content"])
                if "reasoning_content" in delta:
                    reasoning.append(delta["reasoning_content"])
                for call in delta.get("tool_calls", []):
                    slot = calls.setdefault(call["index"], {"id": None, "type": "function",
                                                            "function": {"name": "", "arguments": ""}})
                    if "id" in call:
                        slot["id"] = call["id"]
                        slot["function"]["name"] = call["function"]["name"]
                    slot["function"]["arguments"] += call["function"].get("arguments", "")
            if reason is not None:
                finish = reason
        self.gen.done(finish)
        reasoning_text = "".join(reasoning) if reasoning else None
        message = {
            "role": "assistant",
            "content": "".join(content) or None,
            "reasoning_content": reasoning_text,
            "reasoning": reasoning_text,
            "tool_calls": [calls[i] for i in sorted(calls)] or None,
        }
        if message["tool_calls"] is None:
            del message["tool_calls"]
        choice = {"index": 0, "message": message, "logprobs": {"content": entries} if self.req.logprobs else None,
                  "finish_reason": finish}
        return {"id": self.gen.request.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "seed": self.gen.request.sampling.seed, "choices": [choice],
                "usage": usage(self.gen.prompt_tokens, self.gen.completion_tokens)}
