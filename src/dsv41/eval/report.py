"""The run's results as a table for the terminal and as a JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DSV41Error


def _pct(num, den) -> str:
    return f"{num}/{den} ({100 * num / den:.1f}%)" if den else f"{num}/{den}"


def _f(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_rows(parts: dict) -> list[tuple[str, str, str]]:
    """(part, figure, value) rows: the headline numbers of each part that ran."""
    rows = []
    for name, result in parts.items():
        if "error" in result:  # the part did not run (a refusal, a server that would not start)
            rows.append((name, "error", result["error"].splitlines()[0]))
            continue
        if name == "write-reference":
            rows.append((name, "file", f"{result['file']} ({result['prompts']} prompts, {result['positions']} "
                                       f"positions, top {result['top']})"))
        elif name == "agreement":
            rows.append((name, "top-1", _pct(result["top1_agree"], result["positions"])))
            if result["top1_first_copy"] is not None:
                rows.append((name, "top-1 first copy", _f(result["top1_first_copy"])))
            rows.append((name, "mean KL / max KL", f"{_f(result['mean_kl'], 6)} / {_f(result['max_kl'], 6)}"))
        elif name == "mmlu":
            rows.append((name, "accuracy", _pct(result["correct"], result["questions"])))
        elif name == "needle":
            rows.append((name, "found", _pct(result["found"], result["cells"])))
            for length, b in result["by_length"].items():
                rows.append((name, f"  {length} tokens", _pct(b["found"], b["cells"])))
        elif name == "tools":
            for mode, m in result["thinking"].items():
                rows.append((name, f"thinking {mode}: chains completed", _pct(m["completed"], m["chains"])))
                rows.append((name, f"thinking {mode}: well-formed calls", _pct(m["well_formed"], m["calls"])))
                rows.append((name, f"thinking {mode}: steps matched", _pct(m["steps_matched"], m["steps"])))
                if m["errors"]:
                    rows.append((name, f"thinking {mode}: chains ended by an error", str(m["errors"])))
        elif name == "drafting":
            for kind, w in result["workloads"].items():
                rows.append((name, f"{kind}: tokens/round", f"{_f(w['tokens_per_round'], 3)} ({w['tokens']} tokens, "
                                                           f"{_f(w['tok_s'], 2)} tok/s)"))
        failed = result.get("errors") or []
        if failed:  # items that failed (engine or HTTP errors): the figures above count them as wrong
            rows.append((name, "failed items", f"{len(failed)}, first: {failed[0]['error']}"))
    return rows


def table(parts: dict) -> str:
    rows = [("part", "figure", "value")] + summary_rows(parts)
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def write_json(path: str, results: dict) -> None:
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    except OSError as e:
        raise DSV41Error(f"--out {out}: {e.strerror or e}") from None
