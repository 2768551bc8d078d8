"""The loss curve of a run as an SVG picture (no plotting library needed): log.jsonl -> loss.svg.

Training lines (LM loss, DSpark draft loss) are drawn from every logged step, held-out evaluations as one line per
source; the y axis is the loss (nats), the x axis the step.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
W, H, PAD = 720, 400, 56


def read_log(path: str | Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, float]]]]:
    train: dict[str, list[tuple[int, float]]] = {"lm": [], "draft": []}
    held: dict[str, list[tuple[int, float]]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "eval" in row:
            for src, m in row["eval"].items():
                held.setdefault(f"held-out {src}", []).append((row["step"], m["loss"]))
        else:
            for k in train:
                train[k].append((row["step"], row[k]))
    return train, held


def loss_svg(log_path: str | Path, out: str | Path, title: str = "tiny model training") -> Path:
    train, held = read_log(log_path)
    series = {f"train {k}": v for k, v in train.items() if v} | held
    points = [p for v in series.values() for p in v]
    if not points:
        raise ValueError(f"{log_path}: no logged steps to plot")
    x1 = max(s for s, _ in points) or 1
    y1 = max(v for _, v in points) * 1.05 or 1.0

    def xy(step: int, value: float) -> str:
        return f"{PAD + (W - 2 * PAD) * step / x1:.1f},{H - PAD - (H - 2 * PAD) * value / y1:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
             f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
             f'<text x="{W / 2}" y="{H - 16}" text-anchor="middle">step</text>',
             f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" text-anchor="middle">loss (nats)</text>']
    for i in range(5):
        v, s = y1 * i / 4, round(x1 * i / 4)
        parts.append(f'<text x="{PAD - 6}" y="{H - PAD - (H - 2 * PAD) * i / 4 + 4:.1f}" text-anchor="end">'
                     f'{v:.2f}</text>')
        parts.append(f'<text x="{PAD + (W - 2 * PAD) * i / 4:.1f}" y="{H - PAD + 16}" text-anchor="middle">{s}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{" ".join(xy(s, v) for s, v in pts)}"/>')
        parts.append(f'<text x="{W - PAD - 150}" y="{PAD + 16 * i}" fill="{color}">{escape(name)}</text>')
    parts.append("</svg>")
    out = Path(out)
    out.write_text("\n".join(parts) + "\n")
    return out
