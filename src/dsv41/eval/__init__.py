"""`dsv41 eval`: the quality harness (RECIPE.md §4.2's checks; docs/EVAL.md).

One module per part, each a function of a *backend* (backend.py: the engine in this process, or a running server
over HTTP) and its options, returning a JSON-ready dict:

    agreement.py  teacher-forced top-1 agreement and mean KL against a reference's prompt logprobs (JSONL)
    mmlu.py       multiple-choice accuracy on questions in MMLU's CSV layout
    needle.py     needle-in-a-haystack retrieval at a set of context lengths and depths
    tools.py      tool-call chains through the real server and the official `openai` client, thinking off and on
    drafting.py   drafting statistics (tokens per round) on code, prose and structured prompts
    prompts.py    the chat prompts every part builds (thinking off unless asked), built-in texts
    report.py     the terminal table, the JSON file, progress bars
    cli.py        `dsv41 eval PART ... [--write-reference FILE]`
"""
