"""Run sglang's Mooncake PD connector on kvbridge's transfer engine, without
patching sglang.

sglang creates its transfer engine in exactly one place
(``MooncakeTransferEngine.__init__`` in
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``),
with a lazy ``from mooncake.engine import TransferEngine``. This module makes
that import resolve to ``kvbridge.TransferEngine`` (which has Mooncake's
API), so every byte sglang moves goes through kvbridge's engine while sglang's
connector, bootstrap server and zmq control plane stay as released.

Three ways to switch it on, in every sglang process that creates an engine
(the scheduler processes, which sglang starts with the ``spawn`` method, so
they inherit environment variables but not ``sys.modules``):

1. **sglang plugin (recommended).** The kvbridge wheel declares
   ``[project.entry-points."sglang.srt.plugins"] kvbridge =
   "kvbridge.sglang:plugin"``. sglang calls every general plugin early in
   each process (``sglang.srt.plugins.load_plugins()``, e.g. first thing in
   ``run_scheduler_process``); :func:`plugin` installs the hook when
   ``KVBRIDGE_SGLANG=1`` and does nothing otherwise, so installing kvbridge
   never silently replaces Mooncake.
2. **Launcher.** ``python -m kvbridge.sglang <sglang.launch_server args>``
   (:func:`main`): sets ``KVBRIDGE_SGLANG=1``, installs the hook and runs
   ``sglang.launch_server`` as ``__main__``. Spawned children re-import this
   module as ``__mp_main__``; its import-time check of ``KVBRIDGE_SGLANG``
   installs the hook there too.
3. **By hand.** ``import kvbridge.sglang; kvbridge.sglang.install()`` before
   sglang creates its engine (tests, embedding).

``KVBRIDGE_SGLANG_TARGET`` (or ``install(target=...)``) names the module whose
``TransferEngine`` is used; the default is ``kvbridge``. Tests point it at a
stand-in engine.

The module uses the standard library only; importing it does not load
sglang. See ``docs/sglang.md``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from typing import Optional, Sequence

#: Environment variable that switches the hook on (``1``, ``true``, ``yes``, ``on``).
ENV_ENABLE = "KVBRIDGE_SGLANG"
#: Environment variable naming the module that provides ``TransferEngine``.
ENV_TARGET = "KVBRIDGE_SGLANG_TARGET"
#: The module providing ``TransferEngine`` unless told otherwise.
DEFAULT_TARGET = "kvbridge"
#: The module sglang imports the engine from.
ENGINE_MODULE = "mooncake.engine"
#: The server module the launcher runs.
LAUNCH_MODULE = "sglang.launch_server"

_TRUE = frozenset({"1", "true", "yes", "on"})


def enabled_by_env(environ=os.environ) -> bool:
    """Whether ``KVBRIDGE_SGLANG`` asks for the hook."""
    return environ.get(ENV_ENABLE, "").strip().lower() in _TRUE


class _EngineFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import mooncake.engine`` with a module whose
    ``TransferEngine`` is the target's, and ``import mooncake`` with an empty
    package when Mooncake is not installed (a real ``mooncake`` package is
    kept, so its other submodules still import)."""

    def __init__(self, target: str):
        self.target = target

    def find_spec(self, fullname, path, target=None):
        if fullname == ENGINE_MODULE:
            return importlib.machinery.ModuleSpec(fullname, self, origin=f"kvbridge hook -> {self.target}")
        if fullname == "mooncake" and not self._real_mooncake_exists():
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def _real_mooncake_exists(self) -> bool:
        """Whether another finder can load a ``mooncake`` package."""
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            if finder.find_spec("mooncake", None) is not None:
                return True
        return False

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        if module.__name__ == "mooncake":
            module.__path__ = []
            return
        engine = importlib.import_module(self.target).TransferEngine
        module.TransferEngine = engine
        module.__doc__ = f"mooncake.engine as seen by sglang: TransferEngine is {self.target}.TransferEngine"


def installed_target() -> Optional[str]:
    """The target module of the installed hook, or None when not installed."""
    for finder in sys.meta_path:
        if isinstance(finder, _EngineFinder):
            return finder.target
    return None


def install(target: Optional[str] = None) -> str:
    """Makes ``mooncake.engine.TransferEngine`` resolve to
    ``<target>.TransferEngine`` in this process; returns the target.

    ``target`` defaults to ``$KVBRIDGE_SGLANG_TARGET``, then ``kvbridge``.
    Idempotent; installing a different target replaces the previous one. The
    target is imported when ``mooncake.engine`` is first imported (an already
    imported ``mooncake.engine`` is replaced at once), so a missing target
    fails where sglang creates its engine, with the target's ImportError.
    """
    target = target or os.environ.get(ENV_TARGET) or DEFAULT_TARGET
    uninstall()
    sys.meta_path.insert(0, _EngineFinder(target))
    if ENGINE_MODULE in sys.modules:
        del sys.modules[ENGINE_MODULE]
        parent = sys.modules.get("mooncake")
        if parent is not None and hasattr(parent, "engine"):
            delattr(parent, "engine")
        importlib.import_module(ENGINE_MODULE)
    return target


def uninstall() -> None:
    """Removes the hook (a ``mooncake.engine`` it provided is forgotten)."""
    hooked = [f for f in sys.meta_path if isinstance(f, _EngineFinder)]
    if not hooked:
        return
    for finder in hooked:
        sys.meta_path.remove(finder)
    for name in (ENGINE_MODULE, "mooncake"):
        module = sys.modules.get(name)
        if module is not None and isinstance(getattr(module, "__loader__", None), _EngineFinder):
            del sys.modules[name]
    parent = sys.modules.get("mooncake")
    if parent is not None and hasattr(parent, "engine") and ENGINE_MODULE not in sys.modules:
        delattr(parent, "engine")


def install_from_env() -> Optional[str]:
    """Installs the hook when ``KVBRIDGE_SGLANG`` asks for it; returns the
    target, or None when the hook stays off."""
    return install() if enabled_by_env() else None


def plugin() -> None:
    """sglang general-plugin entry point (``sglang.srt.plugins`` group):
    installs the hook in every sglang process when ``KVBRIDGE_SGLANG=1``."""
    install_from_env()


def main(argv: Optional[Sequence[str]] = None, *, module: str = LAUNCH_MODULE) -> None:
    """``python -m kvbridge.sglang [sglang.launch_server arguments]``.

    Sets ``KVBRIDGE_SGLANG=1`` (inherited by the processes sglang spawns),
    installs the hook, rewrites ``sys.argv`` and runs ``module`` (default
    ``sglang.launch_server``) as ``__main__``. ``module`` is a parameter for
    tests only. Processes sglang spawns inherit ``KVBRIDGE_SGLANG=1`` and
    re-import the main module, which installs the hook again at import.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    os.environ[ENV_ENABLE] = "1"
    install()
    sys.argv = [module] + args
    # alter_sys=False keeps this module as sys.modules["__main__"], so the
    # children sglang spawns re-import it (as __mp_main__) and get the hook.
    runpy.run_module(module, run_name="__main__", alter_sys=False)


# Spawned children (multiprocessing "spawn") import the parent's main module
# as __mp_main__ and inherit its environment: install the hook there too.
if __name__ != "__main__":
    install_from_env()

if __name__ == "__main__":
    main()
