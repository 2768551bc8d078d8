"""The device-side Engram gate (runtime/engram_gate.py, kernels/step/engram_gate.py; docs/ENGINE.md §6).

CPU: the host's part (numbering, the rows' layout in the tables, publishing in step order by parity, an abandoned
step, the deadline's record turned into a clear error, the check run with a launched step's sample); the kernel in
Triton's interpreter (a child process, tests/step_harness.py): it waits for a host thread that publishes late, copies
the step's rows from its parity's buffer to exactly the bytes the ungated tables carry, and gives up at its
deadline; and its ahead-of-time compile for sm_90 and sm_121 (the global timer, the acquire load, volatile polls).
GPU: the gate inside a captured graph replayed for several steps with the rows published after the launch, the
deadline on the device, and the fast forward's engine with the gate, overlapped, == serial without it, bitwise.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

WIDTHS = {1: 37, 4: 21}  # layer -> stored bytes a row (not whole words: the padding travels too)
COLS = 3


def stored_rows(B: int, seed: int) -> dict:
    """layer -> RowBytes `[B, COLS, width]` of random bytes."""
    from dsv41.engram.shards import RowBytes

    rng = np.random.default_rng(seed)
    return {L: RowBytes(rng.integers(0, 256, (B, COLS, w), dtype=np.uint8), "fp8", 32) for L, w in WIDTHS.items()}


def tables_of(B: int, inputs: dict, device="cpu"):
    """Step tables of B rows carrying `inputs` (a slot table, the ids and positions first, as the step's)."""
    from dsv41.runtime.step_tables import PlannedTables

    parts = {"slot": np.arange(B, dtype=np.int64)}
    return PlannedTables(B, B, parts, {}, 1).pack(torch.device(device), {"ids": np.arange(B), "pos": np.arange(B),
                                                                         **inputs})


def gated_tables(gate, B: int, step: int, device="cpu"):
    from dsv41.runtime.engram_gate import GATE_STEP

    return tables_of(B, {GATE_STEP: np.array([step]), **gate.placeholders(B)}, device)


def ungated_words(gate, B: int, stored: dict) -> torch.Tensor:
    """The Engram span of the tables as the ungated step packs them (the rows in the one copy)."""
    t = tables_of(B, {f"engram.{L}": r.data for L, r in stored.items()})
    at, W = gate.region(t)
    return t.packed[at:at + W].clone()


def new_gate(wait_s: float = 30.0, device="cpu"):
    from dsv41.runtime.engram_gate import EngramGate

    gate = EngramGate(device, wait_s, max_rows=8)
    gate.learn(stored_rows(1, 0))
    return gate


# ---------------------------------------------------------------------------------------------------- host's part
def test_env_switches():
    from dsv41.runtime.engram_gate import env_gate, env_wait_s

    assert env_gate({}) and not env_gate({"DSV41_ENGRAM_GATE": "0"}) and env_gate({"DSV41_ENGRAM_GATE": "1"})
    assert env_wait_s({}) == 300.0 and env_wait_s({"DSV41_ENGRAM_WAIT_S": "2.5"}) == 2.5
    with pytest.raises(ValueError, match="DSV41_ENGRAM_WAIT_S"):
        env_wait_s({"DSV41_ENGRAM_WAIT_S": "0"})


def test_tp2_gets_the_gate_only_where_asked_for_explicitly():
    # at TP > 1 the gate is opt-in (no GPU run of the gated TP = 2 step yet): by default a rank's model gets none
    from types import SimpleNamespace

    from dsv41.runtime.engram_gate import for_model

    rank = SimpleNamespace(engram={1: None}, engram_hasher=object(), device=torch.device("cuda"),
                           comm=SimpleNamespace(world=2))
    assert for_model(rank, 8, {}) is None and for_model(rank, 8, {"DSV41_ENGRAM_GATE": "0"}) is None
    if torch.cuda.is_available():
        assert for_model(rank, 8, {"DSV41_ENGRAM_GATE": "1"}) is not None
        assert for_model(SimpleNamespace(**{**vars(rank), "comm": SimpleNamespace(world=1)}), 8, {}) is not None


def test_layout_numbering_and_publishing_by_parity():
    gate = new_gate()
    assert gate.ready and [gate.number() for _ in range(3)] == [1, 2, 3]
    # the buffers hold the most rows; the placeholders reserve one span of the tables, where the rows would be
    assert gate.capacity == gate.words(8) == 8 * COLS * (5 + 3)
    t = gated_tables(gate, 4, step=1)
    at, W = gate.region(t)
    assert W == gate.words(4) and t.packed[at:at + W].eq(0).all()
    for step in (1, 2, 3):
        stored = stored_rows(4, seed=step)
        gate.feed(step, lambda: stored, 4)
        # the word is the step; its parity's buffer holds the words the ungated tables carry
        assert int(gate.word) == step == gate.published
        assert torch.equal(gate.rows[step % 2, :W], ungated_words(gate, 4, stored))
    assert torch.equal(gate.rows[1, :W], ungated_words(gate, 4, stored_rows(4, seed=3)))  # step 3 over step 1
    with pytest.raises(RuntimeError, match="step 3 published after step 3"):
        gate.publish(3, None)
    with pytest.raises(RuntimeError, match="formats"):  # another row width than the buffers were sized for
        gate.learn({1: stored_rows(2, 0)[4], 4: stored_rows(2, 0)[4]})
    with pytest.raises(RuntimeError, match="words of rows for a 4-row step"):  # rows of another bucket
        gate.feed(gate.number(), lambda: stored_rows(2, 0), 4)
    assert int(gate.word) == 4  # (abandoned: the device goes on)


def test_a_failed_read_releases_the_device_and_fails_the_step():
    from dsv41.runtime.engram_gate import GateTimeout

    gate = new_gate()
    gate.feed(gate.number(), lambda: stored_rows(2, 1), 2)
    gate.launched(1)
    step = gate.number()

    def broken():
        raise OSError("NVMe read failed")

    with pytest.raises(OSError, match="NVMe"):
        gate.feed(step, broken, 2)
    assert int(gate.word) == step  # the device's gate passes at once
    gate.launched(step)
    steps = gate.take_steps()
    assert steps == [1, 2] and gate.take_steps() == []
    with pytest.raises(GateTimeout, match=r"step\(s\) \[2\] ran without their Engram rows"):
        gate.check(steps)
    gate.check([1])  # the published step is fine


def test_the_deadline_record_becomes_a_clear_error():
    """The host's side of the deadline: a step the device recorded as timed out (the kernel writes it at
    step % STATUS_RING) fails its check, naming the knob; other steps, and an older step's record, do not."""
    from dsv41.kernels.step.engram_gate import STATUS_RING
    from dsv41.runtime.engram_gate import GateTimeout

    gate = new_gate(wait_s=7.0)
    gate.status[5 % STATUS_RING] = 5
    gate.check([4, 6, 5 + STATUS_RING])
    with pytest.raises(GateTimeout, match="DSV41_ENGRAM_WAIT_S=7 s"):
        gate.check([4, 5])


def test_gated_rows_run_the_gate_once_at_the_first_engram_layer():
    from dsv41.runtime.engram_gate import GatedRows

    calls = []

    class Gate:
        def wait(self, tables):
            calls.append(("wait", tables))

    def decode(tables):
        calls.append(("decode", tables))
        return {1: "rows of 1", 4: "rows of 4"}

    rows = GatedRows(Gate(), "t", decode)
    assert calls == []  # nothing before the first Engram layer asks
    assert rows[1] == "rows of 1" and rows[4] == "rows of 4" and rows[1] == "rows of 1"
    assert calls == [("wait", "t"), ("decode", "t")]


def test_a_launched_steps_check_runs_with_its_sample():
    """`PendingStep.result()` runs the check once the sample is in; a failing check fails the result."""
    from dsv41.runtime.engram_gate import GateTimeout
    from dsv41.runtime.step_handoff import PendingStep

    def check():
        raise GateTimeout("Engram gate: step(s) [3] ran without their Engram rows")

    assert PendingStep(7, None, [], None, check=check).result().step == 7  # no sample: no rows, nothing gated
    from dsv41.engine.batch import Row, RowSampling
    from dsv41.runtime.model_runner import ModelRunner
    from dsv41.runtime.step_handoff import StepSample

    rows = [Row(0, 0, [5], 0, [], sample=RowSampling(0.0, 1.0, 0, 0.0, 0, 0))]
    sample = StepSample(rows, [torch.tensor([[0.0, 2.0, 1.0]])], torch.device("cpu"), ModelRunner._choose)
    with pytest.raises(GateTimeout):
        PendingStep(7, sample, [], lambda row, lg, choice: None, check=check).result()


# ---------------------------------------------------------------------------------------------------- interpreter
def interp_worker(out: str, model_dir: str) -> None:
    """The kernel in the interpreter: what the tests below assert."""
    from dsv41.runtime.engram_gate import GateTimeout

    res = {}
    gate, B = new_gate(), 4
    # a host that publishes late (a thread, 0.2 s after the gate started waiting), steps 1..3 (both parities)
    for step in (1, 2, 3):
        assert gate.number() == step
        stored = stored_rows(B, seed=10 + step)
        t = gated_tables(gate, B, step)
        late = threading.Timer(0.2, lambda: gate.feed(step, lambda: stored, B))
        t0 = time.perf_counter()
        late.start()
        gate.wait(t)
        res[f"waited_{step}"] = time.perf_counter() - t0
        late.join()
        at, W = gate.region(t)
        res[f"equal_{step}"] = torch.equal(t.packed[at:at + W], ungated_words(gate, B, stored))
        res[f"rest_{step}"] = torch.equal(t.packed[:at], gated_tables(gate, B, step).packed[:at])
        gate.launched(step)
    gate.check(gate.take_steps())
    # a host that never publishes: the deadline (0.05 s: 50 polls here), the step goes on and is failed
    lost = new_gate(wait_s=0.05)
    t = gated_tables(lost, B, lost.number())
    t0 = time.perf_counter()
    lost.wait(t)
    res["deadline_s"] = time.perf_counter() - t0
    lost.launched(1)
    try:
        lost.check(lost.take_steps())
        res["deadline_error"] = None
    except GateTimeout as exc:
        res["deadline_error"] = str(exc)
    res.update(model_steps(model_dir))
    torch.save(res, out)


def model_steps(model_dir: str) -> dict:
    """The slimmed tiny model's decode step over the pool (a scratch row that writes nothing, as the boot capture
    runs it), in the interpreter: without the gate, and with it where the step's graph "replays" (graphs that hand
    the step back unrun, as a launch does): the host publishes after the forward returned, then the step runs and
    its gate finds the rows. The logits of both."""
    from dsv41.engine.batch import DECODE, Row
    from dsv41.runtime.build import build_fast_model
    from dsv41.runtime.engram_gate import EngramGate
    from dsv41.runtime.fast_forward import FastForward, pool_layout
    from dsv41.runtime.graphs import GraphStats
    from dsv41.runtime.kv_pool import pool_for_model
    from dsv41.runtime.model import STEP_ROWS
    from dsv41.runtime.pool_forward import load_sequences

    model = build_fast_model(model_dir, "cpu", torch.float32)
    pool = pool_for_model(pool_layout(model), num_slots=2, num_pages=4, page_tokens=8, device="cpu")
    launched = []

    class Graphs:  # eager, or (`launch`) handing the step back unrun
        active, stats, launch = True, GraphStats(), False

        def decide(self, key, tracing=False):
            return "replay" if self.launch else "not CUDA"

        def run(self, name, phase, n, fn, *args, warmup=None):
            if not self.launch:
                return fn(*args)
            launched.append((fn, args, model.engram_gate.published))
            return torch.zeros(n, model.vocab_end - model.vocab_start)

    def step():
        rows = [Row(-1, 1, [57], 6, [1, 2], lookback=[3, 10])]
        views = load_sequences(pool, rows, model.cfg, FastForward(model).decoder_from, model.engram_hasher)
        return model.forward([(v, r.token_ids) for v, r in zip(views, rows)], DECODE, logits="all", pool=pool,
                             writes=False)

    model.graphs = Graphs()
    out = {"ungated": step()}
    gate = model.engram_gate = EngramGate("cpu", max_rows=STEP_ROWS)
    gate.learn({L: e.table.submit(torch.zeros(1, gate_cols(e), dtype=torch.int64)).wait_bytes()
                for L, e in model.engram.items()})  # as a first step's read does: the rows' shapes
    model.graphs.launch = True
    step()
    fn, args, out["published_at_launch"] = launched[0]
    out["published_after"], out["fed"] = gate.published, dict(gate.fed)
    out["gated_launched"] = fn(*args)  # the step runs after the host's publish
    gate.check(gate.take_steps())
    return out


def gate_cols(engram) -> int:
    """The hash columns a table's `submit` takes (all of them)."""
    return engram.table.constants.n_cols


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    model_dir = make_tiny(tmp_path_factory.mktemp("lite_gate") / "model", "exl3", seed=0, overrides=LITE)
    return interpreted(tmp_path_factory, __file__, "engram_gate", timeout=600, extra_args=[str(model_dir)])


def test_interpreted_gate_waits_for_a_late_host_and_copies_the_steps_rows(interp):
    for step in (1, 2, 3):
        assert interp[f"waited_{step}"] >= 0.15, interp  # it waited for the publishing thread
        assert interp[f"equal_{step}"] and interp[f"rest_{step}"], (step, interp)


def test_interpreted_gate_gives_up_at_its_deadline(interp):
    assert interp["deadline_s"] < 30, interp
    assert "step(s) [1] ran without their Engram rows" in interp["deadline_error"]


def test_interpreted_model_step_with_the_gate_is_the_step_without_it(interp):
    """The decode step with the gate == without it, bitwise, with the replayed graph's order: the step (number 1)
    handed to the device before its rows were published, published after the forward returned."""
    assert interp["published_at_launch"] == 0 and interp["published_after"] == 1
    assert interp["fed"] == {"before": 0, "after": 1}
    assert torch.equal(interp["gated_launched"], interp["ungated"])
    assert interp["ungated"].abs().sum() > 0


@pytest.mark.parametrize("arch", [90, 121])
def test_kernel_compiles_for_every_target(arch):
    """Ahead of time (Triton's ptxas, no GPU): the global timer's deadline, the acquire load of the word, the
    volatile polls and row loads are in the PTX for Hopper and GB10."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from dsv41.kernels.step import engram_gate as k

    if not isinstance(k._gate_kernel, JITFunction):
        pytest.skip("kernels decorated for the interpreter in this process")
    sig = dict(tab_ptr="*i64", step_at="i32", word_ptr="*i64", rows_ptr="*i64", row_stride="i32", dst_at="i32",
               W="i32", status_ptr="*i64", limit="i64")
    const = dict(RING=k.STATUS_RING, BLOCK=k.BLOCK, TIMER=True)
    src = ASTSource(fn=k._gate_kernel, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    except RuntimeError as exc:  # no ptxas for this target in this Triton
        pytest.skip(f"Triton cannot compile for sm_{arch} here: {exc}")
    ptx = compiled.asm["ptx"]
    assert compiled.asm.get("cubin") and "%globaltimer" in ptx and "ld.volatile.global" in ptx
    assert "acquire" in ptx and "griddepcontrol" not in ptx


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_gate_in_a_captured_graph_replays_step_after_step():
    """The gate captured in a graph with a copy after it (what the step's Engram layer reads), replayed for six
    steps, each launched BEFORE the host publishes its rows (a 20 ms late host): every replay waits and then reads
    its own step's rows; then the deadline on the device (50 ms) records the step and the check fails it."""
    need_compiled_cuda()
    from dsv41.runtime.engram_gate import GateTimeout

    gate, B = new_gate(device="cuda"), 4
    static = gated_tables(gate, B, 1, "cuda")
    at, W = gate.region(static)
    out = torch.zeros(W, dtype=torch.int64, device="cuda")
    gate.feed(gate.number(), lambda: stored_rows(B, 0), B)  # step 1 published first: warm-up and capture pass
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gate.wait(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate.wait(static)
        out.copy_(static.packed[at:at + W] + 0)
    for step in range(2, 8):
        assert gate.number() == step
        static.packed.copy_(gated_tables(gate, B, step, "cuda").packed)
        graph.replay()
        gate.launched(step)
        time.sleep(0.02)
        assert not torch.cuda.current_stream().query()  # the device is waiting at the gate
        stored = stored_rows(B, seed=step)
        gate.feed(step, lambda: stored, B)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ungated_words(gate, B, stored)), step
    gate.check(gate.take_steps())
    lost = new_gate(wait_s=0.05, device="cuda")
    t = gated_tables(lost, B, lost.number(), "cuda")
    t0 = time.perf_counter()
    lost.wait(t)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 5
    lost.launched(1)
    with pytest.raises(GateTimeout, match=r"step\(s\) \[1\]"):
        lost.check(lost.take_steps())


@pytest.mark.gpu
def test_gpu_fast_forward_overlapped_with_the_gate_equals_serial(tiny_model_dir):
    """The tiny model's fast forward with its Engram layers: serial without the gate against overlapped with it
    (the follow rows' ids on the device, the rows published after the step's graph is launched once it replays),
    tokens and logprobs bitwise over 8 tokens; the gate published after the launch in most steps."""
    need_compiled_cuda()
    from test_engine_overlap import fast_events

    res = fast_events(str(tiny_model_dir), "cuda", engram=True, gate=True, tokens=8)
    print(f"fast forward with the gate: {res}")
    assert res["on"] == res["off"] and all(len(t) == 8 for t in res["on"])
    assert res["on_steps"] >= 6 and res["fed"]["after"] >= 4, res


if __name__ == "__main__":
    if sys.argv[1] == "--interp-worker":
        torch.set_num_threads(1)
        interp_worker(sys.argv[2], sys.argv[3])
