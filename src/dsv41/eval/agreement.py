"""Teacher-forced top-1 agreement and mean KL against a reference's prompt logprobs (RECIPE.md §4.2-4.3: the kit's
`prompt_logprobs` top 5 over 8 prompts repeated to 2,048 tokens, our engine teacher-forced on the same ids).

The reference file is JSONL, one prompt a line, in vLLM's terms so that a vLLM server's answer drops in as is:

    {"name": "code", "ids": [0, 17, ...], "prompt_logprobs": [null, {"17": -0.02, "4": -4.1, ...}, ...],
     "first_copy": 58}

`ids` are the teacher-forced token ids; `prompt_logprobs[i]` (i >= 1) the reference's top logprobs of the token
at position i given the ids before it ({id: logprob}; vLLM's {id: {"logprob": x, "rank": r, ...}} is read too),
`null` for position 0. `first_copy` (optional) is how many ids the first copy of a repeated prompt spans: the
figure "first copy" is the agreement over those positions only, where nothing can be copied from earlier text.
`dsv41 eval --write-reference FILE` writes such a file from a model (the engine's `prompt_logprobs`), and a vLLM
`/v1/completions` reply with `"prompt": ids, "prompt_logprobs": k` gives the same fields.

Per position i: top-1 agreement is whether the model's most likely token is the reference's. The KL is
KL(reference || model) over the partition {each id of the reference's top set} + {everything else}: the reference
knows only its top k, and coarsening never raises a KL (so this is a lower bound of the full one, and exactly 0
when the two distributions agree). The model's logprob of a reference id missing from the model's own top K is
bounded by the model's K-th logprob (counted in `kl_bounded_positions`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import DSV41Error
from .backend import Query
from .prompts import REFERENCE_TEXTS, repeated_ids

DEFAULT_TOP = 20  # the server's most top logprobs (protocol.MAX_TOP_LOGPROBS)


# ------------------------------------------------------------------------------------------------ prompts
def reference_prompts(tokenizer, prompts_file: str | None, length: int) -> list[dict]:
    """The prompts a reference is written over: `prompts_file` (JSONL of {"name"?, "text"} or {"name"?, "ids"};
    texts repeated to `length` ids), else the built-in texts repeated to `length`."""
    if prompts_file is None:
        rows = [{"name": name, "text": text} for name, text in REFERENCE_TEXTS.items()]
    else:
        rows = [row for _, row in _jsonl(Path(prompts_file), "--prompts")]
    prompts = []
    for i, row in enumerate(rows, 1):
        name = str(row.get("name", f"prompt-{i}"))
        if isinstance(row.get("ids"), list):
            prompts.append({"name": name, "ids": [int(t) for t in row["ids"]]})
        elif isinstance(row.get("text"), str) and row["text"]:
            ids = repeated_ids(tokenizer, row["text"], length)
            first = 1 + len(tokenizer.encode_literal(row["text"]))
            prompts.append({"name": name, "ids": ids, "first_copy": min(first, len(ids))})
        else:
            raise DSV41Error(f"--prompts {prompts_file}: line {i} needs a non-empty 'text' or a list 'ids'")
    return prompts


def write_reference(backend, prompts: list[dict], path: str, top: int = DEFAULT_TOP) -> dict:
    """Each prompt teacher-forced through `backend`, its top `top` logprobs per position written to `path`."""
    answers = backend.run([Query(p["ids"], max_tokens=1, prompt_logprobs=top) for p in prompts], "reference")
    out = Path(path)
    lines = []
    for prompt, answer in zip(prompts, answers):
        if answer.error or answer.prompt_logprobs is None:
            raise DSV41Error(f"--write-reference: prompt {prompt['name']!r}: "
                             f"{answer.error or 'no prompt logprobs came back'}")
        row = {"name": prompt["name"], "ids": prompt["ids"],
               "prompt_logprobs": [None if r is None else {str(k): v for k, v in r.items()}
                                   for r in answer.prompt_logprobs]}
        if "first_copy" in prompt:
            row["first_copy"] = prompt["first_copy"]
        lines.append(json.dumps(row, separators=(",", ":")))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    except OSError as e:
        raise DSV41Error(f"--write-reference {out}: {e.strerror or e}") from None
    return {"file": str(out), "prompts": len(prompts), "positions": sum(len(p["ids"]) - 1 for p in prompts),
            "top": top}


# ------------------------------------------------------------------------------------------------ reading
def _jsonl(path: Path, flag: str):
    try:
        text = path.read_text()
    except OSError as e:
        raise DSV41Error(f"{flag} {path}: {e.strerror or e}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DSV41Error(f"{flag} {path}: line {n} is not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DSV41Error(f"{flag} {path}: line {n} is not an object")
        yield n, row


def read_reference(path: str, vocab_size: int | None = None) -> list[dict]:
    """The reference's prompts, each {"name", "ids", "logprobs": [None | {id: logprob}], "first_copy"}; a
    malformed line is a one-line error naming the line and the field."""
    file = Path(path)
    prompts = []
    for n, row in _jsonl(file, "--reference"):
        where = f"--reference {file}: line {n}"
        ids = row.get("ids")
        if not isinstance(ids, list) or len(ids) < 2 or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise DSV41Error(f"{where}: field 'ids' must be a list of at least 2 token ids")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise DSV41Error(f"{where}: id {max(ids)} is beyond the model's vocabulary of {vocab_size}")
        rows = row.get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(ids):
            raise DSV41Error(f"{where}: field 'prompt_logprobs' must be a list as long as 'ids' ({len(ids)})")
        logprobs = []
        for i, entry in enumerate(rows):
            if i == 0 or entry is None:
                logprobs.append(None)
                continue
            try:
                parsed = {int(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in entry.items()}
            except (AttributeError, KeyError, TypeError, ValueError):
                raise DSV41Error(f"{where}: prompt_logprobs[{i}] must map token ids to logprobs") from None
            if not parsed:
                raise DSV41Error(f"{where}: prompt_logprobs[{i}] is empty")
            logprobs.append(parsed)
        if all(entry is None for entry in logprobs):
            raise DSV41Error(f"{where}: prompt_logprobs has no position with logprobs")
        first = row.get("first_copy")
        prompts.append({"name": str(row.get("name", f"line-{n}")), "ids": ids, "logprobs": logprobs,
                        "first_copy": first if isinstance(first, int) and first > 1 else None})
    if not prompts:
        raise DSV41Error(f"--reference {file}: no prompts in the file")
    return prompts


# ------------------------------------------------------------------------------------------------ metrics
def top1(row: dict[int, float]) -> int:
    return max(row.items(), key=lambda kv: (kv[1], -kv[0]))[0]


def coarse_kl(ref: dict[int, float], model: dict[int, float], top: int) -> tuple[float, bool]:
    """KL(ref || model) over {each id of ref} + {the rest}; (value, whether a model logprob was bounded)."""
    ranked = sorted(model.values(), reverse=True)
    floor = ranked[min(top, len(ranked)) - 1]  # a token outside the model's top `top` is at most this likely
    kl, bounded, p_in, q_in = 0.0, False, 0.0, 0.0
    for token, lp in ref.items():
        lq = model.get(token)
        if lq is None:
            lq, bounded = floor, True
        p = math.exp(lp)
        p_in += p
        q_in += math.exp(lq)
        kl += p * (lp - lq)
    p_rest = max(0.0, 1.0 - p_in)
    if p_rest > 0.0:
        q_rest = max(1.0 - q_in, 1e-30)
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return kl, bounded


def evaluate(backend, reference: list[dict], top: int = DEFAULT_TOP) -> dict:
    """Top-1 agreement and mean KL of `backend`'s model against `reference` (read_reference's prompts)."""
    answers = backend.run([Query(p["ids"], max_tokens=1, prompt_logprobs=top) for p in reference], "agreement")
    per_prompt, errors = [], []
    totals = {"positions": 0, "agree": 0, "kl": 0.0, "bounded": 0, "first_positions": 0, "first_agree": 0}
    max_kl = 0.0
    for prompt, answer in zip(reference, answers):
        if answer.error or answer.prompt_logprobs is None or len(answer.prompt_logprobs) != len(prompt["ids"]):
            errors.append({"prompt": prompt["name"], "error": answer.error or "no prompt logprobs came back"})
            continue
        n = agree = bounded = 0
        kl_sum = 0.0
        for i, ref in enumerate(prompt["logprobs"]):
            model = answer.prompt_logprobs[i]
            if ref is None or not model:
                continue
            same = top1(model) == top1(ref)
            kl, was_bounded = coarse_kl(ref, model, top)
            n, agree, kl_sum, bounded = n + 1, agree + same, kl_sum + kl, bounded + was_bounded
            max_kl = max(max_kl, kl)
            if prompt["first_copy"] is not None and i < prompt["first_copy"]:
                totals["first_positions"] += 1
                totals["first_agree"] += same
        totals["positions"] += n
        totals["agree"] += agree
        totals["kl"] += kl_sum
        totals["bounded"] += bounded
        per_prompt.append({"prompt": prompt["name"], "positions": n, "top1": _ratio(agree, n),
                           "mean_kl": kl_sum / n if n else None})
    n = totals["positions"]
    return {
        "prompts": len(reference), "positions": n, "top1_agree": totals["agree"], "top1": _ratio(totals["agree"], n),
        "top1_first_copy": _ratio(totals["first_agree"], totals["first_positions"]),
        "mean_kl": totals["kl"] / n if n else None, "max_kl": max_kl if n else None,
        "kl_bounded_positions": totals["bounded"], "model_top": top, "per_prompt": per_prompt, "errors": errors,
    }


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None
