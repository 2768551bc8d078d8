"""vLLM's `add_generation_prompt` (chat, /tokenize) and `return_token_strs` (/tokenize): the rendered prompt's
token ids change exactly as specified, and a request with them works through the real server with the official
`openai` client."""

from __future__ import annotations

import pytest

from dsv41.chat import build_chat_prompt
from dsv41.chat.errors import RequestError
from dsv41.chat.tokens import ASSISTANT, THINK_END, THINK_START
from server_harness import SERVED_NAME, client, server, tokenizer  # noqa: F401  (shared fixtures)

USER_TURN = [{"role": "user", "content": "What is 12 times 12?"}]
TOOL_TURN = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def _ids(server, body: dict) -> list[int]:  # noqa: F811
    with server.http() as http:
        r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("messages", [USER_TURN, TOOL_TURN], ids=["user", "tool-result"])
def test_no_generation_prompt_drops_exactly_the_header(server, tokenizer, messages, thinking):  # noqa: F811
    kwargs = {"chat_template_kwargs": {"thinking": thinking}}
    default = _ids(server, {"messages": messages, **kwargs})
    explicit = _ids(server, {"messages": messages, "add_generation_prompt": True, **kwargs})
    without = _ids(server, {"messages": messages, "add_generation_prompt": False, **kwargs})
    header = [tokenizer.special(ASSISTANT), tokenizer.special(THINK_START if thinking else THINK_END)]
    assert explicit == default
    assert default == without + header  # the same ids, less the two header tokens at the end
    # the same through the chat renderer
    prompt = build_chat_prompt({"messages": messages, "add_generation_prompt": False, **kwargs})
    assert not prompt.prompt.endswith(ASSISTANT + (THINK_START if thinking else THINK_END))
    assert not prompt.reply_in_reasoning
    assert build_chat_prompt({"messages": messages, **kwargs}).reply_in_reasoning == thinking


def test_final_assistant_message_and_continue(server):  # noqa: F811
    history = USER_TURN + [{"role": "assistant", "content": "It is"}]
    # a complete final assistant turn has no header after it either way
    assert _ids(server, {"messages": history, "add_generation_prompt": False}) == _ids(server, {"messages": history})
    continued = _ids(server, {"messages": history, "continue_final_message": True, "add_generation_prompt": False})
    assert continued == _ids(server, {"messages": history, "continue_final_message": True})
    with pytest.raises(RequestError) as info:  # vLLM refuses the pair too
        build_chat_prompt({"messages": history, "continue_final_message": True, "add_generation_prompt": True})
    assert info.value.param == "add_generation_prompt"
    with server.http() as http:
        for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 2})):
            r = http.post(path, json={"messages": history, "continue_final_message": True,
                                      "add_generation_prompt": True, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt", r.text
        r = http.post("/tokenize", json={"messages": USER_TURN, "add_generation_prompt": "no"})
        assert r.status_code == 400


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_generation_prompt_end_to_end(client, server, stream):  # noqa: F811
    body = {"messages": USER_TURN, "add_generation_prompt": False}
    prompt_len = len(_ids(server, body))
    extra = {"add_generation_prompt": False, "chat_template_kwargs": {"thinking": True}}
    if not stream:
        reply = client.chat.completions.create(model=SERVED_NAME, messages=USER_TURN, max_tokens=5, temperature=0,
                                               extra_body=extra)
        assert reply.usage.prompt_tokens == prompt_len
        assert reply.usage.completion_tokens >= 1
        # no <think> was opened for it: whatever the model writes is content, never reasoning
        assert getattr(reply.choices[0].message, "reasoning_content", None) is None
        return
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=USER_TURN, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra))
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    # honoured, so never logged as an ignored field
    assert "chat: the request field 'add_generation_prompt'" not in server.output()


def test_return_token_strs(server, tokenizer):  # noqa: F811
    with server.http() as http:
        plain = http.post("/tokenize", json={"prompt": "The keeper wrote"}).json()
        assert plain["token_strs"] is None
        text = http.post("/tokenize", json={"prompt": "The keeper wrote", "return_token_strs": True}).json()
        chat = http.post("/tokenize", json={"messages": USER_TURN, "return_token_strs": True}).json()
        bad = http.post("/tokenize", json={"prompt": "x", "return_token_strs": 1})
    assert text["tokens"] == plain["tokens"]
    for reply in (text, chat):
        assert reply["token_strs"] == [tokenizer.id_to_token(i) for i in reply["tokens"]]
        assert len(reply["token_strs"]) == reply["count"]
    assert text["token_strs"][0] == tokenizer.id_to_token(tokenizer.bos_id)
    assert "Ġkeeper" in text["token_strs"] or any(s.startswith("Ġ") for s in text["token_strs"])  # byte-level form
    assert chat["token_strs"][-2:] == [ASSISTANT, THINK_START]
    assert bad.status_code == 400
