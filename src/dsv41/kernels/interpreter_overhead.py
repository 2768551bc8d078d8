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

    def langs_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

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
    return True
