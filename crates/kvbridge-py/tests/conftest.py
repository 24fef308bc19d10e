"""Shared fixtures: kvbridge engines on 127.0.0.1 and numpy buffers."""

import os
import socket

import numpy as np
import pytest

import kvbridge

HOST = "127.0.0.1"


def start_engine(protocol="tcp"):
    """A TransferEngine initialized as sglang does it."""
    engine = kvbridge.TransferEngine()
    assert engine.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    return engine


def session_of(engine):
    """The session id sglang derives: f"{hostname}:{get_rpc_port()}"."""
    return f"{HOST}:{engine.get_rpc_port()}"


def addr(array):
    """The address of a numpy buffer, as sglang passes it (an int)."""
    return array.ctypes.data


def dead_port():
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Each test starts without the variables initialize() reads."""
    for name in (
        "KVBRIDGE_SECRET",
        "KVBRIDGE_SECRET_FILE",
        "KVBRIDGE_ENGINE_PORT",
        "KVBRIDGE_ENGINE_CONFIG",
        "MC_FORCE_TCP",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pair():
    """A prefill-like engine and a decode-like engine, over TCP."""
    return start_engine(), start_engine()


@pytest.fixture
def buffers():
    """A source buffer filled with a pattern and a zeroed destination."""
    src = (np.arange(1 << 16, dtype=np.uint32) * 2654435761).view(np.uint8)[: 1 << 16].copy()
    dst = np.zeros(1 << 16, dtype=np.uint8)
    return src, dst


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
