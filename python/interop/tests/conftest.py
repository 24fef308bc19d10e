"""Puts python/interop on sys.path (the suite imports the harness modules by
name, as the worker processes do) and names the engine columns."""

import importlib.util
import os
import sys

import pytest

INTEROP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if INTEROP not in sys.path:
    sys.path.insert(0, INTEROP)

import cluster  # noqa: E402


def _missing(module: str, attr: str = "TransferEngine"):
    """Why ``module.attr`` cannot be used, or None when it can."""
    try:
        if importlib.util.find_spec(module) is None:
            return f"`import {module}` fails"
    except (ImportError, ValueError) as e:
        return f"`import {module}` fails: {e}"
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # an extension module that does not load
        return f"`import {module}` fails: {type(e).__name__}: {e}"
    return None if hasattr(mod, attr) else f"{module} has no {attr}"


#: Where the ranks' KV lives: "cpu" (numpy, the default) or "cuda[:N]"
#: (torch device tensors; ``KVB_INTEROP_BUFFERS``, the GPU machine's step).
BUFFERS = os.environ.get("KVB_INTEROP_BUFFERS", "cpu")
ON_DEVICE = BUFFERS != "cpu"
HOST_ONLY = f"reads KV with the CPU: cannot move the device tensors of KVB_INTEROP_BUFFERS={BUFFERS}"

#: Engine column -> (module given to the engine hook or None for Mooncake's own, skip reason or None).
ENGINES = {
    "mooncake": (None, (ON_DEVICE and f"Mooncake's non-CUDA engine {HOST_ONLY}") or (_missing("mooncake.engine")
                 and "Mooncake's engine is not installed (pip install mooncake-transfer-engine-non-cuda)")),
    "kvbridge": ("kvbridge", _missing("kvbridge")
                 and f"kvbridge.TransferEngine unavailable ({_missing('kvbridge')}): "
                     "build and install crates/kvbridge-py (maturin develop)"),
    "kvtcp": ("kvtcp_engine", ON_DEVICE and f"the pure-Python stand-in {HOST_ONLY}" or None),
}


#: Whether the pure-Python stand-in column runs by default: only while the
#: real kvbridge package is unavailable (``KVB_INTEROP_FULL=1`` runs it always).
STANDIN = ENGINES["kvbridge"][1] is not None


def engine_param(name, *more):
    """A pytest parameter for engine column ``name`` (skipped with its
    reason when unavailable); ``more`` are further values of the same case."""
    module, skip = ENGINES[name]
    marks = [pytest.mark.skip(reason=skip)] if skip else []
    return pytest.param(module, *more, id="-".join([name, *map(str, more)]), marks=marks)


def kvbridge_bin_missing():
    """Why the kvbridge binary cannot be run, or None."""
    path = cluster.kvbridge_bin()
    if not os.access(path, os.X_OK):
        return f"no kvbridge binary at {path} (cargo build -p kvbridge-cli, or set KVBRIDGE_BIN)"
    return None
