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

**Backend mode** (``KVBRIDGE_SGLANG=backend``, or :func:`install_backend`):
the engine hook as above, and sglang's Mooncake backend classes become
kvbridge's (``kvbridge.sglang_backend``: ``KVManager``, ``KVSender``,
``KVReceiver``, ``KVBootstrapServer``, over kvbridge's Rust roles). sglang
picks its backend classes in one place, ``get_kv_class`` in
``sglang/srt/disaggregation/utils.py``, which imports them from the package
``sglang.srt.disaggregation.mooncake`` at each call; the hook rebinds the
package's four names once it is imported (a module already imported is
rebound at once), so ``--disaggregation-transfer-backend mooncake`` selects
kvbridge's backend. sglang's argument parser takes another backend name, but
its ``TransferBackend`` enum and its ``== TransferBackend.MOONCAKE`` checks
do not, so the name stays ``mooncake``. ``sglang.srt.disaggregation.mooncake.conn``
keeps sglang's own classes.

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

#: Environment variable that switches the hook on (``1``, ``true``, ``yes``,
#: ``on``: the engine; ``backend``: the engine and the backend classes).
ENV_ENABLE = "KVBRIDGE_SGLANG"
#: The value of ``KVBRIDGE_SGLANG`` that selects kvbridge's whole backend.
BACKEND = "backend"
#: The package sglang's ``get_kv_class`` imports the Mooncake classes from.
BACKEND_PACKAGE = "sglang.srt.disaggregation.mooncake"
#: sglang's class names -> kvbridge.sglang_backend's.
BACKEND_CLASSES = {
    "MooncakeKVManager": "KVManager",
    "MooncakeKVSender": "KVSender",
    "MooncakeKVReceiver": "KVReceiver",
    "MooncakeKVBootstrapServer": "KVBootstrapServer",
}
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
    """Whether ``KVBRIDGE_SGLANG`` asks for the hook (engine or backend)."""
    value = environ.get(ENV_ENABLE, "").strip().lower()
    return value in _TRUE or value == BACKEND


def backend_by_env(environ=os.environ) -> bool:
    """Whether ``KVBRIDGE_SGLANG=backend`` asks for kvbridge's whole backend."""
    return environ.get(ENV_ENABLE, "").strip().lower() == BACKEND


def _rebind_backend(package) -> None:
    """Points the package's Mooncake class names at kvbridge's classes."""
    backend = importlib.import_module("kvbridge.sglang_backend")
    for theirs, ours in BACKEND_CLASSES.items():
        setattr(package, theirs, getattr(backend, ours))
    package.__kvbridge_backend__ = True


class _BackendLoader(importlib.abc.Loader):
    """Runs the real package's loader, then rebinds its class names."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _rebind_backend(module)


class _BackendFinder(importlib.abc.MetaPathFinder):
    """Finds ``sglang.srt.disaggregation.mooncake`` as the other finders
    do, with a loader that rebinds its classes once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != BACKEND_PACKAGE:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _BackendFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _BackendLoader(spec.loader)
                return spec
        return None


def backend_installed() -> bool:
    """Whether kvbridge's backend classes are (or will be) sglang's."""
    return any(isinstance(f, _BackendFinder) for f in sys.meta_path)


def install_backend(target: Optional[str] = None) -> str:
    """Backend mode in this process: the engine hook (:func:`install`) and
    sglang's Mooncake backend classes rebound to kvbridge's. Idempotent;
    returns the engine target."""
    target = install(target)
    if not backend_installed():
        sys.meta_path.insert(0, _BackendFinder())
    package = sys.modules.get(BACKEND_PACKAGE)
    if package is not None:
        _rebind_backend(package)
    return target


def uninstall_backend() -> None:
    """Leaves backend mode: the finder goes and sglang's own classes are
    bound again (the engine hook stays; :func:`uninstall` removes it)."""
    for finder in [f for f in sys.meta_path if isinstance(f, _BackendFinder)]:
        sys.meta_path.remove(finder)
    package = sys.modules.get(BACKEND_PACKAGE)
    if package is not None and getattr(package, "__kvbridge_backend__", False):
        conn = importlib.import_module(BACKEND_PACKAGE + ".conn")
        for theirs in BACKEND_CLASSES:
            setattr(package, theirs, getattr(conn, theirs))
        package.__kvbridge_backend__ = False


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
    """Removes the hook (a ``mooncake.engine`` it provided is forgotten) and
    backend mode (:func:`uninstall_backend`)."""
    uninstall_backend()
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
    """Installs the hook when ``KVBRIDGE_SGLANG`` asks for it (with the
    backend classes for ``backend``); returns the engine target, or None
    when the hook stays off."""
    if backend_by_env():
        return install_backend()
    return install() if enabled_by_env() else None


def plugin() -> None:
    """sglang general-plugin entry point (``sglang.srt.plugins`` group):
    installs the hook in every sglang process when ``KVBRIDGE_SGLANG=1``
    (``backend``: the backend classes too)."""
    install_from_env()


def main(argv: Optional[Sequence[str]] = None, *, module: str = LAUNCH_MODULE) -> None:
    """``python -m kvbridge.sglang [sglang.launch_server arguments]``.

    Sets ``KVBRIDGE_SGLANG=1`` unless it already asks for ``backend``
    (inherited by the processes sglang spawns), installs the hook (and the
    backend classes), rewrites ``sys.argv`` and runs ``module`` (default
    ``sglang.launch_server``) as ``__main__``. ``module`` is a parameter for
    tests only. Processes sglang spawns inherit ``KVBRIDGE_SGLANG=1`` and
    re-import the main module, which installs the hook again at import.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not backend_by_env():
        os.environ[ENV_ENABLE] = "1"
    install_from_env()
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
