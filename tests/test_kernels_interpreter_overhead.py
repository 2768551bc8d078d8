"""The interpreter without its unread work (src/dsv41/kernels/interpreter_overhead.py): a kernel whose helpers
(`@triton.jit` functions called inside it, in a loop) do int32 arithmetic that wraps and float math gives the same
bits as under Triton's own `_patch_lang`, overflow sanitising, dtype table, type constructors and comparisons; the
language is patched once per launch instead of once per helper call (Triton's own helpers, `tl.sum` / `tl.max`: once
per process); every launch leaves `triton.language` as it found it; the kept numpy dtypes are Triton's; block types
and tensors made from what an equal shape's made before are Triton's, attribute by attribute, and the shortened
comparisons answer as Triton's. Run in a child with TRITON_INTERPRET=1 (this file as a script: the kernel's source is
rewritten by the interpreter as ours are)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if __name__ == "__main__":  # the child: the kernels at module level, where the interpreter's rewrite finds them
    import triton
    import triton.language as tl

    @triton.jit
    def mix(h, k):  # int32 products that wrap: what the overflow sanitiser recomputes in int64
        return h * 65599 + k * 40503 - (h >> 3)

    @triton.jit
    def scale(x, h):
        return x * 0.5 + (h & 1023).to(tl.float32) * 0.125

    @triton.jit
    def kernel(x_ptr, h_ptr, out_ptr, hout_ptr, N: tl.constexpr, STEPS: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * N + tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        h = tl.load(h_ptr + offs)
        for k in range(STEPS):
            h = mix(h, k)
            x = scale(x, h)
            x = x - tl.max(x, axis=0) * 0.25 + tl.sum(x, axis=0) * 0.0625  # Triton's own helpers (sees `core`)
        tl.store(out_ptr + offs, x)
        tl.store(hout_ptr + offs, h)


def _child() -> dict:
    import torch

    import dsv41.kernels  # noqa: F401 - installs the lean interpreter
    from dsv41.kernels.interpreter_overhead import install
    from triton.runtime import interpreter as it

    scopes = []
    init = it._LangPatchScope.__init__

    def counted(self):
        scopes.append(1)
        init(self)

    it._LangPatchScope.__init__ = counted
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * 16, generator=g)
    h = torch.randint(-2 ** 31, 2 ** 31 - 1, (4 * 16,), generator=g, dtype=torch.int64).to(torch.int32)

    def launch():
        out, hout = torch.empty_like(x), torch.empty_like(h)
        scopes.clear()
        kernel[(4,)](x, h, out, hout, N=16, STEPS=5)
        return out, hout, len(scopes), tl.core.is_builtin(tl.add) and tl.core.is_builtin(tl.core.tensor.__add__)

    lean_fn, options = it._patch_lang, it.interpreter_builder.options
    swapped = [(tl.core.block_type, "__init__"), (tl.core.tensor, "__init__"), (tl.core.tuple, "__eq__"),
               (tl.core.dtype, "__eq__")]
    lean_types = [getattr(cls, name) for cls, name in swapped]
    res = {"marked": getattr(lean_fn, "_dsv41_lean", False), "again": install(), "debug": options.debug,
           "sanitize": options.sanitize_overflow}
    lean = launch()
    lean_np = it._get_np_dtype
    it._patch_lang, it._get_np_dtype = lean_fn.original, lean_np.original
    it.interpreter_builder.options = type(options)()  # Triton's defaults: sanitize_overflow on
    for (cls, name), fn in zip(swapped, lean_types):
        setattr(cls, name, fn.original)
    res["default_sanitize"] = it.interpreter_builder.options.sanitize_overflow
    stock = launch()
    it._patch_lang, it._get_np_dtype, it.interpreter_builder.options = lean_fn, lean_np, options
    for (cls, name), fn in zip(swapped, lean_types):
        setattr(cls, name, fn)
    res["types"] = _types_as_triton_makes_them(tl.core, lean_types)
    again = launch()
    res.update(same_x=torch.equal(lean[0].view(torch.int32), stock[0].view(torch.int32)),
               same_h=torch.equal(lean[1], stock[1]), same_again=torch.equal(again[0], lean[0]),
               wrapped=bool(((stock[1].to(torch.int64) - h.to(torch.int64)).abs() > 2 ** 31).any()
                            or (lean[1] < 0).any()),
               scopes=[lean[2], stock[2], again[2]], restored=[lean[3], stock[3], again[3]])
    # the dtype table: every dtype of `triton.language`, blocks of them and pointers, asked twice (the second from
    # what the first kept) == Triton's own answer (or its error)
    def answer(fn, t):
        try:
            return str(fn(t))
        except Exception as exc:  # noqa: BLE001 - the same error type is the same answer
            return type(exc).__name__

    types = [getattr(tl, n) for n in dir(tl) if isinstance(getattr(tl, n), tl.dtype)]
    types += [tl.block_type(t, [4, 2]) for t in types if t.is_floating() or t.is_int()]
    types += [tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.int8), [2])]
    res["np_dtype_cases"] = len(types)
    res["np_dtype_same"] = all(answer(lean_np.original, t) == answer(lean_np, t) == answer(lean_np, t)
                               for t in types)
    return res


def _types_as_triton_makes_them(core, lean) -> list[str]:
    """Block types and tensors made by the lean constructors (twice: the second from what the first kept) against
    Triton's own, attribute by attribute in their order, errors included; the two comparisons' answers against
    Triton's. Returns the differences (none expected) and the cases counted."""
    block_init, tensor_init, tuple_eq, dtype_eq = lean

    def data(v):  # an attribute as plain data: a Triton tuple's values and type, a constexpr's value and its class
        if isinstance(v, core.tuple):
            return [data(x) for x in v.values], str(v.type)
        return ("constexpr", v.value, type(v.value).__name__) if isinstance(v, core.constexpr) else v

    def made(cls, init, *args):
        obj = cls.__new__(cls)
        try:
            init(obj, *args)
        except Exception as exc:  # noqa: BLE001 - the same error type is the same answer
            return type(exc).__name__
        return [(k, data(v)) for k, v in vars(obj).items()]

    elements = [core.float32, core.int1, core.bfloat16, core.pointer_type(core.float16),
                core.pointer_type(core.int8, const=True)]
    shapes = [[4], [1, 8], [2, 4, 16], [8, 1], [core.constexpr(4)], [3], [], [True, 2], (2, 4)]
    diffs, cases = [], 0
    for el in elements:
        for shape in shapes + [core.tuple(list(s)) for s in shapes if s]:
            want = made(core.block_type, block_init.original, el, shape)
            for _ in range(2):
                cases += 1
                if made(core.block_type, block_init, el, shape) != want:
                    diffs.append(f"block_type({el}, {shape})")
            for ty in ([core.block_type(el, shape)] if not isinstance(want, str) else []) + [el]:
                want_t = made(core.tensor, tensor_init.original, "h", ty)
                for _ in range(2):
                    cases += 1
                    if made(core.tensor, tensor_init, "h", ty) != want_t:
                        diffs.append(f"tensor({ty})")
    for t in (core.tuple([4, 8]), core.tuple([core.constexpr(4), 8])):
        for other in ([4, 8], [4, 9], [4], [core.constexpr(4), 8], (4, 8), core.tuple([4, 8]), [True, 8]):
            cases += 1
            got, want = tuple_eq(t, other), tuple_eq.original(t, other)
            if type(got) is not type(want) or bool(got) != bool(want):
                diffs.append(f"{t} == {other}")
    for a in elements:
        for b in elements + [core.constexpr(core.float32), 3, core.float16]:
            cases += 1
            if dtype_eq(a, b) != dtype_eq.original(a, b):
                diffs.append(f"{a} == {b}")
    return diffs + [f"{cases} cases"]


def test_interpreted_kernel_keeps_its_bits_and_patches_once_per_launch():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["marked"] and res["again"], res
    assert not res["debug"] and not res["sanitize"] and res["default_sanitize"], res
    assert res["same_x"] and res["same_h"] and res["same_again"] and res["wrapped"], res
    # one scope a launch, and the first launch one more: its first call of Triton's own helpers (their module sees
    # `triton.language.core`, which the launch does not patch; never restored, so later calls find it patched);
    # Triton's own: one more per helper call (4 programs x 5 steps x 4 helpers)
    assert res["scopes"] == [2, 1 + 4 * 5 * 4, 1], res
    assert res["restored"] == [True] * 3, res
    assert res["np_dtype_cases"] > 30 and res["np_dtype_same"], res
    assert len(res["types"]) == 1 and int(res["types"][0].split()[0]) > 500, res["types"]  # no difference


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print(json.dumps(_child()))
