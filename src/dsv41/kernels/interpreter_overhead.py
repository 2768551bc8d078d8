"""Triton's CPU interpreter without two of its overheads that compute nothing a kernel sees (installed by
`dsv41.kernels` when TRITON_INTERPRET is set, beside interpreter_dot.py).

Why: the interpreted tests (CI: 2 cores) spent over half their time here, measured with cProfile on
tests/test_runtime_pool_attention.py's child (Triton 3.7):
- every call of a `@triton.jit` helper from inside a kernel re-runs `_patch_lang` (an `inspect.getmembers` walk of
  `triton.language`, its tensor class and `tl.math`, ~2 ms) although the kernel's launch already patched the same
  modules for the whole grid: 30 % of the child's time. The helper's patching is a no-op there (a patched builtin
  is no longer a builtin, so nothing is re-wrapped; the tensor / core attributes are set to equal functions) and the
  launch's restore undoes it anyway; a helper whose module sees a `triton.language` module the launch did not patch
  still patches as before, once: Triton's own helpers (`tl.sum`, `tl.max`, `tl.zeros`, ... of
  `triton.language.standard`, which sees `triton.language.core`, not the `triton.language` our kernels see) patched
  `core` again at each of their ~8,000 calls a child (25 % of test_engine_overlap's interpreted child, 45 -> 23 s),
  while the first call's patching of it is never undone (Triton restores no helper's scope; a launch restores what
  it patched itself, to what it found).
- `sanitize_overflow` (on by default in the interpreter's options) recomputes every int32 add / sub / mul in int64
  and builds the range check, then hands it to `device_assert`, which returns at once unless `debug` is on (never,
  in the interpreter's options): 26 % of the time, for a result thrown away. Turned off only while `debug` is off.
- `_get_np_dtype` (2.3 million calls in that child) builds its table of 19 numpy dtypes at every call: 6 %. Here
  each scalar type's answer is Triton's own, asked once and kept (a block of it answers as its element, as there).
- building its type objects (a `block_type`, a `tensor`: each shape wrapped in a Triton tuple whose type wraps every
  dimension again) and comparing shapes / dtypes through throwaway tuples: the largest part left after the above
  (`_lean_types`: the pool-attention child 173 -> 118 s, alone on the 2-core machine).
Bits are untouched: what a kernel computes goes through the same semantic code either way
(tests/test_kernels_interpreter_overhead.py). Nothing changes on a GPU: the compiled kernels never see this.
"""

from __future__ import annotations

import dataclasses
import threading

_MARK = "_dsv41_lean"


