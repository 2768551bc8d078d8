"""The step-message codec: what rank 0 sends is what the followers get, and bad bytes are refused."""

from __future__ import annotations

import pytest
import torch

from dsv41.engine.batch import FOLLOWS, Batch, Row, RowSampling
from dsv41.parallel.plan import decode_batch, decode_round, decode_value, encode_batch, encode_value


def test_values_keep_their_type_and_value():
    value = [None, True, False, 0, -1, 2**63 - 1, -(2**63), (1 << 64) - 1, -(1 << 70), 0.7, -1e-300, "r\u00e9q",
             b"\x00\xff", [], (), [1, 2, 3], [2**31 - 1, -(2**31)], [2**31], [True, 1], (1, [2, (3,)]),
             {"seed": 2**63, "name": "x", "ids": [5, 6]}]
    back = decode_value(encode_value(value))
    assert back == value
    assert [type(v) for v in back] == [type(v) for v in value]
    assert type(back[16][0]) is int and back[19] == (1, [2, (3,)])


def test_a_batch_round_trips_and_a_decode_row_is_small():
    row = Row(7, 2, [5, 6, 7], 40, [3, 9], "prefill", [1, 2, 3],
              RowSampling(0.7, 0.9, 20, 0.0, (1 << 64) - 1, 12, 2, b"\x00\xff\x01\x02"), [(0, 6, 1), (1, 7, 1)], 17)
    batch = Batch(33, [row, Row(8, 0, [1], 3, [0])], [1], [4, 5], "prefill=replay")
    number, back = decode_batch(encode_batch(5, batch))
    assert number == 5 and back == batch
    assert decode_batch(encode_batch(6, Batch(-1, [], stop=True)))[1].stop
    # a launched round (the overlapped loop): its follow row's id a placeholder, the flag after the fields
    follow = Row(7, 2, [FOLLOWS], 43, [3, 9], "decode", sample=RowSampling(0.7, 0.9, 20, 0.0, 5, 13), follows=True)
    assert decode_round(encode_batch(7, Batch(34, [follow]), launch=True)) == (7, Batch(34, [follow]), True)
    assert decode_round(encode_batch(7, batch)) == (7, batch, False)
    decode = Row(1, 0, [42], 100, list(range(40)), sample=RowSampling(0.7, 1.0, 0, 0.0, 12345, 99))
    assert len(encode_batch(0, Batch(1, [decode]))) < 400  # ids and page tables travel as packed int32


def test_unsupported_values_and_corrupt_bytes_are_refused():
    for bad in (object(), torch.zeros(2), {1: "int key"}):
        with pytest.raises(TypeError):
            encode_value([bad])
    with pytest.raises(ValueError, match="bad magic"):
        decode_batch(b"XXXX")
    good = encode_batch(1, Batch(0, [Row(1, 0, [5], 0, [0])]))
    with pytest.raises(ValueError, match="unknown tag"):
        decode_batch(good[:4] + b"?" + good[5:])
    with pytest.raises(ValueError, match="after the value"):
        decode_value(encode_value(1) + b"N")
