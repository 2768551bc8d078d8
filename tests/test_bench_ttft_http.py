"""bench/ttft_http.py: a smoke run on the CPU (the built-in tiny model, the real server and the official `openai`
client, in a child: the bench serves on its main thread and stops its server with SIGTERM to itself). Short prompts
(40 and 90 tokens), a 20-token new message in turn 2. No timing assertions: the JSON's shape, the usage figures
the server reported, and that the resumed turns (RAM tier; NVMe tier after a restart) resumed and equal the fresh
one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_on_the_cpu(tmp_path):
    out = tmp_path / "ttft_http.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_COMMIT="abc1234", PYTHONPATH=str(REPO / "src"))
    run = subprocess.run([sys.executable, str(REPO / "bench" / "ttft_http.py"), "--device", "cpu", "--lengths",
                          "40,90", "--new", "20", "--session-dir", str(tmp_path / "sessions"), "--out", str(out),
                          "--", "--cpu-threads", "1"], env=env, cwd=REPO, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["commit"] == "abc1234" and res["gpu"] == "cpu" and res["device"] == "cpu"
    assert res["lengths"] == [40, 90] and res["max_tokens"] == 8 and res["scale_to_40"] == 1.0
    for r, length in zip(res["prompts"], (40, 90), strict=True):
        assert r["length"] == length
        assert r["prompt_tokens"] == length and r["cached_tokens"] == 0 and r["prefilled_tokens"] == length
        assert r["completion_tokens"] == len(r["tokens"]) == 8  # ignore_eos: max_tokens every time
        assert 0 < r["ttft_s"] <= r["total_s"] and r["cold_ttft_s"] > 0
        assert r["prompt_tokens_per_s"] == round(length / r["ttft_s"], 1)

    s = res["sessions"]
    assert s["context"] == 90 and s["turn2_tokens"] == 90 + 8 + 20
    for tier in ("ram", "nvme", "fresh"):
        assert s[tier]["prompt_tokens"] == s["turn2_tokens"], tier
        assert s[tier]["prefilled_tokens"] == s["turn2_tokens"] - s[tier]["cached_tokens"], tier
        assert s[tier]["ttft_s"] > 0, tier
    # turn 1 (90 prompt + 8 reply tokens) is resumed, from RAM and, after the restart, from its parked file
    assert 0 < s["ram"]["cached_tokens"] < s["turn2_tokens"]
    assert 0 < s["nvme"]["cached_tokens"] < s["turn2_tokens"]
    assert s["nvme"]["health_sessions"]["disk_hits"] >= 1
    assert s["fresh"]["cached_tokens"] == 0
    assert s["park"]["bytes"] > 0 and s["park"]["files"] > 0
    assert s["resumed_equals_fresh"] == {"ram": True, "nvme": True}
    servers = res["servers"]
    assert set(servers) == {"sessions_on", "nvme_restart", "sessions_off"}
    # the restarted servers' pools have the first one's layout (the session files' tag names it)
    assert servers["nvme_restart"]["pool"] == servers["sessions_off"]["pool"] == servers["sessions_on"]["pool"]
