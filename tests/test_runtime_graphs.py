"""Piecewise CUDA graphs of the decode step (runtime/graphs.py).

CPU: the policy (`refusal`, `PieceGraphs.decide`), the keys, the eager fallback and its one log line, the budgets,
`DSV41_GRAPHS=0`, each Comm's `graph_safe`, the static-buffer logic of a replay (with a stand-in graph object: no
CUDA involved), and the forward's cut into pieces. GPU (`-m gpu`, the built-in tiny model): decode steps and verify
windows through the graphs == the same steps eager, bitwise, with the second step replaying.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from dsv41.parallel.comm import Comm, LocalComm
from dsv41.runtime import graphs as G
from dsv41.runtime.graphs import Piece, PieceGraphs, piece_key, refusal

REPO = Path(__file__).resolve().parents[1]
OK = dict(enabled=True, device_type="cuda", tracing=False, comm_safe=True, spent_s=0.0, budget_s=60.0)


# ------------------------------------------------------------------------------------------------ policy
def test_refusal_rules_in_order():
    assert refusal(**OK) is None
    assert refusal(**{**OK, "enabled": False}) == "graphs off (DSV41_GRAPHS=0)"
    assert refusal(**{**OK, "device_type": "cpu"}) == "not CUDA"
    assert refusal(**{**OK, "tracing": True}) == "tracing"
    assert refusal(**{**OK, "comm_safe": False}) == "comm not graph-safe"
    assert refusal(**{**OK, "spent_s": 60.0}) == "capture budget of 60 s spent"
    assert refusal(**{**OK, "spent_s": 59.9}) is None
    assert refusal(**OK, captures=5, max_captures=5) == "capture budget of 5 graphs spent"
    # the first reason wins
    assert refusal(**{**OK, "enabled": False, "device_type": "cpu", "tracing": True}).startswith("graphs off")
    assert refusal(**{**OK, "device_type": "cpu", "comm_safe": False}) == "not CUDA"


def test_env_knobs(monkeypatch):
    monkeypatch.delenv(G.ENV_FLAG, raising=False)
    monkeypatch.delenv(G.ENV_BUDGET, raising=False)
    assert G.env_enabled() and G.env_budget() == G.DEFAULT_BUDGET_S
    for off in ("0", "off", "false"):
        assert not G.env_enabled({G.ENV_FLAG: off})
    assert G.env_enabled({G.ENV_FLAG: "1"})
    assert G.env_budget({G.ENV_BUDGET: "2.5"}) == 2.5
    monkeypatch.setenv(G.ENV_FLAG, "0")
    g = PieceGraphs("cuda", LocalComm())
    assert not g.enabled and not g.active
    assert g.decide(("k",)) == "graphs off (DSV41_GRAPHS=0)"
    monkeypatch.setenv(G.ENV_FLAG, "1")
    monkeypatch.setenv(G.ENV_BUDGET, "7")
    g = PieceGraphs("cuda", LocalComm())
    assert g.enabled and g.budget_s == 7.0 and g.active
    assert PieceGraphs("cuda", LocalComm(), enabled=False).decide(("k",)).startswith("graphs off")


def test_keys():
    x, y = torch.zeros(16, 8), torch.zeros(16, 8, dtype=torch.bfloat16)
    k = piece_key("ffn.3", "decode", 1, (x, None))
    assert k == piece_key("ffn.3", "decode", 1, (torch.ones(16, 8), None))  # values never matter
    others = [piece_key("ffn.4", "decode", 1, (x, None)), piece_key("ffn.3", "verify", 1, (x, None)),
              piece_key("ffn.3", "decode", 3, (x, None)), piece_key("ffn.3", "decode", 1, (y, None)),
              piece_key("ffn.3", "decode", 1, (x, x)), piece_key("ffn.3", "decode", 1, (x.t(), None)),
              piece_key("ffn.3", "decode", 1, (torch.zeros(15, 8), None)),
              piece_key("ffn.3", "decode", 1, ((x, x, x), None))]
    assert len({k, *others}) == len(others) + 1
    hash(k)


def test_flatten_roundtrip():
    a, b = torch.zeros(2), torch.ones(3)
    obj = (a, None, {"dtype": torch.bfloat16, "q": b, "proj": {}, "nested": [a, 3]}, (b,))
    leaves = []
    spec = G.flatten(obj, leaves)
    assert len(leaves) == 4 and all(x is y for x, y in zip(leaves, [a, b, a, b]))
    back = G.unflatten(spec, iter(leaves))
    assert back[0] is a and back[1] is None and back[2]["q"] is b and back[2]["dtype"] is torch.bfloat16
    assert back[2]["proj"] == {} and back[2]["nested"][0] is a and back[2]["nested"][1] == 3 and back[3][0] is b
    with pytest.raises(TypeError):
        G.flatten(object(), [])


def test_graph_safe_of_each_comm(tmp_path):
    assert LocalComm().graph_safe is True
    assert Comm().graph_safe is False  # unknown comms are not
    spec = importlib.util.spec_from_file_location("decode_step_bench", REPO / "bench" / "decode_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.StubComm().graph_safe is True
    import torch.distributed as dist

    from dsv41.parallel.torch_comm import TorchComm

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert TorchComm().graph_safe is False  # gloo: host calls
    finally:
        dist.destroy_process_group()
    assert PieceGraphs("cuda", Comm()).decide(("k",)) == "comm not graph-safe"


# ------------------------------------------------------------------------------------------------ fallback
def test_cpu_runs_eagerly_and_logs_once(caplog):
    g = PieceGraphs("cpu", LocalComm())
    calls = []

    def fn(x, y):
        calls.append(1)
        return x + 1, (y, None)

    x = torch.arange(4.0)
    with caplog.at_level(logging.INFO, logger="dsv41.runtime.graphs"):
        for _ in range(3):
            out, (y, none) = g.run("p", "decode", 1, fn, x, x)
            assert torch.equal(out, x + 1) and y is x and none is None
        g.run("q", "verify", 2, fn, x, x)
    assert len(calls) == 4
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert lines == ["CUDA graphs: pieces run eagerly (not CUDA)"]
    assert g.stats.as_dict() == {"captures": 0, "replays": 0, "eager": 4, "failed": 0, "capture_s": 0.0,
                                 "refused": {"not CUDA": 4}}


def test_budget_spent_and_tracing_run_eagerly(caplog):
    """The policy past the device rule (a CUDA device object, no CUDA call): a spent budget and a traced forward
    keep every piece eager, each reason logged once."""
    x = torch.arange(3.0)
    g = PieceGraphs("cuda", LocalComm(), enabled=True, budget_s=1.0)
    key = piece_key("p", "decode", 1, (x,))
    assert g.decide(key) == "capture"
    g.stats.capture_s = 1.0
    with caplog.at_level(logging.INFO, logger="dsv41.runtime.graphs"):
        assert torch.equal(g.run("p", "decode", 1, lambda t: t * 2, x), x * 2)
        assert torch.equal(g.run("p", "decode", 1, lambda t: t * 2, x), x * 2)
        assert torch.equal(g.run("p", "decode", 1, lambda t: t * 3, x, tracing=True), x * 3)
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert lines == ["CUDA graphs: pieces run eagerly (capture budget of 1 s spent)",
                     "CUDA graphs: pieces run eagerly (tracing)"]
    assert g.stats.refused == {"capture budget of 1 s spent": 2, "tracing": 1} and g.stats.captures == 0
    g = PieceGraphs("cuda", LocalComm(), max_captures=0)
    assert g.decide(key) == "capture budget of 0 graphs spent"
    tp = LocalComm()
    tp.world = 2  # at TP > 1 only the count budget applies (ranks must decide alike)
    assert PieceGraphs("cuda", tp, budget_s=1.0).budget_s == float("inf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host where capturing raises (no CUDA)")
def test_a_capture_that_raises_stays_eager(caplog):
    """Where the capture itself raises (here: no CUDA runtime behind a CUDA device object), the call returns the
    eager result, the key is never tried again and the failure is logged once."""
    x = torch.arange(3.0)
    g = PieceGraphs("cuda", LocalComm())
    with caplog.at_level(logging.INFO, logger="dsv41.runtime.graphs"):
        for _ in range(3):
            assert torch.equal(g.run("p", "decode", 1, lambda t: t + 1, x), x + 1)
    assert g.stats.failed == 1 and g.stats.captures == 0 and g.stats.eager == 3
    assert g.stats.refused == {"capture failed": 3}
    assert g.decide(piece_key("p", "decode", 1, (x,))) == "capture failed"
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("CUDA graphs: capture of p (decode, n=1) failed")
    assert lines[1] == "CUDA graphs: pieces run eagerly (capture failed)"


class _Graph:
    """A stand-in for a captured CUDAGraph: replay applies the piece to the static buffers."""

    def __init__(self, statics, outs):
        self.statics, self.outs, self.replays = statics, outs, 0

    def replay(self):
        self.replays += 1
        self.outs[0].copy_(self.statics[0] * 2)


def test_replay_copies_inputs_and_keeps_adopted_buffers():
    g = PieceGraphs("cuda", LocalComm())
    s_in, s_out = torch.zeros(3), torch.zeros(3)
    graph = _Graph([s_in], [s_out])
    piece = Piece(graph, [s_in], [False], G._LEAF, [s_out])
    x = torch.tensor([1.0, 2.0, 3.0])
    out = g._replay(piece, lambda t: t * 2, (x,))
    assert out is s_out and torch.equal(out, x * 2) and torch.equal(s_in, x) and graph.replays == 1
    out = g._replay(piece, lambda t: t * 2, (s_in,))  # the static buffer itself: no copy
    assert torch.equal(out, x * 2) and graph.replays == 2
    # an adopted input (another piece's output) is never written: a different tensor runs the call eagerly
    adopted = torch.full((3,), 5.0)
    piece = Piece(_Graph([adopted], [s_out]), [adopted], [True], G._LEAF, [s_out])
    y = torch.full((3,), 7.0)
    out = g._replay(piece, lambda t: t * 2, (y,))
    assert torch.equal(out, y * 2) and out is not s_out and torch.equal(adopted, torch.full((3,), 5.0))
    assert g.stats.refused == {"adopted input not passed on": 1}
    out = g._replay(piece, lambda t: t * 2, (adopted,))
    assert out is s_out and torch.equal(out, adopted * 2) and g.stats.replays == 3


# ------------------------------------------------------------------------------------------------ the cut
def test_forward_pieces_on_cpu(tmp_path):
    """A decode forward runs embed, attn_in.L and ffn.L per layer, and final through the piece runner (eager here);
    a prefill runs none of them through it. (The release's FP8 layout: plain torch on the CPU, no interpreter.)"""
    from test_runtime_fast import LITE

    from dsv41.runtime.build import build_fast_model
    from dsv41.tiny.model import make_tiny

    model = build_fast_model(make_tiny(tmp_path / "fp8", "fp8", seed=1, overrides=LITE), "cpu", torch.float32)
    names = []
    real_run = PieceGraphs.run

    def spy(self, name, phase, n, fn, *args, tracing=False):
        names.append((name, phase, n))
        return real_run(self, name, phase, n, fn, *args, tracing=tracing)

    PieceGraphs.run = spy
    try:
        st = model.new_state()
        model.forward([(st, [0, 5, 7, 9])], "prefill")
        assert names == []
        a, b = model.new_state(), model.new_state()
        model.forward([(a, [3])], "prefill")
        model.forward([(b, [4])], "prefill")
        logits = model.forward([(st, [11]), (a, [12]), (b, [13])], "decode")
    finally:
        PieceGraphs.run = real_run
    L = [blk.index for blk in model.blocks]
    assert [nm for nm, _, _ in names] == ["embed", *[f"{p}.{i}" for i in L for p in ("attn_in", "ffn")], "final"]
    assert {(ph, n) for _, ph, n in names} == {("decode", 3)}
    assert logits.shape == (3, model.cfg.vocab_size) and torch.isfinite(logits).all()
    assert model.graphs.stats.refused == {"not CUDA": len(names)}


def _scribble(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else -1)


class _Replayer:
    """A stand-in for a captured graph with a graph's buffer semantics, worst case: the outputs are fixed tensors,
    rewritten by each replay from the static inputs; and since the pieces share one pool, a replay may overwrite
    the outputs of every piece captured after it (its freed intermediates may hold them): all of them are scribbled
    over (NaN / -1). Static inputs made by clone lie outside the pool and survive."""

    def __init__(self, owner, fn, static_args, outs, pooled):
        self.owner, self.fn, self.static_args, self.outs, self.pooled = owner, fn, static_args, outs, pooled

    def replay(self):
        fresh: list = []
        G.flatten(self.fn(*self.static_args), fresh)
        for later in self.owner.order[self.owner.order.index(self) + 1:]:
            for out in later.pooled:
                _scribble(out)
        for out, new, pooled in zip(self.outs, fresh, self.pooled_mask):
            if pooled:
                _scribble(out)
                out.copy_(new)

    @property
    def pooled_mask(self):
        return [any(o is p for p in self.pooled) for o in self.outs]


class _EmulatedGraphs(PieceGraphs):
    """PieceGraphs whose captures are `_Replayer`s (the CPU runs the pieces): the forward's use of static inputs,
    adopted buffers and outputs is exercised as CUDA graphs in one shared pool could at worst treat them."""

    def __init__(self):
        super().__init__("cuda", LocalComm(), enabled=True, budget_s=1e9)
        self.order: list = []

    def _make(self, fn, args, warmup=None):
        if warmup is not None:  # the warm-up run on its own inputs, as PieceGraphs._make does
            fn(*warmup())
        leaves: list = []
        spec = G.flatten(args, leaves)
        adopted = [self._owned.get(id(t)) is t for t in leaves]
        statics = [t if a else t.clone() for t, a in zip(leaves, adopted)]
        static_args = G.unflatten(spec, iter(statics))
        outs: list = []
        out_spec = G.flatten(fn(*static_args), outs)
        outs = [o if any(o is t for t in statics) else o.clone() for o in outs]
        pooled = [o for o in outs if not any(o is t for t in statics)]
        graph = _Replayer(self, fn, static_args, outs, pooled)
        self.order.append(graph)
        return Piece(graph, statics, adopted, out_spec, outs)


def test_forward_through_emulated_graphs_equals_eager(tmp_path):
    """Decode steps and verify windows (1, 3 and 20 sequences: two buckets) through pieces with a graph's buffer
    semantics give the eager forward's logits bitwise, step after step (states advancing); the second step of each
    shape only replays, and each piece's static inputs are copied or adopted as on the GPU."""
    from test_runtime_fast import LITE

    from dsv41.runtime.build import build_fast_model
    from dsv41.tiny.model import make_tiny

    model = build_fast_model(make_tiny(tmp_path / "fp8", "fp8", seed=1, overrides=LITE), "cpu", torch.float32)
    states = [model.new_state() for _ in range(20)]
    model.forward([(s, [0] + [(i * (31 + 2 * k)) % 500 + 5 for i in range(5 + k)]) for k, s in enumerate(states)],
                  "prefill")
    pieces = 2 + 2 * len(model.blocks)
    emu = _EmulatedGraphs()
    for phase, toks in (("decode", [[3]]), ("decode", [[3], [4], [5]]), ("verify", [[5, 6, 7], [8]]),
                        ("decode", [[(7 * k) % 500 + 3] for k in range(20)])):
        sts = states[:len(toks)]
        eager = _steps(model, PieceGraphs("cpu", LocalComm(), enabled=False), sts, toks, 3, phase)
        before = emu.stats.as_dict()
        graphed = _steps(model, emu, sts, toks, 3, phase)
        buckets = 2 if len(toks) > 16 else 1
        assert emu.stats.captures - before["captures"] == buckets * pieces
        assert emu.stats.replays - before["replays"] == 3 * buckets * pieces and emu.stats.eager == 0
        for i, (e, g) in enumerate(zip(eager, graphed)):
            assert torch.equal(e, g), f"{phase} {len(toks)} sequences: step {i}"
    # the embed piece's P and the chained streams are adopted downstream: few copies per replay
    adopted = sum(sum(p.adopted) for p in emu._pieces.values())
    assert adopted >= len(emu._pieces) * 2


# ------------------------------------------------------------------------------------------------ GPU
def _prefilled(model, n: int):
    states = [model.new_state() for _ in range(n)]
    prompts = [[0] + [(i * (31 + 2 * s)) % 500 + 5 for i in range(9 + s)] for s in range(n)]
    model.forward(list(zip(states, prompts)), "prefill")
    return states


def _steps(model, graphs, states, toks, steps, phase="decode"):
    """`steps` forwards from copies of `states`, each feeding back its argmax; the logits of each step."""
    model.graphs = graphs
    states = [copy.deepcopy(s) for s in states]
    out = []
    for _ in range(steps):
        logits = model.forward(list(zip(states, toks)), phase, logits="all")
        out.append(logits)
        nxt, at = [], 0
        for t in toks:
            at += len(t)
            nxt.append([int(logits[at - 1].argmax())] * len(t))
        toks = nxt
    return out


@pytest.mark.gpu
def test_gpu_graph_steps_equal_eager_bitwise(tiny_model_dir):
    from dsv41.runtime.build import build_fast_model

    model = build_fast_model(tiny_model_dir, "cuda", torch.bfloat16)
    dev = model.device
    states = _prefilled(model, 16)
    pieces = 2 + 2 * len(model.blocks)
    on = PieceGraphs(dev, model.comm, enabled=True, budget_s=600)
    off = PieceGraphs(dev, model.comm, enabled=False)
    cases = [("decode", [[(37 * s) % 500 + 3] for s in range(k)], states[:k]) for k in (1, 3, 16)]
    window = [[5, 6, 7, 8]] + [[(37 * s) % 500 + 3] for s in range(1, 13)]
    cases += [("verify", [[5, 6, 7, 8]], states[:1]), ("verify", window, states[:13])]
    for phase, toks, sts in cases:
        before = on.stats.as_dict()
        eager = _steps(model, off, sts, toks, 3, phase)
        graphed = _steps(model, on, sts, toks, 3, phase)
        after = on.stats.as_dict()
        what = f"{phase} of {len(toks)} sequences ({sum(map(len, toks))} rows)"
        assert after["failed"] == 0, (what, after)
        assert after["captures"] - before["captures"] == pieces, (what, after)  # first step: every piece once
        assert after["replays"] - before["replays"] == 3 * pieces, (what, after)  # then each step replays
        assert after["eager"] == before["eager"], (what, after)
        for i, (e, g) in enumerate(zip(eager, graphed)):
            assert torch.equal(e, g), f"{what}: step {i} differs between the graphs and eager"
    assert off.stats.captures == 0 and off.stats.replays == 0


@pytest.mark.gpu
def test_gpu_graph_outputs_survive_other_buckets(tiny_model_dir):
    """20 sequences in one decode forward (a 16-row bucket, then 4): the first bucket's logits are a copy, intact
    after the second bucket's pieces replay; and equal to eager."""
    from dsv41.runtime.build import build_fast_model

    model = build_fast_model(tiny_model_dir, "cuda", torch.bfloat16)
    states = _prefilled(model, 20)
    toks = [[(11 * s) % 500 + 3] for s in range(20)]
    off = PieceGraphs(model.device, model.comm, enabled=False)
    on = PieceGraphs(model.device, model.comm, enabled=True, budget_s=600)
    eager = _steps(model, off, states, toks, 2)
    graphed = _steps(model, on, states, toks, 2)
    assert on.stats.failed == 0 and on.stats.replays > 0
    for e, g in zip(eager, graphed):
        assert torch.equal(e, g)
