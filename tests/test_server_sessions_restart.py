"""Sessions across server processes, for real (issue 34): `dsv41 serve --session-dir` is killed with SIGKILL while it
parks entry after entry (a RAM tier of one snapshot parks the previous entry at every new one); a server restarted on
the folder resumes from the files that survived and replies exactly what the first server replied fresh; a SIGTERM
then parks its RAM entries (a restart resuming those: tests/test_server_sessions.py). Replies compared: text and
logprobs at T = 0.7 (seeded), through the official client."""

from __future__ import annotations

import random
import signal
import threading
import time

from server_harness import ServerProcess

PROMPTS = [f"Conversation {k}: " + " ".join(f"item{(k * 7 + i) % 13} is next to item{i % 5}" for i in range(14))
           for k in range(4)]
SESSION_ARGS = ("--session-disk-min-tokens", "16", "--session-ram-mib", "0.03")


def ask(server, k: int):
    reply = server.client().completions.create(model="dsv41-tiny", prompt=PROMPTS[k], max_tokens=6, temperature=0.7,
                                               seed=k, logprobs=2)
    choice = reply.choices[0]
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


def sessions(server) -> dict:
    return server.health().json()["batching"]["sessions"]


def test_kill_9_while_parking_then_a_restart_resumes_exactly(tmp_path):
    folder = tmp_path / "sessions"
    first = ServerProcess(tmp_path / "a", "--session-dir", str(folder), *SESSION_ARGS)
    try:
        fresh = [ask(first, k) for k in range(4)]  # the first time each prompt is seen: prefilled from the start
        assert sessions(first)["hits"] == 0
        stop = threading.Event()

        def churn():  # more entries, each parking the one before, until the kill
            i = 0
            while not stop.is_set():
                try:
                    first.client().completions.create(model="dsv41-tiny", prompt=PROMPTS[i % 4] + f" more {i}",
                                                      max_tokens=3, temperature=0.0)
                except Exception:  # noqa: BLE001 - the server is killed under it
                    return
                i += 1

        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        time.sleep(random.Random(5).uniform(1.0, 3.0))
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        stop.set()
        worker.join(timeout=30)
    finally:
        first.kill()

    second = ServerProcess(tmp_path / "b", "--session-dir", str(folder), *SESSION_ARGS)
    try:
        assert [ask(second, k) for k in range(4)] == fresh
        figures = sessions(second)
        assert figures["disk_hits"] >= 1 and figures["disk"]["read_failures"] == 0, figures
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert "session entries parked" in second.output(), second.output()[-2000:]
    finally:
        second.kill()
