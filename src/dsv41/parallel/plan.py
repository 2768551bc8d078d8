"""Step batches on the wire: what rank 0 decided for one step (an `engine.batch.Batch`), in a compact binary form,
and the channel that carries it to every rank (docs/TENSOR_PARALLEL.md §3).

The codec is our own tagged format rather than pickle, so that decoding bytes from the network can never run
code: None, bools, ints (any size), floats, str, bytes, lists, tuples and str-keyed dicts; lists of int32 ids
(token ids, page tables) are packed 4 bytes an id. A `Batch` travels as the nested lists of its fields.

The channel is rank 0's TCPStore: message `n` is the key `tp/plan/{n}`. Followers wait for the next key in long
slices so that an idle server (no steps for hours) is not a collective timeout; an abort ends the process from the
monitor thread. Every step carries collectives, so no follower can fall more than one step behind; keys older than
a few steps are deleted.
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
import time

from dsv41.parallel.failfast import TPAborted

KEEP_ROUNDS = 8
BATCH_MAGIC = b"DSB1"


# ---- codec -----------------------------------------------------------------------------------------------------

def _enc(value, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"T" if value else b"F"
    elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        out += b"i" + struct.pack("<q", value)
    elif isinstance(value, int):  # e.g. a 64-bit unsigned seed
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, float):
        out += b"f" + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode()
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + struct.pack("<I", len(value)) + bytes(value)
    elif isinstance(value, list) and value and all(type(v) is int and -(1 << 31) <= v < (1 << 31) for v in value):
        out += b"L" + struct.pack("<I", len(value)) + struct.pack(f"<{len(value)}i", *value)  # token ids, pages
    elif isinstance(value, (list, tuple)):
        out += (b"l" if isinstance(value, list) else b"u") + struct.pack("<I", len(value))
        for item in value:
            _enc(item, out)
    elif isinstance(value, dict):
        out += b"d" + struct.pack("<I", len(value))
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"message dict keys must be str, got {type(key).__name__}")
            _enc(key, out)
            _enc(item, out)
    else:
        raise TypeError(f"cannot put a {type(value).__name__} into a step message")


def _dec(buf: memoryview, pos: int):
    tag = bytes(buf[pos:pos + 1])
    pos += 1
    if tag == b"N":
        return None, pos
    if tag in (b"T", b"F"):
        return tag == b"T", pos
    if tag == b"i":
        return struct.unpack_from("<q", buf, pos)[0], pos + 8
    if tag == b"I":
        (n,) = struct.unpack_from("<I", buf, pos)
        return int.from_bytes(bytes(buf[pos + 4:pos + 4 + n]), "little", signed=True), pos + 4 + n
    if tag == b"f":
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if tag in (b"s", b"b"):
        (n,) = struct.unpack_from("<I", buf, pos)
        raw = bytes(buf[pos + 4:pos + 4 + n])
        return (raw.decode() if tag == b"s" else raw), pos + 4 + n
    if tag == b"L":
        (n,) = struct.unpack_from("<I", buf, pos)
        return list(struct.unpack_from(f"<{n}i", buf, pos + 4)), pos + 4 + 4 * n
    if tag in (b"l", b"u"):
        (n,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        items = []
        for _ in range(n):
            item, pos = _dec(buf, pos)
            items.append(item)
        return (items if tag == b"l" else tuple(items)), pos
    if tag == b"d":
        (n,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        result = {}
        for _ in range(n):
            key, pos = _dec(buf, pos)
            result[key], pos = _dec(buf, pos)
        return result, pos
    raise ValueError(f"corrupt step message: unknown tag {tag!r} at byte {pos - 1}")


def encode_value(value) -> bytes:
    out = bytearray()
    _enc(value, out)
    return bytes(out)


def decode_value(data: bytes):
    value, end = _dec(memoryview(data), 0)
    if end != len(data):
        raise ValueError(f"corrupt step message: {len(data) - end} bytes after the value")
    return value


# ---- step batches (one Batch per step, engine/batch.py) ---------------------------------------------------------

def _wire(obj):
    """A Batch / Row / RowSampling as nested lists of its fields (declaration order)."""
    if dataclasses.is_dataclass(obj):
        return [_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, list):
        return [_wire(v) for v in obj]
    return obj


def encode_batch(number: int, batch, launch: bool = False) -> bytes:
    """The Batch's fields, the trailing ones that hold their defaults left out (a decode step carries no forks or
    session operations: the receiver's dataclass fills them in). `launch`: rank 0 launched the step rather than
    executed it (the overlapped loop: every rank does the same, so that a follow row's id comes from the same
    sample on every rank); a flag after the fields, present only when set."""
    fields = dataclasses.fields(batch)
    wire = _wire(batch)
    while len(wire) > 2 and wire[-1] == _default(fields[len(wire) - 1]):
        wire.pop()
    return BATCH_MAGIC + encode_value([number, wire, True] if launch else [number, wire])


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def decode_batch(data: bytes):
    """(round number, Batch) from `encode_batch`'s bytes."""
    number, batch, _ = decode_round(data)
    return number, batch


