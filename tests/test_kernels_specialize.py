"""A kernel compiles once, whatever a request's lengths (row counts, entries, positions).

Triton compiles a kernel per specialisation of its integer arguments: each is specialised on being 1 and on being
divisible by 16. A row count, an entry count or a position that varies per call would give a new compile (0.2-2 s of
a request's time to first token, on both ranks) the first time each combination comes up, and a 1-row chunk would
run other code than a 2,048-row one. So every launched kernel lists such arguments in `do_not_specialize`; the model's
sizes and the strides of fixed layouts stay specialised (they never vary). CPU: the lists (the names that mean a
per-call count or position); GPU: prefill chunks of other lengths at other positions compile nothing new.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

PER_CALL = {"n_rows", "n_pairs", "live_rows", "n_ids", "n_pages", "ncols", "R", "B", "M", "n_slots", "n_tokens",
            "pos", "first", "floor"}

# arguments that are model constants elsewhere but follow a prefill chunk's length and position in these kernels
# (found on the GPU: each toggled the %16 key across chunks of 1/7/16/33/300 rows)
PER_CALL_HERE = {"_core_split_kernel": {"S", "sot", "window", "width"},
                 "_slot_index_kernel": {"S", "window", "width", "W"}}


def _kernels():
    import triton

    import dsv41.kernels as package

    for info in pkgutil.walk_packages(package.__path__, "dsv41.kernels."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == module.__name__:
                if name.endswith("_kernel"):  # launched (the helpers are inlined into their callers)
                    yield f"{info.name}.{name}", obj, [p.name for p in obj.params if not p.is_constexpr]


def test_launched_kernels_do_not_specialise_on_per_call_counts():
    kernels = list(_kernels())
    assert len(kernels) >= 20, [k for k, *_ in kernels]
    missing = {}
    for name, fn, params in kernels:
        skip = {params[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
        lacking = sorted((set(params) & (PER_CALL | PER_CALL_HERE.get(name.rsplit(".", 1)[1], set()))) - skip)
        if lacking:
            missing[name] = lacking
    assert not missing, f"kernels specialised on per-call counts (add them to do_not_specialize): {missing}"


@pytest.mark.gpu
def test_gpu_prefill_chunks_of_any_length_compile_once(tmp_path):
    """The slimmed tiny model's prefill on CUDA: after one chunk, chunks of 1, 7, 16, 33 and 300 rows at other
    positions leave every kernel's compile cache as it was."""
    from step_harness import need_compiled_cuda

    need_compiled_cuda()
    from dsv41.runtime.build import build_fast_model
    from dsv41.tiny.model import make_tiny
    from test_runtime_fast import LITE

    model = build_fast_model(make_tiny(tmp_path / "model", "exl3", seed=0, overrides=LITE),
                             "cuda", torch.float32, fake_quant=True)
    ids = torch.tensor([0] + [(i * 37) % 500 + 5 for i in range(700)], device="cuda")

    def caches():
        return {name: len(fn.device_caches[torch.cuda.current_device()][0]) for name, fn, _ in _kernels()}

    st = model.new_state()
    model.forward([(st, ids[:40])], "prefill", logits="all")
    model.forward([(st, ids[40:61])], "prefill", logits="all")  # the second chunk: carried groups and a rolled window
    before = caches()
    at = 61
    for n in (1, 7, 16, 33, 300):
        model.forward([(st, ids[at:at + n])], "prefill", logits="all")
        at += n
    torch.cuda.synchronize()
    grew = {k: (before[k], v) for k, v in caches().items() if v != before[k]}
    assert not grew, f"kernels compiled again for other chunk lengths: {grew}"