def install() -> bool:
    """Patch the interpreter once (idempotent); False where this Triton's interpreter has not the expected parts."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:  # pragma: no cover - Triton absent: nothing to patch
        return False
    original = getattr(it, "_patch_lang", None)
    builder = getattr(it, "interpreter_builder", None)
    if original is None or not hasattr(it, "InterpretedFunction") or builder is None:
        return False
    if getattr(original, _MARK, False):
        return True
    options = getattr(builder, "options", None)
    if options is not None and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)

    # the language modules the running launch's scope patched, per thread (empty between launches); a launch runs
    # its grid to the end before its thread launches again (kernels launch no kernels)
    state = threading.local()
    # the language modules a helper's own patching reached (a module its launch had not patched): Triton never
    # restores a helper's scope, and a later launch restores only what it patched itself (to what it found), so
    # their functions stay patched; their re-patching at each later helper call is the same no-op
    lasting: set[int] = set()

    seen: dict = {}  # a function's language modules, asked once (its module's `tl` / `core` are never rebound)

    def langs_of(fn) -> set[int]:
        found = seen.get(fn)
        if found is None:
            found = seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return found

    def patch_lang(fn):
        patched = getattr(state, "langs", None)
        langs = langs_of(fn)
        if patched and langs <= patched | lasting:
            return None  # a helper called inside a launch: its modules are patched until the launch restores them
        scope = original(fn)
        if patched:
            lasting.update(langs - patched)
            return scope  # a helper that sees other modules: patched as Triton does (never restored, as there)
        state.langs = langs
        restore = scope.restore

        def restore_and_forget():
            state.langs = None
            restore()

        scope.restore = restore_and_forget
        return scope

    np_dtype, known = getattr(it, "_get_np_dtype", None), {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type) and not isinstance(tt_dtype.element_ty, tl.pointer_type):
            tt_dtype = tt_dtype.element_ty  # Triton's answer for a block: its element's
        if isinstance(tt_dtype, tl.pointer_type) or isinstance(tt_dtype, tl.block_type):
            return np_dtype(tt_dtype)
        found = known.get(tt_dtype)
        if found is None:
            found = known[tt_dtype] = np_dtype(tt_dtype)
        return found

    if np_dtype is not None:
        get_np_dtype.original = np_dtype
        it._get_np_dtype = get_np_dtype
    setattr(patch_lang, _MARK, True)
    patch_lang.original = original  # the test compares against it
    it._patch_lang = patch_lang
    _lean_types(tl.core)
    return True


def _lean_types(core) -> None:
    """Triton's type objects as its constructors make them, from what they made for an equal shape before, and two
    comparisons answered without their throwaway tuples (the same answers). Why: after the patches above, building
    `block_type` and `tensor` objects (each shape wrapped in a Triton tuple whose type wraps every dimension again)
    was the largest part left: tests/test_runtime_pool_attention.py's child 173 -> 118 s with these, the same bits.
    Each replacement takes its fast path only for the plain cases (shapes of Python ints, the exact classes) and
    hands every other call to Triton's own; the originals stay reachable as `.original` (the test compares)."""
    import builtins

    block_type, tensor, ttuple, constexpr, dtype = core.block_type, core.tensor, core.tuple, core.constexpr, core.dtype
    block_init, tensor_init, tuple_eq, dtype_eq = block_type.__init__, tensor.__init__, ttuple.__eq__, dtype.__eq__
    blocks: dict = {}  # (element type's name, shape) -> (the shape tuple's type, numel, name): all they depend on
    shapes: dict = {}  # a tensor type's shape -> (numel, its dimensions as constexprs, their tuple's type)

    def plain(values) -> bool:  # a loop, not all(...): shapes are 1-3 long, a generator costs more than the test
        for v in values:
            if builtins.type(v) is not int:
                return False
        return True

    def shape_tuple(values, type_):  # Triton's tuple(values, type) without its copy loop and type check
        out = object.__new__(ttuple)
        out.values, out.type = values, type_
        return out

    def block_type_init(self, element_ty, shape):
        # Triton's: element_ty; shape = tuple(unwrapped ints) (asserted list or Triton tuple); numel; name
        values = shape.values if builtins.type(shape) is ttuple else shape
        if builtins.type(values) is not list or not plain(values):
            return block_init(self, element_ty, shape)
        key = (str(element_ty), builtins.tuple(values))
        found = blocks.get(key)
        if found is None:
            block_init(self, element_ty, shape)
            blocks[key] = (self.shape.type, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape = shape_tuple(list(values), found[0])
        self.numel, self.name = found[1], found[2]

    def tensor_type_init(self, handle, type):  # noqa: A002 - Triton's parameter name
        # Triton's: handle; shape = tuple of constexpr dimensions (() for a scalar); numel; type; dtype (its scalar)
        if builtins.type(type) is block_type:
            values = type.shape.values if builtins.type(type.shape) is ttuple else None
            key = builtins.tuple(values) if values is not None and plain(values) else None
        else:
            key = None if type.is_block() else ()
        found = shapes.get(key) if key is not None else None
        if found is None:
            tensor_init(self, handle, type)
            if key is not None:
                shapes[key] = (self.numel, list(self.shape.values), self.shape.type)
            return
        self.handle = handle
        self.shape = shape_tuple(list(found[1]), found[2])
        self.numel = found[0]
        self.type = type
        self.dtype = type.scalar

    def tuple_equal(self, other):
        # Triton's: constexpr(self.values == other's values unwrapped), where a list of ints unwraps to itself
        if builtins.type(other) is list and plain(other):
            return constexpr(self.values == other)
        return tuple_eq(self, other)

    def dtype_equal(self, other):
        return True if other is self else dtype_eq(self, other)  # Triton's: self.name == other.name

    for cls, name, fn, orig in ((block_type, "__init__", block_type_init, block_init),
                                (tensor, "__init__", tensor_type_init, tensor_init),
                                (ttuple, "__eq__", tuple_equal, tuple_eq), (dtype, "__eq__", dtype_equal, dtype_eq)):
        fn.original = orig
        setattr(cls, name, fn)  # (set after the class was made: its __hash__ stays)

