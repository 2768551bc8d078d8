"""Round plans and step batches: what rank 0 decided for one round, in a compact binary form, and the channel
that carries it. The batched engine sends one `engine.batch.Batch` per step (`encode_batch`); the method-name
plans below are what the reference engine's lockstep proxy sends.

A plan is a list of model calls (method name, arguments) plus the decode-state slots to free. Arguments are
restricted to plain data (None, bool, int, float, str, bytes, lists/tuples, str-keyed dicts, CPU tensors) and
`StateRef` (a decode state, named by its slot). The codec is our own tagged format rather than pickle so that
decoding bytes from the network can never run code.

The channel is rank 0's TCPStore: plan `n` is the key `tp/plan/{n}`. Followers wait for the next key in short slices
so that an idle server (no plans for hours) is not a collective timeout, and so that an abort is noticed while
waiting. Every plan that carries a forward also carries collectives, so no follower can fall more than one round
behind; keys older than a few rounds are deleted.
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
import time
from dataclasses import dataclass, field

import torch

from dsv41.parallel.failfast import TPAborted

_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32,
           torch.float64, torch.bfloat16, torch.float16]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
KEEP_ROUNDS = 8
MAGIC = b"DSP1"
BATCH_MAGIC = b"DSB1"


@dataclass(frozen=True)
class StateRef:
    """A decode state in a plan: every rank keeps its own state object under the same slot number."""

    slot: int


@dataclass
class Call:
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    result_slot: int | None = None  # the result is a new decode state, kept under this slot


@dataclass
class RoundPlan:
    number: int
    calls: list[Call] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    stop: bool = False


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
    elif isinstance(value, StateRef):
        out += b"r" + struct.pack("<q", value.slot)
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
                raise TypeError(f"plan dict keys must be str, got {type(key).__name__}")
            _enc(key, out)
            _enc(item, out)
    elif isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPE_CODE:
            raise TypeError(f"plan tensors of dtype {value.dtype} are not supported")
        t = value.detach().to("cpu").contiguous()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype in (torch.bfloat16,) else t.numpy().tobytes()
        out += b"t" + struct.pack("<BB", _DTYPE_CODE[t.dtype], t.dim())
        out += struct.pack(f"<{t.dim()}q", *t.shape) + struct.pack("<Q", len(raw)) + raw
    else:
        raise TypeError(f"cannot put a {type(value).__name__} into a round plan")


def _dec(buf: memoryview, pos: int):
    tag = bytes(buf[pos:pos + 1])
    pos += 1
    if tag == b"N":
        return None, pos
    if tag in (b"T", b"F"):
        return tag == b"T", pos
    if tag in (b"i", b"r"):
        (v,) = struct.unpack_from("<q", buf, pos)
        return (v if tag == b"i" else StateRef(v)), pos + 8
    if tag == b"f":
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if tag == b"I":
        (n,) = struct.unpack_from("<I", buf, pos)
        return int.from_bytes(bytes(buf[pos + 4:pos + 4 + n]), "little", signed=True), pos + 4 + n
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
    if tag == b"t":
        code, ndim = struct.unpack_from("<BB", buf, pos)
        pos += 2
        shape = struct.unpack_from(f"<{ndim}q", buf, pos)
        pos += 8 * ndim
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8
        dtype = _DTYPES[code]
        raw = bytearray(buf[pos:pos + n])
        storage_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
        t = torch.frombuffer(raw, dtype=storage_dtype) if n else torch.empty(0, dtype=storage_dtype)
        return t.view(dtype).reshape(shape), pos + n
    raise ValueError(f"corrupt round plan: unknown tag {tag!r} at byte {pos - 1}")


def encode_plan(plan: RoundPlan) -> bytes:
    out = bytearray(MAGIC)
    calls = [[c.method, tuple(c.args), dict(c.kwargs), c.result_slot] for c in plan.calls]
    _enc([plan.number, calls, list(plan.freed), plan.stop], out)
    return bytes(out)


def decode_plan(data: bytes) -> RoundPlan:
    if data[:4] != MAGIC:
        raise ValueError("corrupt round plan: bad magic")
    (number, calls, freed, stop), _ = _dec(memoryview(data), 4)
    return RoundPlan(number=number, calls=[Call(m, a, k, s) for m, a, k, s in calls], freed=freed, stop=stop)


# ---- step batches (the batched engine: one Batch per step, engine/batch.py) ----------------------------------

def _wire(obj):
    """A Batch / Row / RowSampling as nested lists of its fields (declaration order)."""
    if dataclasses.is_dataclass(obj):
        return [_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, list):
        return [_wire(v) for v in obj]
    return obj


def encode_batch(number: int, batch) -> bytes:
    out = bytearray(BATCH_MAGIC)
    _enc([number, _wire(batch)], out)
    return bytes(out)


def decode_batch(data: bytes):
    """(round number, Batch) from `encode_batch`'s bytes."""
    from dsv41.engine.batch import Batch, Row, RowSampling

    if data[:4] != BATCH_MAGIC:
        raise ValueError("corrupt step batch: bad magic")
    (number, (step, rows, *rest)), _ = _dec(memoryview(data), 4)
    at = [f.name for f in dataclasses.fields(Row)].index("sample")
    rows = [Row(*f[:at], RowSampling(*f[at]) if f[at] is not None else None, *f[at + 1:]) for f in rows]
    return number, Batch(step, rows, *rest)


# ---- channel ---------------------------------------------------------------------------------------------------

class PlanChannel:
    """Rank 0 `send`s plan n; every other rank `receive`s plan n (blocking)."""

    def __init__(self, store, rank: int, aborted=None, poll_s: float = 600.0):
        # A follower blocks in one store `get` per round. Long slices: waking up does not help an abort (the
        # monitor thread ends the process), and every expired slice makes torch log a socket-timeout warning.
        self.store, self.rank, self.aborted, self.poll_s = store, rank, aborted, poll_s
        self._timeout_set = False

    def send(self, plan: RoundPlan) -> None:
        self.send_encoded(plan.number, encode_plan(plan))

    def send_encoded(self, number: int, data: bytes) -> None:
        self.store.set(f"tp/plan/{number}", data)

    def trim(self, number: int) -> None:
        """Delete an old plan key (rank 0, off the critical path: after the round's work has started)."""
        if number >= KEEP_ROUNDS:
            self.store.delete_key(f"tp/plan/{number - KEEP_ROUNDS}")

    def receive(self, number: int) -> RoundPlan:
        plan = decode_plan(self.receive_bytes(number))
        if plan.number != number:
            raise ValueError(f"round plan tp/plan/{number} carries round {plan.number}")
        return plan

    def receive_bytes(self, number: int) -> bytes:
        key = f"tp/plan/{number}"
        if not self._timeout_set:
            self.store.set_timeout(datetime.timedelta(seconds=self.poll_s))
            self._timeout_set = True
        while True:
            if self.aborted is not None and self.aborted.is_set():
                raise TPAborted("tensor-parallel group aborted while waiting for a round plan")
            try:
                data = self.store.get(key)  # blocks until rank 0 sets the key (one round trip when it is there)
                break
            except Exception as exc:  # noqa: BLE001 - a slice ran out (or the store is gone: the monitor decides)
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    time.sleep(1.0)
        return data
