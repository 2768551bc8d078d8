"""`dsv41 eval tools` (issue 36): tool-call chains through a real `dsv41 serve` subprocess and the official openai
client, thinking off and on. The random tiny model makes no useful call: the harness must report that (every
chain run, none completed, no error) rather than crash. The judging itself is checked on scripted calls: the
expected chain completes, a wrong order, a malformed call or a wrong answer does not."""

from __future__ import annotations

import json

import pytest

from dsv41.eval import tools

from server_harness import server  # noqa: F401  (the session's shared server)


def test_chains_through_the_real_server_are_reported(server):  # noqa: F811
    # one chain per mode: a ~900-token tool prompt takes seconds to prefill on one CPU thread
    result = tools.evaluate(server.url, server.api_key, steps=2, modes=(False, True), max_tokens=8,
                            only=["key-chain"])
    assert result["model"] == "dsv41-tiny" and result["tool_choice"] == "auto"
    assert len(result["chains"]) == 2 and set(result["thinking"]) == {"off", "on"}
    for mode in result["thinking"].values():
        assert mode["chains"] == 1 and mode["errors"] == 0
        assert 0 <= mode["completed"] <= mode["chains"] and 0 <= mode["well_formed"] <= mode["calls"]
        assert mode["steps"] == 2 and 0 <= mode["steps_matched"] <= mode["steps"]
    for chain in result["chains"]:
        assert chain["turns"] >= 1 and "error" not in chain
        assert chain["completed"] == (chain["steps_matched"] == chain["steps"] and chain["answer_correct"])
    json.dumps(result)  # what --out writes


def scripted(scenario, calls, answer):
    chain = tools.Chain(scenario, thinking=False)
    results = [chain.take_call(name, json.dumps(args) if isinstance(args, dict) else args) for name, args in calls]
    chain.take_answer(answer)
    return chain.result(), results


def test_expected_chain_completes():
    key_chain, arithmetic, temperature = tools.scenarios(steps=3, seed=5)
    keys = [args["key"] for _, args in key_chain.expected]
    out, results = scripted(key_chain, key_chain.expected, f"The value is {key_chain.answer}.")
    assert out["completed"] and out["calls"] == out["well_formed"] == 3 and out["steps_matched"] == 3
    assert results[:2] == [{"next_key": keys[1]}, {"next_key": keys[2]}] and results[2] == {"value": key_chain.answer}
    # add commutes; the tool world computes from the arguments the model gave
    out, results = scripted(arithmetic, [("add", {"a": 4, "b": 3}), ("multiply", {"a": 7, "b": 5}),
                                         ("add", {"a": 35.0, "b": 6})], "41")
    assert out["completed"] and results == [{"result": 7}, {"result": 35}, {"result": 41}]
    out, results = scripted(temperature, temperature.expected, "It is 68.0 F in Lisbon.")
    assert out["completed"] and results == [{"city": "Lisbon", "celsius": 20}, {"fahrenheit": 68.0}]


def test_what_does_not_complete():
    _, arithmetic, temperature = tools.scenarios(steps=1)
    out, _ = scripted(arithmetic, [("multiply", {"a": 3, "b": 4}), ("add", {"a": 12, "b": 5})], "17")
    assert not out["completed"] and out["steps_matched"] == 0 and out["well_formed"] == 2
    out, results = scripted(temperature, [("get_temperature", '{"city": "Lisbon"'), ("celsius_to_fahrenheit",
                                                                                    {"celsius": "20"})], "68")
    assert not out["completed"] and out["well_formed"] == 0 and out["calls"] == 2
    assert out["problems"][0].startswith("arguments are not JSON") and "'celsius' is not a number" in out["problems"][1]
    assert all("error" in r for r in results)
    out, _ = scripted(temperature, temperature.expected, "It is warm.")
    assert not out["completed"] and out["steps_matched"] == 2 and not out["answer_correct"]


@pytest.mark.parametrize("name, arguments, why", [
    ("search", "{}", "tool 'search' was not offered"),
    ("lookup", "[1]", "arguments are not a JSON object"),
    ("lookup", "{}", "missing argument 'key'"),
    ("lookup", '{"key": 3}', "argument 'key' is not a string"),
])
def test_well_formed_says_why(name, arguments, why):
    assert tools.well_formed(name, arguments, ["lookup"]) == (False, tools.well_formed(name, arguments,
                                                                                       ["lookup"])[1], why)
