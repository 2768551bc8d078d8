"""The chat reply's steps -> Responses output items and the typed SSE events the official client parses.

Events, each with its `sequence_number` (from 0): `response.created`, `response.in_progress`; per output item
`response.output_item.added` ... `response.output_item.done`, with in between
- reasoning: `response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta` / `.done`,
  `response.reasoning_summary_part.done` (the model's whole reasoning is the summary text; the item also
  carries it as `content: [{type: reasoning_text}]`);
- message: `response.content_part.added`, `response.output_text.delta` / `.done`, `response.content_part.done`
  (with `include: ["message.output_text.logprobs"]` each delta carries the logprobs of the tokens that wrote it;
  tokens that wrote no answer text, the end of sequence or tool-call markup, have none);
- function_call: `response.function_call_arguments.delta` / `.done`;
then `response.completed`, or `response.incomplete` (`incomplete_details.reason: max_output_tokens`, the last
item `status: incomplete`), carrying the final response object, which is also the non-streaming reply. A failure
past the headers is an `error` event (OpenAI's fields plus an `error` object, which the official client raises as
APIError); the stream has no `[DONE]`, as OpenAI's.
"""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from .context import ServerContext
from .generation import Generation, stream_failure
from .responses_protocol import ResponsesRequest
from .streaming import GenerationStream



def _request_echo(req: ResponsesRequest) -> dict:
    """The request's settings as the response object repeats them."""
    reasoning = req.reasoning
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in req.tools or []]
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
        "service_tier": "default", "store": False, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"}),
                 "verbosity": (req.text.verbosity if req.text and req.text.verbosity else "medium")},
        "tool_choice": req.tool_choice or "auto", "tools": tools, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled", "user": req.user, "background": False,
    }


class ResponseEvents:
    """One response's events from the chat reply's `steps()` (deltas per engine token, then the finish)."""

    def __init__(self, ctx: ServerContext, gen: Generation, reply, req: ResponsesRequest, *, thinking: bool):
        self.gen, self.reply = gen, reply
        self.id = "resp_" + gen.request.request_id.rsplit("-", 1)[-1]
        self.model = ctx.response_model_name(req.model)
        self.created_at = int(time.time())
        self.echo = _request_echo(req)
        self.in_reasoning = thinking
        self.logprobs: list[dict] = []  # the answer's token logprobs not yet shown with text (include ... logprobs)
        self.reasoning_tokens = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.sequence = 0

    # -- the response object ---------------------------------------------------------------------------------
    def _response(self, status: str, *, final: bool = False) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": list(self.output),
                **self.echo, "usage": None}
        if final:
            body["completed_at"] = int(time.time())
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            prompt, generated, cached = self.gen.prompt_tokens, self.gen.completion_tokens, self.gen.cached_tokens
            body["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                             "output_tokens": generated,
                             "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                             "total_tokens": prompt + generated}
        return body

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    # -- items -----------------------------------------------------------------------------------------------
    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _start(self, item: dict) -> list[dict]:
        events = self._close("completed")
        self.output.append(item)
        self.open = item
        empty = {key: [] for key in ("summary", "content") if isinstance(item.get(key), list)}
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=dict(item, **empty)))  # the parts come with their own events
        if item["type"] == "reasoning":
            events.append(self._event("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                      part={"type": "summary_text", "text": ""}))
        elif item["type"] == "message":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return events

    def _close(self, status: str) -> list[dict]:
        item = self.open
        if item is None:
            return []
        events, where = [], self._where()
        if item["type"] == "reasoning":
            text = item["summary"][0]["text"]
            events += [self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                       self._event("response.reasoning_summary_part.done", **where, summary_index=0,
                                   part={"type": "summary_text", "text": text})]
        elif item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                   logprobs=part["logprobs"]),
                       self._event("response.content_part.done", **where, content_index=0, part=dict(part))]
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        item["status"] = status
        self.open = None
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _reasoning(self, text: str) -> list[dict]:
        events = [] if self.open is not None and self.open["type"] == "reasoning" else self._start(
            {"id": "rs_" + self.id[5:] + f"_{len(self.output)}", "type": "reasoning", "status": "in_progress",
             "summary": [{"type": "summary_text", "text": ""}], "content": [{"type": "reasoning_text", "text": ""}],
             "encrypted_content": None})
        self.open["summary"][0]["text"] += text
        self.open["content"][0]["text"] += text
        return events + [self._event("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                                     delta=text)]

    def _text(self, text: str) -> list[dict]:
        events = [] if self.open is not None and self.open["type"] == "message" else self._start(
            {"id": "msg_" + self.id[5:] + f"_{len(self.output)}", "type": "message", "role": "assistant",
             "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []}]})
        self.open["content"][0]["text"] += text
        logprobs, self.logprobs = self.logprobs, []
        self.open["content"][0]["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                     logprobs=logprobs)]

    def _call(self, call: dict) -> list[dict]:
        function = call["function"]
        self.logprobs = []  # tokens of a call are no answer text (nor the markup held back before it)
        if "id" in call:  # a new call: its name is complete
            return self._start({"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
                                "status": "in_progress", "call_id": call["id"], "name": function["name"],
                                "arguments": ""})
        fragment = function.get("arguments", "")
        if not fragment or self.open is None or self.open["type"] != "function_call":
            return []
        self.open["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", **self._where(), delta=fragment)]

    def _deltas(self, deltas: list[dict]) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls", []):
                events += self._call(call)
        return events

    def _count(self, deltas: list[dict], logprobs: list[dict]) -> None:
        """reasoning_tokens: the tokens generated before the answer (text or a call) began, `</think>` included;
        the answer's logprobs wait for the text they belong to (a token may complete a character later)."""
        if self.in_reasoning and any(d.get("content") or d.get("tool_calls") for d in deltas):
            self.in_reasoning = False
        if self.in_reasoning:
            self.reasoning_tokens += 1
        else:
            self.logprobs += logprobs

    # -- the whole stream ------------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        finish = "stop"
        async for deltas, logprobs, reason, _ids in self.reply.steps():
            if reason is None:
                self._count(deltas, logprobs)
            for event in self._deltas(deltas):
                yield event
            if reason is not None:
                finish = reason
                break
        status = "incomplete" if finish == "length" else "completed"
        for event in self._close(status):
            yield event
        self.gen.done(finish)
        yield self._event(f"response.{status}", response=self._response(status, final=True))

    async def complete(self) -> dict:
        """The non-streaming reply: the final response object of the same events."""
        final = None
        async for event in self.events():
            final = event.get("response", final)
        return final


def _sse(payload: dict) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")


async def _sse_body(gen: Generation, events: ResponseEvents) -> AsyncIterator[bytes]:
    try:
        async for event in events.events():
            yield _sse(event)
    except Exception as exc:  # past the headers: an `error` event, which the official client raises
        error = stream_failure(exc, "a response")
        gen.fail(error)
        body = error.body()
        yield _sse(events._event("error", code=error.code or error.type, message=error.message, param=error.param,
                                 error=body["error"]))


class ResponseStream(GenerationStream):
    """A GenerationStream (the app settles it when it ends) with the Responses API's typed events."""

    def __init__(self, gen: Generation, events: ResponseEvents):
        StreamingResponse.__init__(self, _sse_body(gen, events), media_type="text/event-stream",
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen
        self._on_close = lambda: None
