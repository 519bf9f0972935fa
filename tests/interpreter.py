"""One speed fix for the Triton interpreter (CPU test runs): patch ``triton.language`` once per
kernel launch instead of once per helper call.

A launch patches the language modules the kernel sees (``tl.program_id`` and every builtin
become interpreter functions) for the whole grid and restores them after. Triton 3.6 also
repatches on every call of a ``@triton.jit`` helper inside the kernel, for every program: an
``inspect.getmembers`` scan of ``tl``, ``tl.tensor`` and ``tl.math`` whose result is the state
already in place. That was a third of the CPU time of the kernel tests. Here a helper call
patches only the modules the launch has not patched yet (the standard library's helpers see
``triton.language.core`` where kernels see ``triton.language``), as the unmodified call would.
The launch's own patch and restore are unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable


class _Unchanged:
    def restore(self) -> None:
        pass


def patch_language_once_per_launch() -> bool:
    """Installs the fix; False (nothing changed) on a Triton other than the 3.6 it was made for."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith("3.6.") or not hasattr(interpreter, "_patch_lang"):
        return False
    original: Callable = interpreter._patch_lang
    patched: set[int] | None = None  # the modules patched by the running launch

    def languages(fn: Callable) -> set[int]:
        # what the original patches: tl and/or tl.core, as fn's module names them now (not
        # cached: the interpreter adds its own globals, tl among them, to a module it rewrites)
        return {
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        }

    def patch_lang(fn: Callable):
        nonlocal patched
        modules = languages(fn)
        if patched is None:  # a kernel launch: helpers run only inside one
            scope = original(fn)
            patched = modules
            restore = scope.restore

            def restore_and_end_launch() -> None:
                nonlocal patched
                patched = None
                restore()

            scope.restore = restore_and_end_launch
            return scope
        if modules <= patched:
            return _Unchanged()
        patched |= modules
        return original(fn)  # a helper's call drops this scope, as before

    interpreter._patch_lang = patch_lang
    return True
