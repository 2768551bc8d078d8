"""The pool's cache writes in one launch (dsv41.kernels.step.cache.store_rows) against the pool's own encoders.

For every codec of runtime/kv_pool.py and bf16 / fp16 / fp32 inputs: the bytes written to row dest[b] are
`codec.encode(x[b:b + 1])` exactly (random rows over 1e-8..1e4, zeros, -0.0, e2m1 / e4m3 rounding ties, the e4m3
scale's ties, amax at, under and over the floors), rows with dest -1 and rows never addressed keep their bytes, dests
come in any order; a pool written through the kernel is byte for byte a pool written by its own methods; and the
idempotence the pool relies on: writing fake_quant(x) stores what decodes to fake_quant(x) (the reference's
quantiser) == decode(encode(x)). CPU: Triton's interpreter in one child process (tests/step_harness.py); GPU:
compiled, in-process.
"""

from __future__ import annotations

import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _codecs():
    from dsv41.runtime.kv_pool import Fp4E4m3, Fp4Ue8m0, Fp8Ue8m0, Raw

    # 96 / 32 and 80 / 16 blocks: a block count that is no power of two (the kernel pads its tile)
    return (Fp8Ue8m0(96), Fp4E4m3(80), Fp4Ue8m0(96), Raw(40, torch.bfloat16), Raw(40, torch.float16),
            Raw(24, torch.float32))


def _fake(codec):
    from dsv41.model.quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0

    return {"fp8-e4m3/ue8m0-32": lambda x: fp8_block_ue8m0(x, 32, True),
            "fp4-e2m1/e4m3-16": lambda x: fp4_block_e4m3(x, 16, True),
            "fp4-e2m1/ue8m0-32": lambda x: fp4_block_ue8m0(x, 32, True)}.get(codec.name)