def decode_round(data: bytes):
    """(round number, Batch, launch) from `encode_batch`'s bytes."""
    from dsv41.engine.batch import Batch, Row, RowSampling

    if data[:4] != BATCH_MAGIC:
        raise ValueError("corrupt step batch: bad magic")
    number, (step, rows, *rest), *flags = decode_value(data[4:])
    if flags not in ([], [True]):
        raise ValueError(f"corrupt step batch: unknown flags {flags!r}")
    at = [f.name for f in dataclasses.fields(Row)].index("sample")
    rows = [Row(*f[:at], RowSampling(*f[at]) if f[at] is not None else None, *f[at + 1:]) for f in rows]
    return number, Batch(step, rows, *rest), bool(flags)


# ---- channel ---------------------------------------------------------------------------------------------------

class PlanChannel:
    """Rank 0 `send_encoded`s message n; every other rank `receive_bytes` message n (blocking)."""

    def __init__(self, store, rank: int, aborted=None, poll_s: float = 600.0):
        # A follower blocks in one store `get` per round. Long slices: waking up does not help an abort (the
        # monitor thread ends the process), and every expired slice makes torch log a socket-timeout warning.
        self.store, self.rank, self.aborted, self.poll_s = store, rank, aborted, poll_s
        self._timeout_set = False

    def send_verdict(self, number: int, verdict: str) -> None:
        """A follower's verdict of launched round `number`'s check ("" = it holds; the Engram gate at TP > 1)."""
        self.store.set(f"tp/gate/{number}/{self.rank}", verdict.encode())

    def receive_verdict(self, number: int, rank: int) -> str:
        """Rank `rank`'s verdict of round `number` (blocking: run where an abort releases the caller)."""
        key = f"tp/gate/{number}/{rank}"
        verdict = self.receive_key(key).decode()
        self.store.delete_key(key)
        return verdict

    def send_encoded(self, number: int, data: bytes) -> None:
        self.store.set(f"tp/plan/{number}", data)

    def trim(self, number: int) -> None:
        """Delete an old message key (rank 0, off the critical path: after the round's work has started)."""
        if number >= KEEP_ROUNDS:
            self.store.delete_key(f"tp/plan/{number - KEEP_ROUNDS}")

    def receive_bytes(self, number: int) -> bytes:
        return self.receive_key(f"tp/plan/{number}")

    def receive_key(self, key: str) -> bytes:
        if not self._timeout_set:
            self.store.set_timeout(datetime.timedelta(seconds=self.poll_s))
            self._timeout_set = True
        while True:
            if self.aborted is not None and self.aborted.is_set():
                raise TPAborted(f"tensor-parallel group aborted while waiting for {key}")
            try:
                data = self.store.get(key)  # blocks until rank 0 sets the key (one round trip when it is there)
                break
            except Exception as exc:  # noqa: BLE001 - a slice ran out (or the store is gone: the monitor decides)
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    time.sleep(1.0)
        return data
