"""bench/persistent_hops.py's CPU smoke run (Triton's interpreter, in a child process: TRITON_INTERPRET must be set
before Triton decorates a kernel): a chain of hops through the persistent executor adds one a hop, the bench says
so and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_chain_adds_one_a_hop_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "persistent_hops.py"), "--device", "cpu", "--hops",
                           "6", "--programs", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"smoke": True}
