"""The Triton CPU interpreter without its repeated set-up, for the test subprocesses that run kernels under
``TRITON_INTERPRET=1`` (loaded as a pytest plugin, ``-p tests.kernels._triton_interpreter``, or imported).

The interpreter swaps ``triton.language``'s builtins for interpreted ones at every launch, and again at every
call of a ``@triton.jit`` helper inside the kernel: each time it walks the language modules with
``inspect.getmembers`` (~10 ms), which is about 40% of the time of the model-decode cases. Within one launch,
a helper whose language modules the launch has already patched gets the very same patch again; this module
skips that repeat (and only that). The kernels run the same interpreted operations, on the same values.
"""

from __future__ import annotations

import inspect
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "only for processes that run Triton's interpreter"

import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

_patch_lang, _launch_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
_launches: list[set[int]] = []  # per launch in progress: the language modules patched for it
_langs: dict[object, frozenset[int]] = {}  # per function: the language modules in its globals


def _patch_lang_once_per_launch(fn):
    langs = _langs.get(fn)
    if langs is None:
        langs = _langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
    if _launches and langs <= _launches[-1]:
        return interpreter._LangPatchScope()  # already in place for this launch: nothing to undo
    if _launches:
        _launches[-1].update(langs)
    return _patch_lang(fn)


def _launch(self, *args, **kwargs):
    _launches.append(set())
    try:
        return _launch_call(self, *args, **kwargs)
    finally:
        _launches.pop()


interpreter._patch_lang = _patch_lang_once_per_launch
interpreter.GridExecutor.__call__ = _launch