def _tile(values, dim: int) -> torch.Tensor:
    v = torch.tensor(values, dtype=torch.float32)
    return v.repeat(-(-dim // v.numel()))[:dim]


def _nasty(dim: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 rows that probe every rounding rule of the encoders (their dtype cast comes after)."""
    rows = [torch.randn(10, dim, generator=gen) * torch.logspace(-8, 4, 10)[:, None],
            torch.zeros(1, dim), torch.full((1, dim), -0.0),
            torch.where(torch.arange(dim) % 2 == 0, -0.0, 0.0)[None],
            (torch.randn(1, dim, generator=gen) * 1e-30)]  # every value rounds to a signed zero code
    # e2m1 ties after the block scale (amax 6 -> scale 1 for both FP4 codecs); 6.0 in every block of 16
    e2m1_ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.75, -5.0, 0.0, -0.0, -2.5, 6.0]
    rows += [_tile(e2m1_ties, dim)[None], (_tile(e2m1_ties, dim) * 2.0 ** -20)[None],
             (_tile(e2m1_ties, dim) * 448 / 6)[None]]
    # e4m3 ties (amax 448 -> scale 1 for FP8), normal and subnormal, at both parities of the lower neighbour
    e4m3_ties = [448.0, 432.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -10, -1.0625,
                 -(2.0 ** -10), -432.0, 13 * 2.0 ** -10, 240.0, -0.0, 0.0, 1.0, -448.0]
    rows += [_tile(e4m3_ties, dim)[None]]
    # the FP4 e4m3 scale at its ties: amax / 6 = 1.0625 (-> 1.0), 1.1875 (-> 1.25), 3 * 2^-10 (-> 2^-8)
    lin = torch.linspace(-1.0, 1.0, dim)  # |.| reaches 1 exactly: amax = the factor
    for a in (6 * 1.0625, 6 * 1.1875, 6 * 3 * 2.0 ** -10, 448 * (1 + 2.0 ** -23), 448.0):
        rows.append((lin * a)[None])
    # amax at, under and over each floor (fp8 1e-4, fp4/e4m3 6 * 2^-9, fp4/ue8m0 6 * 2^-126)
    for floor in (1e-4, 6 * 2.0 ** -9, 6 * 2.0 ** -126):
        f = torch.tensor(floor, dtype=torch.float32)
        for k in (1.0, 0.5, 1.0 + 2.0 ** -20):
            rows.append((lin * (f * k))[None])
    return torch.cat(rows)


def _cases():
    """(name, codec, store before, x, dest) per codec and input dtype."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for codec in _codecs():
        for dtype in DTYPES:
            x = _nasty(codec.dim, gen).to(dtype)
            if dtype == torch.float16:  # a column stride != 1 (a transposed view)
                x = x.t().contiguous().t()
            n = x.shape[0]
            total = 4 * -(-(n + 6) // 4)
            store = torch.randint(0, 256, (total, codec.row_bytes), dtype=torch.uint8, generator=gen)
            if codec.name == "raw-float32":  # as the pool's open-group store: fp32 [slots, r - 1, 2, hd]
                store = store.view(torch.float32).view(4, total // 4, 2, codec.dim // 2)
            else:
                store = store.view(4, total // 4, codec.row_bytes)
            dest = torch.randperm(total, generator=gen)[:n]
            dest[::5] = -1
            dest = dest.to(torch.int32 if dtype == torch.bfloat16 else torch.int64)
            out.append((f"{codec.name}-{_SHORT[dtype]}", codec, store, x, dest))
    return out


# fp4_block_e4m3 is not idempotent for a block amax in about [6 * 1.5 * 2^-9, 6 * 5/3 * 2^-9): its e4m3 scale is
# subnormal there and rounds up so far (amax / 6 = 1.5 * 2^-9 -> 2^-8) that amax / scale rounds down to 4, and the
# requantised amax 4 * scale then gets a smaller scale (test_fp4_e4m3_fake_quant_is_not_idempotent_near_0_018).
E4M3_SCALE_WINDOW = (6 * 1.5 * 2.0 ** -9, 6 * (5 / 3) * 2.0 ** -9 + 1e-6)


def _idempotence_cases():
    """(name, codec, x0) for the quantised codecs; the kernel writes fake_quant(x0). fp16 over 0.1..1e3 only:
    outside, the fake quantiser's own fp16 output is not on the code grid (fp16 under- / overflows the scaled
    values). Fp4E4m3 without the rows that have a block amax in E4M3_SCALE_WINDOW."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for codec in _codecs()[:3]:
        for dtype in DTYPES:
            if dtype == torch.float16:
                x0 = (torch.randn(12, codec.dim, generator=gen) * torch.logspace(-1, 3, 12)[:, None]).to(dtype)
            else:
                x0 = _nasty(codec.dim, gen).to(dtype)
            if codec.name == "fp4-e2m1/e4m3-16":
                amax = x0.float().abs().view(x0.shape[0], -1, 16).amax(-1)
                x0 = x0[~((amax >= E4M3_SCALE_WINDOW[0]) & (amax < E4M3_SCALE_WINDOW[1])).any(1)]
            out.append((f"{codec.name}-{_SHORT[dtype]}", codec, x0))
    return out


def _pool_twins(device="cpu"):
    """Two equal small pools and the writes of one step: window rows, compressed entries, index keys, open groups."""
    from dsv41.runtime.kv_pool import KVPool, SourceLayout

    def pool():
        return KVPool(num_slots=3, num_pages=4, page_tokens=16, ring_rows=8, window_layers=[0, 1],
                      sources=[SourceLayout(1, 4, 4, True)], head_dim=64, index_head_dim=32, device=device)

    gen = torch.Generator().manual_seed(3)
    writes = {"window": torch.randn(3, 64, generator=gen), "kv": torch.randn(3, 64, generator=gen) * 30,
              "index_k": torch.randn(3, 32, generator=gen) * 1e-3,
              "open_v": torch.randn(2, 64, generator=gen), "open_s": torch.randn(2, 64, generator=gen)}
    return pool(), pool(), writes


def _write_pool_by_kernel(p, w):
    from dsv41.kernels.step.cache import store_rows

    # slot 2, positions 6, 7, 8 of the ring (8 rows: 8 wraps to row 0), layer 1; entries 3, 4, 5 of pages [2, 0]
    from dsv41.runtime.kv_pool import Raw

    dev = p.device
    ring = torch.tensor([2 * 8 + 6, 2 * 8 + 7, 2 * 8 + 0], device=dev)
    store_rows(p.stores[("window", 1)], w["window"].to(dev), ring, p.window_codec)
    entries = torch.tensor([2 * 4 + 3, 0 * 4 + 0, 0 * 4 + 1], dtype=torch.int32, device=dev)
    store_rows(p.stores[("kv", 1)], w["kv"].to(dev), entries, p.kv_codec)
    store_rows(p.stores[("index_k", 1)], w["index_k"].to(dev), entries, p.index_codec)
    open_rows = torch.cat((w["open_v"], w["open_s"]), dim=1).to(dev)  # row (slot, i): its value, then its gate
    store_rows(p.stores[("open", 1)], open_rows, torch.tensor([1 * 3 + 0, 1 * 3 + 1], device=dev),
               Raw(128, torch.float32))


def _write_pool_by_methods(p, w):
    p.write_ring("window", 1, 2, 6, w["window"])
    p.write_entries(1, [2, 0], 3, w["kv"], w["index_k"])
    p.write_open(1, 1, w["open_v"], w["open_s"])


def _run_all():
    """What the kernel writes, per case (the device is the inputs')."""
    from dsv41.kernels.step.cache import store_rows

    got = {}
    for name, codec, store, x, dest in _cases():
        store = store.clone()
        store_rows(store, x, dest, codec)
        got[name] = store
    for name, codec, x0 in _idempotence_cases():
        x = _fake(codec)(x0)
        store = torch.zeros(x.shape[0], codec.row_bytes, dtype=torch.uint8)
        store_rows(store, x, torch.arange(x.shape[0]), codec)
        got["idem-" + name] = store
    p, _, w = _pool_twins()
    _write_pool_by_kernel(p, w)
    got["pool"] = p.buffer
    return got


def _interp_worker(out_path: str) -> None:
    torch.save(_run_all(), out_path)


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "cache")


def _want(codec, store, x, dest) -> torch.Tensor:
    want = store.clone()
    rows = want.view(torch.uint8).view(-1, codec.row_bytes)
    for b in range(x.shape[0]):
        if dest[b] >= 0:
            rows[int(dest[b])] = codec.encode(x[b:b + 1])[0]
    return want


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(-1)


def _check_case(got: torch.Tensor, codec, store, x, dest) -> None:
    want = _want(codec, store, x, dest)
    assert got.shape == store.shape and got.dtype == store.dtype
    g = _bytes(got).view(-1, codec.row_bytes)
    w = _bytes(want).view(-1, codec.row_bytes)
    bad = (g != w).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ (dest -1 / untouched rows: {set(bad) - set(dest.tolist())})"


def _check_idempotence(raw: torch.Tensor, codec, x0: torch.Tensor) -> None:
    x = _fake(codec)(x0)
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x0.dtype]
    assert torch.equal(raw, codec.encode(x))
    back = codec.decode(raw, x0.dtype)
    assert torch.equal(back.view(ints), x.view(ints)), "decode(store_rows(fake_quant(x))) != fake_quant(x)"
    assert torch.equal(back.view(ints), codec.decode(codec.encode(x0), x0.dtype).view(ints))


def _check_pool(buffer: torch.Tensor) -> None:
    _, p, w = _pool_twins()
    _write_pool_by_methods(p, w)
    assert torch.equal(buffer, p.buffer)


@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_interpreted_rows_are_codec_encode(interp, name):
    _, codec, store, x, dest = next(c for c in _cases() if c[0] == name)
    _check_case(interp[name], codec, store, x, dest)


@pytest.mark.parametrize("name", [c[0] for c in _idempotence_cases()])
def test_interpreted_fake_quantised_rows_read_back_as_the_reference(interp, name):
    _, codec, x0 = next(c for c in _idempotence_cases() if c[0] == name)
    _check_idempotence(interp["idem-" + name], codec, x0)


def test_interpreted_pool_writes_are_the_pool_methods(interp):
    _check_pool(interp["pool"])


def test_fp4_e4m3_fake_quant_is_not_idempotent_near_0_018():
    """A property of the reference quantiser (not of the kernel, which matches `encode` there too): the pool, which
    encodes already fake-quantised compressed KV, reads back another value for such a block."""
    from dsv41.model.quant import fp4_block_e4m3

    x = torch.zeros(1, 16)
    x[0, 0] = 6 * 1.5 * 2.0 ** -9  # scale e4m3(1.5 * 2^-9) = 2^-8 (the tie to even), amax / scale = 4.5 -> 4
    once = fp4_block_e4m3(x, 16, True)
    assert once[0, 0] == 2.0 ** -6 and fp4_block_e4m3(once, 16, True)[0, 0] == 6 * 2.0 ** -9


def test_an_empty_batch_writes_nothing():
    from dsv41.kernels.step.cache import store_rows
    from dsv41.runtime.kv_pool import Fp8Ue8m0

    store = torch.full((3, Fp8Ue8m0(32).row_bytes), 7, dtype=torch.uint8)
    store_rows(store, torch.zeros(0, 32), torch.zeros(0, dtype=torch.int64), Fp8Ue8m0(32))
    assert (store == 7).all()


@pytest.mark.parametrize("bad, match", [
    ("dim", r"x must be \[rows, 64\]"),
    ("noncontiguous", "store must be contiguous"),
    ("dest_float", "dest must be int32 or int64"),
    ("dest_int16", "dest must be int32 or int64"),
    ("dest_shape", r"dest must be \[4\]"),
    ("bytes", "not a whole number of"),
    ("x_int", "x must be bf16 / fp16 / fp32"),
    ("codec", "no kernel reads the pool codec"),
])
def test_bad_arguments_are_refused_by_name(bad, match):
    from dsv41.kernels.step.cache import store_rows
    from dsv41.runtime.kv_pool import Fp4E4m3, Raw

    codec = Fp4E4m3(64)
    store = torch.zeros(8, codec.row_bytes, dtype=torch.uint8)
    x, dest = torch.zeros(4, 64), torch.arange(4)
    if bad == "dim":
        x = torch.zeros(4, 48)
    elif bad == "noncontiguous":
        store = torch.zeros(8, 2 * codec.row_bytes, dtype=torch.uint8)[:, ::2]
    elif bad == "dest_float":
        dest = dest.float()
    elif bad == "dest_int16":
        dest = dest.to(torch.int16)
    elif bad == "dest_shape":
        dest = torch.arange(3)
    elif bad == "bytes":
        store = torch.zeros(8 * codec.row_bytes + 1, dtype=torch.uint8)
    elif bad == "x_int":
        x = torch.zeros(4, 64, dtype=torch.int32)
    elif bad == "codec":
        codec = Raw(64, torch.int32)
        store = torch.zeros(8, codec.row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        store_rows(store, x, dest, codec)


# ---------------------------------------------------------------------------------------------------- GPU twins
@pytest.mark.gpu
@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_gpu_rows_are_codec_encode(name):
    need_compiled_cuda()
    from dsv41.kernels.step.cache import store_rows

    _, codec, store, x, dest = next(c for c in _cases() if c[0] == name)
    got = store.cuda()
    store_rows(got, x.cuda(), dest.cuda(), codec)
    _check_case(got.cpu(), codec, store, x, dest)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c[0] for c in _idempotence_cases()])
def test_gpu_fake_quantised_rows_read_back_as_the_reference(name):
    need_compiled_cuda()
    from dsv41.kernels.step.cache import store_rows

    _, codec, x0 = next(c for c in _idempotence_cases() if c[0] == name)
    x = _fake(codec)(x0).cuda()
    raw = torch.zeros(x.shape[0], codec.row_bytes, dtype=torch.uint8, device="cuda")
    store_rows(raw, x, torch.arange(x.shape[0], device="cuda"), codec)
    _check_idempotence(raw.cpu(), codec, x0)


@pytest.mark.gpu
def test_gpu_pool_writes_are_the_pool_methods():
    need_compiled_cuda()
    p, _, w = _pool_twins("cuda")
    _write_pool_by_kernel(p, w)
    _check_pool(p.buffer.cpu())


@pytest.mark.gpu
def test_gpu_store_rows_is_one_graph_capturable_launch():
    need_compiled_cuda()
    from dsv41.kernels.step.cache import store_rows

    _, codec, store, x, dest = next(c for c in _cases() if c[0] == "fp4-e2m1/e4m3-16-bf16")
    got, xd, dd = store.cuda(), x.cuda(), dest.cuda()
    store_rows(got, xd, dd, codec)  # compile outside the capture
    got.copy_(store.cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_rows(got, xd, dd, codec)
    graph.replay()
    torch.cuda.synchronize()
    _check_case(got.cpu(), codec, store, x, dest)


if __name__ == "__main__" and sys.argv[1:2] == ["--interp-worker"]:
    _interp_worker(sys.argv[2])
