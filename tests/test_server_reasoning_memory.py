"""The reasoning memory (server/reasoning_memory.py, RECIPE.md §1.3): a reply's reasoning remembered by its tool-call
ids and its content, restored into assistant messages that carry no reasoning field, least recently used forgotten;
the client's objects are never changed."""

from dsv41.server.reasoning_memory import ReasoningMemory


def body(*messages):
    return {"model": "m", "messages": list(messages)}


def test_restores_by_call_id_and_by_content_only_where_no_reasoning_was_sent():
    memory = ReasoningMemory()
    memory.remember("think A", ["call_a"], "")
    memory.remember("think B", [], "the answer")
    sent = body({"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a", "type": "function",
                                                                        "function": {"name": "f"}}]},
                {"role": "assistant", "content": "the answer"},
                {"role": "assistant", "content": "the answer", "reasoning_content": ""},  # the client's word
                {"role": "assistant", "content": "other"})
    out = memory.restore(sent)
    got = [m.get("reasoning_content") for m in out["messages"]]
    assert got == [None, "think A", "think B", "", None] and memory.restored_total == 2
    assert "reasoning_content" not in sent["messages"][1] and out is not sent  # the client's body as it was
    assert memory.restore(body({"role": "user", "content": "q"})) is not None


def test_nothing_to_remember_and_the_oldest_go_first():
    memory = ReasoningMemory(capacity=2)
    memory.remember("", ["call_x"], "text")  # no reasoning: nothing kept
    assert len(memory) == 0
    for i in range(3):
        memory.remember(f"r{i}", [f"call_{i}"], "")
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}"}]} for i in range(3)]
    out = memory.restore(body(*msgs))["messages"]
    assert [m.get("reasoning_content") for m in out] == [None, "r1", "r2"]
    unchanged = body({"role": "assistant", "content": "nothing known"})
    assert memory.restore(unchanged) is unchanged
