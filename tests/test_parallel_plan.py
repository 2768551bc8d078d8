"""Round plan codec: what rank 0 sends is what the followers get, and bad bytes are refused."""

from __future__ import annotations

import pytest
import torch

from dsv41.parallel.plan import Call, RoundPlan, StateRef, decode_plan, encode_plan


def test_round_trip_keeps_every_value_and_type():
    ids = torch.tensor([0, 5, 129279, 2**40], dtype=torch.int64)
    weights = torch.tensor([[0.5, -1.25], [3.0, 1e-30]], dtype=torch.bfloat16)
    plan = RoundPlan(
        number=17,
        calls=[
            Call("new_state", (), {}, result_slot=3),
            Call("forward", (StateRef(3), ids), {"positions": torch.arange(4, dtype=torch.int32), "trace": None}),
            Call("forward_batch", ([StateRef(1), StateRef(3)], (ids[:1], ids[1:])),
                 {"sampling": {"seed": 2**63 - 1, "temperature": 0.7, "greedy": False, "name": "r\u00e9q"},
                  "mask": torch.tensor([True, False]), "w": weights, "empty": torch.zeros(0, 3),
                  "raw": b"\x00\xff"}),
        ],
        freed=[0, 2],
    )
    back = decode_plan(encode_plan(plan))
    assert back.number == 17 and back.freed == [0, 2] and not back.stop
    assert [c.method for c in back.calls] == ["new_state", "forward", "forward_batch"]
    assert back.calls[0].result_slot == 3 and back.calls[1].result_slot is None
    state, got_ids = back.calls[1].args
    assert state == StateRef(3) and got_ids.dtype == torch.int64 and torch.equal(got_ids, ids)
    assert torch.equal(back.calls[1].kwargs["positions"], torch.arange(4, dtype=torch.int32))
    assert back.calls[1].kwargs["trace"] is None
    states, chunks = back.calls[2].args
    assert states == [StateRef(1), StateRef(3)] and isinstance(chunks, tuple)
    kw = back.calls[2].kwargs
    assert kw["sampling"] == {"seed": 2**63 - 1, "temperature": 0.7, "greedy": False, "name": "r\u00e9q"}
    assert kw["w"].dtype == torch.bfloat16 and torch.equal(kw["w"], weights)
    assert kw["mask"].dtype == torch.bool and kw["mask"].tolist() == [True, False]
    assert kw["empty"].shape == (0, 3) and kw["raw"] == b"\x00\xff"


def test_stop_plan_and_size_is_compact():
    data = encode_plan(RoundPlan(number=5, calls=[Call("forward", (StateRef(0), torch.tensor([42])))]))
    assert decode_plan(encode_plan(RoundPlan(number=9, stop=True))).stop
    assert len(data) < 120  # a decode round is a few dozen bytes, not a pickle of the objects


def test_unsupported_values_and_corrupt_bytes_are_refused():
    with pytest.raises(TypeError, match="cannot put a object"):
        encode_plan(RoundPlan(number=0, calls=[Call("forward", (object(),))]))
    with pytest.raises(ValueError, match="bad magic"):
        decode_plan(b"XXXX")
    good = encode_plan(RoundPlan(number=1, calls=[Call("forward", (1,))]))
    with pytest.raises(ValueError, match="unknown tag"):
        decode_plan(good[:4] + b"?" + good[5:])
