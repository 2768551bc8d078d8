"""Long texts are tokenized in a child process, so the server's event loop (/health) never waits on them.

`tokenizers` releases the GIL while it encodes, but not while it hands the result to Python: `Encoding.ids` of an
8 MiB prompt (3.7M ids) builds the list in one call, and dropping the Encoding frees millions of token strings,
both under the GIL (0.1-0.8 s each on a loaded 2-core machine, /health waiting throughout). In the child that
work costs the server nothing; the ids come back as packed uint32 and become a list in slices
(`time.sleep(0)` between them lets the event loop in).

The child runs the same `Tokenizer` code on the same files, so the ids are the ones the server would compute
(`Tokenizer.encode_pieces`/`encode_literal`, control-token guard included). Only texts of `MIN_CHARS` or more go
there; shorter ones are cheaper in the thread. One child, started on first use, one text at a time (a second long
text waits for the first: the cores are busy anyway), at nice 10. A child that dies is started again on the next long text;
the text at hand is then tokenized in the thread, slower for /health but correct.

Protocol (stdin/stdout of `python -m dsv41.server.tokenize_process MODEL_DIR`), both ways: an 8-byte little-endian
length, then that many bytes. Request: the number of content spans (8 bytes), the spans as (start, end) native
uint64 pairs, then the text as UTF-8. Reply: `b"\\x00"` + the ids as native uint32, or `b"\\x01"` + an error
message (UTF-8).
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

log = logging.getLogger("dsv41.server")

MIN_CHARS = 1 << 16  # ~16K tokens: their .ids take well under a millisecond in the thread
SLICE = 1 << 16  # ids turned into Python ints per GIL hold on the way back
_HEADER = struct.Struct("<Q")
_OK, _FAILED = b"\x00", b"\x01"


class TokenizerProcess:
    """The child process that tokenizes long texts for `tokenizer` (`Tokenizer.long_text_encoder`)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = str(model_dir)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, text: str, content: list[tuple[int, int]]) -> list[int] | None:
        """The ids of `text` (see `Tokenizer._encode_guarded`), or None when the child could not give them (the
        caller tokenizes in the thread)."""
        request = _pack_request(text, content)
        with self._lock:
            if self._closed:
                return None
            try:
                proc = self._child()
                proc.stdin.write(_HEADER.pack(len(request)))
                proc.stdin.write(request)
                proc.stdin.flush()
                reply = _read_message(proc.stdout)
            except (OSError, EOFError, ValueError) as exc:
                log.warning("the tokenizer process failed (%s); tokenizing in the server process instead", exc)
                self._stop()
                return None
        if reply[:1] == _FAILED:
            raise RuntimeError(f"tokenizer process: {reply[1:].decode('utf-8', 'replace')}")
        packed = array("I")
        packed.frombytes(memoryview(reply)[1:])
        del reply
        ids: list[int] = []
        for start in range(0, len(packed), SLICE):
            ids += packed[start:start + SLICE].tolist()
            time.sleep(0)  # lets the event loop take the GIL between slices
        return ids

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ)
            # this process's sys.path: the Nix wrapper of `dsv41` extends it inside the process, not through the
            # environment (as ops/lifecycle.launch does for the server itself)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            env.setdefault("RAYON_NUM_THREADS", "1")  # one text at a time: no thread pool to spread it over
            self._proc = subprocess.Popen([sys.executable, "-m", "dsv41.server.tokenize_process", self.model_dir],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        """Stop the child (the server is shutting down): its stdin closes and it exits."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(10)


def attach(tokenizer) -> TokenizerProcess | None:
    """Give `tokenizer` a child process for its long texts, when it was read from a model folder."""
    source = Path(getattr(tokenizer, "source", "") or "")
    if source.name != "tokenizer.json" or not source.is_file() or not hasattr(tokenizer, "long_text_encoder"):
        return None
    worker = TokenizerProcess(source.parent)
    tokenizer.long_text_encoder = worker
    tokenizer.long_text_chars = MIN_CHARS
    return worker


def _pack_request(text: str, content: list[tuple[int, int]]) -> bytes:
    spans = array("Q", [i for span in content for i in span])
    return b"".join((_HEADER.pack(len(content)), spans.tobytes(), text.encode("utf-8", "surrogatepass")))


def _unpack_request(data: bytes) -> tuple[str, list[tuple[int, int]]]:
    (count,) = _HEADER.unpack_from(data)
    spans = array("Q")
    end = _HEADER.size + 16 * count
    spans.frombytes(data[_HEADER.size:end])
    text = data[end:].decode("utf-8", "surrogatepass")
    return text, list(zip(spans[0::2], spans[1::2]))


def _read_message(stream) -> bytes:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the tokenizer process closed its output")
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the tokenizer process closed its output mid-reply")
    return data


def _write_message(stream, data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def main(argv: list[str] | None = None) -> int:
    """The child: read requests until stdin closes."""
    from dsv41.tokenizer import Tokenizer

    (model_dir,) = argv if argv is not None else sys.argv[1:]
    # below the server's threads on a busy machine: the event loop and the engine come first, a long prompt's
    # tokenization takes what is left (on an idle machine this changes nothing)
    os.nice(10)
    tokenizer = Tokenizer.from_dir(model_dir)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    while True:
        try:
            text, content = _unpack_request(_read_message(stdin))
        except EOFError:
            return 0
        try:
            reply = _OK + array("I", tokenizer.encode_guarded_here(text, content)).tobytes()
        except Exception as exc:  # noqa: BLE001 - reported to the server, which raises it for this request
            reply = _FAILED + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        _write_message(stdout, reply)


if __name__ == "__main__":
    sys.exit(main())
