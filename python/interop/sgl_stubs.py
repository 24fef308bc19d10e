"""Import stubs that let sglang 0.5.23's Mooncake PD connector import on a
CPU-only machine without torch, triton or any GPU library.

What is stubbed, and why
------------------------
Only heavy third-party packages that sglang's import chain touches at module
level; never sglang itself and never anything the connector's data path uses
(it moves plain ``int`` pointers and numpy ``int32`` index arrays for host
buffers). Each entry below is needed: without it ``import
sglang.srt.disaggregation.mooncake`` raises ``ModuleNotFoundError``.

==================== =========================================================
``torch``            imported at the top of ``srt.utils.common``, ``conn.py``,
                     ``srt.platforms``, ...; only version checks, ``finfo``,
                     ``ReduceOp`` constants and decorators run at import time
``triton``           ``srt.utils.common``; ``@triton.jit`` kernel definitions
``torchvision``      ``multimodal.internvl_utils`` (through ``srt.configs``)
``tvm_ffi``          ``kernels.ops.communication.all_reduce``
``compressed_tensors`` ``layers.quantization.compressed_tensors``
``IPython``          ``sglang.utils``
``sgl_kernel``       sglang's CUDA kernel package: imported at module level
                     (``compressed_tensors_w8a8_int8``) only when torch is real
                     and reports CUDA, i.e. on the GPU machine
==================== =========================================================

Values the stubs must carry (everything else is a permissive placeholder):

* ``torch.__version__`` is parsed with ``packaging``;
* ``torch.version.hip/cuda/musa`` are ``None`` so ``is_hip()``/``is_cuda()``
  are False;
* ``torch.Tensor`` is a real class: ``MooncakeKVManager.transfer_worker``
  runs ``isinstance(indices, torch.Tensor)`` and a placeholder there kills
  every transfer thread;
* ``torch.npu`` must not exist (``is_npu()`` tests ``hasattr``), while
  ``torch.xpu``/``torch.mps`` must (called without ``hasattr``); the
  placeholder is falsy, so they read as unavailable.

A package that is really installed is not stubbed (:func:`install`): on the
GPU machine real torch is used (``README.md``, "Device buffers").

Call :func:`install` before the first ``sglang`` import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

#: Top-level packages answered by stubs.
STUBBED = frozenset({"torch", "triton", "torchvision", "tvm_ffi", "compressed_tensors", "IPython", "sgl_kernel"})

#: Real values some stub modules must carry at import time.
ATTRS = {
    "torch": {
        "__version__": "2.14.1+cpu",
        "version": types.SimpleNamespace(hip=None, cuda=None, musa=None, git_version="stub"),
        "Tensor": type("Tensor", (), {}),
    },
}

#: Attributes that must NOT exist (sglang probes them with ``hasattr``).
MISSING = {"torch": frozenset({"npu"})}


class _Any:
    """A universal placeholder: attributes, calls and indexing give another
    placeholder; it is falsy, ``int()`` 0, usable as a base class, and as a
    decorator (``@stub`` or ``@stub(...)``) returns the function unchanged."""

    def __init__(self, name: str = "stub"):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Any(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Any):
            return args[0]
        return _Any(f"{self._name}()")

    def __mro_entries__(self, bases):
        return (_base_for(self._name),)

    def __getitem__(self, item):
        return _Any(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __int__(self):
        return 0

    def __float__(self):
        return 0.0

    def __repr__(self):
        return f"<stub {self._name}>"

    def __hash__(self):
        return hash(self._name)

    def __eq__(self, other):
        return isinstance(other, _Any) and other._name == self._name

    def _same(self, *_):
        return self

    __or__ = __ror__ = __add__ = __radd__ = __sub__ = __rsub__ = _same
    __mul__ = __rmul__ = __truediv__ = __neg__ = __pos__ = _same


_BASES: dict[str, type] = {}


def _base_for(name: str) -> type:
    """A real, permissive class standing for a stubbed base class
    (``class Foo(torch.nn.Module)``); one per stub name."""
    if name not in _BASES:
        _BASES[name] = type(
            name.rsplit(".", 1)[-1],
            (),
            {
                "__init__": lambda self, *a, **k: None,
                "__init_subclass__": classmethod(lambda cls, **k: None),
            },
        )
    return _BASES[name]


class _StubModule(types.ModuleType):
    """A stub package: unknown attributes are placeholders."""

    def __getattr__(self, item):
        if (item.startswith("__") and item.endswith("__")) or item in MISSING.get(self.__name__, ()):
            raise AttributeError(item)
        return _Any(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the given packages (and their submodules)."""

    def __init__(self, packages: frozenset):
        self.packages = packages

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        module.__version__ = "0.0.0"
        for key, value in ATTRS.get(module.__name__, {}).items():
            setattr(module, key, value)


def _importable(name: str) -> bool:
    """Whether a finder other than the stubs' can load top-level ``name``."""
    return any(
        not isinstance(f, _Finder) and hasattr(f, "find_spec") and f.find_spec(name, None) is not None
        for f in sys.meta_path
    )


def install(only_missing: bool = True) -> frozenset:
    """Puts the stub finder first on ``sys.meta_path`` (idempotent) and
    returns the packages it stubs.

    With ``only_missing`` (the default) a package that is really installed is
    left alone: on a GPU machine with torch the real torch is used, and the
    stubs cover only what is absent.
    """
    for finder in [f for f in sys.meta_path if isinstance(f, _Finder)]:
        sys.meta_path.remove(finder)
    # KVB_INTEROP_EXTRA_STUBS (comma-separated): for finding what a new
    # machine's import chain misses; anything it needs belongs in STUBBED.
    wanted = STUBBED | {p for p in os.environ.get("KVB_INTEROP_EXTRA_STUBS", "").split(",") if p}
    stubbed = frozenset(p for p in wanted if not (only_missing and _importable(p)))
    sys.meta_path.insert(0, _Finder(stubbed))
    return stubbed
