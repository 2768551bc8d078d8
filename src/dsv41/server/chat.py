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
from ..engine import GenerationRequest, PromptLogprobsEvent, TokenEvent
from dsv41.structured.grammar import GrammarError
from .context import ServerContext
from .errors import bad_request
from .grammar_request import structured_grammar
from .generation import (
    StreamedReply,
    Generation,
    reply_of,
    submit_generations,
    draft_of,
    check_request,
    choice_seed,
    completion_budget,
    prompt_logprobs_list,
    reply_id,
    sampling_params,
    stop_ids,
    truncate_prompt,
    with_reasoning_budget,
)
from .reply_text import reply_text
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
    body = ctx.reasoning_memory.restore(body)  # a reply's reasoning the client dropped from the history
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
    ids = truncate_prompt(ctx, ids, req)
    # the reply starts in reasoning only when the prompt ends in <think> (a continued answer is past </think>)
    thinking = prompt.reply_in_reasoning
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = completion_budget(ctx, len(ids), req.completion_limit, "messages", limit_param)
    check_request(ctx, req, "chat", budget)
    # compiling a grammar can take a while for a big schema: keep it off the event loop
    grammar = await ctx.run_cpu(
        lambda: _tool_grammar(ctx, req, prompt, thinking) or structured_grammar(ctx, req, thinking=thinking))
    grammar = with_reasoning_budget(ctx, grammar, _reasoning_budget(req), thinking)
    top = req.top_logprobs or 0
    sampling = await ctx.run_cpu(sampling_params, ctx, req)
    stops = stop_ids(ctx, req)
    # choice i draws with seed + i (choice_seed): equal to a single request with it; the n choices are one engine
    # group (the prompt prefilled once, its pages shared)
    requests = [GenerationRequest(
        prompt_ids=ids, max_tokens=budget, stop_token_ids=stops, ignore_eos=req.ignore_eos,
        sampling=dataclasses.replace(sampling, seed=choice_seed(sampling.seed, i)),
        logprobs=top if req.logprobs else None, grammar=grammar, request_id=reply_id(req, "chatcmpl"),
        prompt_logprobs=req.prompt_logprobs, draft=draft_of(req))
        for i in range(req.n)]
    gens = submit_generations(ctx, "chat", requests, stream=req.stream)
    try:
        replies = [_ChatReply(ctx, gen, req, prompt) for gen in gens]
    except BaseException:
        for gen in gens:
            gen.close()
        raise
    return reply_of(replies, req, len(ids))


def _reasoning_budget(req: ChatCompletionRequest) -> int | None:
    """vLLM's thinking_token_budget, else the `thinking` object's budget_tokens (Anthropic's spelling, which
    clients also send in DeepSeek's format): how many reasoning tokens before `</think>` is forced."""
    if req.thinking_token_budget is not None:
        return req.thinking_token_budget
    budget = (req.thinking or {}).get("budget_tokens")
    if budget is not None and (type(budget) is not int or budget < 0):
        raise bad_request("thinking.budget_tokens must be a non-negative integer", param="thinking.budget_tokens")
    return budget


