"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) without its repeated
patching of ``triton.language``.

The interpreter runs a kernel as Python, with the builtins of the
``triton.language`` modules the kernel's globals hold replaced by NumPy ones
for the launch. Every call of a ``@triton.jit`` function from inside a kernel
(our helpers, ``tl.max``, ``tl.sum``…) patches the modules of *its* globals
again (``inspect.getmembers`` over four modules), patches already in place:
thousands of calls in a layer's training step, over a quarter of its time (C
= 32, two heads, 60 tokens: 4.2 s with them, 3.0 s without).

:func:`install` keeps the interpreter's own patching and skips a call's
when the same modules were already patched in the running launch: the modules
are patched as before, once per launch instead of once per call, so the
kernels compute the same. Measured in docs/tests.md. It changes nothing when
kernels are compiled for a GPU (the interpreter is not used then).
"""
import inspect
from typing import Callable, Dict, FrozenSet

_STATE: Dict[str, object] = {}


def _modules(fn: Callable, languages: tuple) -> FrozenSet[int]:
    """The ``triton.language`` modules the interpreter patches for ``fn``:
    those of ``languages`` among its globals (by id)."""
    return frozenset(id(v) for v in fn.__globals__.values()
                     if inspect.ismodule(v) and any(v is lang for lang in languages))


def install() -> bool:
    """Make the interpreter patch each set of modules once per launch; True if
    installed (now or before), False where this triton's interpreter has not
    the parts this relies on (then it runs as it is)."""
    if 'original' in _STATE:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        _STATE['original'], scope_type = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return False
    languages = (tl, tl.core)
    done: set = set()  # module sets patched in the running launch
    running = False

    def patch_once(fn: Callable):
        nonlocal running
        modules = _modules(fn, languages)
        if running and modules in done:
            return scope_type()  # nothing to change, nothing to restore
        scope = _STATE['original'](fn)
        done.add(modules)
        if running:  # a call inside the kernel: the interpreter keeps no scope
            return scope
        running = True  # a launch: its scope is restored when it ends
        restore = scope.restore

        def end_of_launch() -> None:
            nonlocal running
            running = False
            done.clear()
            restore()
        scope.restore = end_of_launch
        return scope
    interpreter._patch_lang = patch_once
    return True