class _ChatReply(StreamedReply):
    def __init__(self, ctx: ServerContext, gen: Generation, req: ChatCompletionRequest, prompt):
        self.ctx, self.gen, self.req = ctx, gen, req
        self.created = int(time.time())
        self.model = ctx.response_model_name(req.model)
        # the one rule of every reply (server/reply_text.py): the parser gets EOS and the markup tokens, the other
        # special tokens are hidden unless skip_special_tokens is false
        self.text = reply_text(ctx.tokenizer, parsed=True, skip_special_tokens=req.skip_special_tokens,
                               stop_token_ids=gen.request.stop_token_ids,
                               include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos)
        self.parser = prompt.new_parser()
        gen.reasoning_tokens = 0  # usage.completion_tokens_details: the tokens fed while the parser is in reasoning
        self.stop = StopMatcher(req.stop_strings, keep=req.include_stop_str_in_output)
        self.calls_seen = 0
        self.echo = _echo_text(prompt) if req.echo else ""
        self.prompt_logprobs = None  # vLLM's prompt_logprobs, from the engine's first event when asked for
        # what the reasoning memory keeps of the reply: all its reasoning (shown or not), call ids, content
        self.reasoning_seen: list[str] = []
        self.call_ids: list[str] = []
        self.content_sent: list[str] = []

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
        """Parser events -> OpenAI delta dicts (stop strings applied to content; reasoning left out when the
        request says include_reasoning: false)."""
        deltas: list[dict] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                self.reasoning_seen.append(ev.text)
                if self.req.include_reasoning:
                    deltas.append({"reasoning_content": ev.text, "reasoning": ev.text})
            elif isinstance(ev, ContentDelta):
                visible = self.stop.feed(ev.text)
                if visible:
                    deltas.append({"content": visible})
                    self.content_sent.append(visible)
                if self.stop.stopped:
                    break
            elif isinstance(ev, ToolCallStart):
                self.calls_seen += 1
                self.call_ids.append(ev.id)
                deltas.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ToolCallArgumentsDelta):
                deltas.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
            elif isinstance(ev, (ToolCallEnd, Finished)):
                pass
        return deltas

    async def steps(self):
        """(deltas, logprob entries, finish_reason or None, token ids) per engine event."""
        if self.echo:
            yield [{"content": self.echo}], [], None, []
        async for event in self.gen.events():
            if isinstance(event, PromptLogprobsEvent):
                self.prompt_logprobs = prompt_logprobs_list(self.ctx.tokenizer, self.gen.request.prompt_ids,
                                                            event.entries)
            elif isinstance(event, TokenEvent):
                self.gen.reasoning_tokens += self.parser.in_reasoning  # `</think>` itself counts
                deltas = self._deltas(self.parser.feed(self.text.feed(event.token_id)))
                entries = self._logprob_entries(event)
                if self.stop.stopped:
                    yield deltas, entries, "stop", [event.token_id]
                    return
                yield deltas, entries, None, [event.token_id]
            else:
                # a tool call cut here is dropped (the parser never showed it: hold_calls), nothing invented
                cut = event.reason == "length"
                tail = self._deltas(self.parser.feed(self.text.flush()) + self.parser.finish(truncated=cut))
                if not self.stop.stopped:
                    rest = self.stop.flush()
                    if rest:
                        tail.append({"content": rest})
                        self.content_sent.append(rest)
                self.ctx.reasoning_memory.remember("".join(self.reasoning_seen), self.call_ids,
                                                   "".join(self.content_sent))
                yield tail, [], self._finish_reason(event.reason), []
                return

    def _finish_reason(self, engine_reason: str) -> str:
        if engine_reason == "length":
            return "length"
        return "tool_calls" if self.calls_seen else "stop"

    def _chunk(self, delta: dict, entries: list[dict] | None, finish_reason, token_ids=None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": entries} if entries else None,
                  "finish_reason": finish_reason}
        if self.req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return {"id": self.gen.request.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "seed": self.gen.request.sampling.seed, "choices": [choice]}

    async def _chunks(self):
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        first = self._chunk({"role": "assistant", "content": ""}, None, None)
        if self.req.return_token_ids:
            first["prompt_token_ids"] = self.gen.request.prompt_ids
        yield first
        async for deltas, entries, finish, token_ids in self.steps():
            if finish is not None:
                for i, delta in enumerate(deltas):
                    yield self._chunk(delta, None, None, token_ids if i == 0 else [])
                self.gen.done(finish)
                yield self._chunk({}, entries, finish, [] if deltas else token_ids)
                break
            if not deltas and (entries or (token_ids and self.req.return_token_ids)):
                deltas = [{}]
            for i, delta in enumerate(deltas):
                yield self._chunk(delta, entries if i == 0 else None, None, token_ids if i == 0 else [])
        if include_usage:
            chunk = self._chunk({}, None, None)
            chunk["choices"] = []
            chunk["usage"] = self.gen.usage()
            yield chunk

    async def complete(self) -> dict:
        content, reasoning, calls, entries, finish, token_ids = [], [], {}, [], "stop", []
        async for deltas, step_entries, reason, step_ids in self.steps():
            entries += step_entries
            token_ids += step_ids
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
        tool_calls = [calls[i] for i in sorted(calls)] or None
        # content is null only beside tool calls or reasoning (OpenAI's and vLLM's shape); a reply with neither
        # (thinking off, nothing written) has the empty string
        message = {
            "role": "assistant",
            "content": "".join(content) or (None if tool_calls or reasoning_text else ""),
            "reasoning_content": reasoning_text,
            "reasoning": reasoning_text,
            "tool_calls": tool_calls,
        }
        if message["tool_calls"] is None:
            del message["tool_calls"]
        choice = {"index": 0, "message": message, "logprobs": {"content": entries} if self.req.logprobs else None,
                  "finish_reason": finish}
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        body = {"id": self.gen.request.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "seed": self.gen.request.sampling.seed, "choices": [choice],
                "usage": self.gen.usage()}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.gen.request.prompt_ids
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs
        return body


def _echo_text(prompt) -> str:
    """vLLM's chat `echo`: the reply starts with the final message when it is the assistant's (the answer being
    continued); otherwise there is nothing to echo."""
    last = prompt.messages[-1]
    if last["role"] != "assistant" or not prompt.continue_final_message:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        content = "\n\n".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content
