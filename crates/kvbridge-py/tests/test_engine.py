"""kvbridge.TransferEngine: Mooncake's API as sglang's connector calls it."""

import os
import socket
import threading

import numpy as np
import pytest
from conftest import HOST, addr, dead_port, session_of, start_engine

import kvbridge


def register(engine, *arrays):
    assert engine.batch_register_memory([addr(a) for a in arrays], [a.nbytes for a in arrays]) == 0


def test_session_id_is_host_colon_rpc_port(pair):
    a, _ = pair
    port = a.get_rpc_port()
    assert type(port) is int and 0 < port < 65536
    assert a.get_session_id() == f"{HOST}:{port}" == session_of(a)
    assert a.transport == "tcp"
    assert "tcp" in repr(a)


def test_batch_write_moves_bytes_between_numpy_buffers(pair, buffers):
    a, b = pair
    src, dst = buffers
    register(a, src)
    register(b, dst)
    srcs = [addr(src) + 0, addr(src) + 1000, addr(src) + 40000]
    dsts = [addr(dst) + 5000, addr(dst) + 0, addr(dst) + 60000]
    lens = [3000, 17, 5536]
    rc = a.batch_transfer_sync_write(session_of(b), srcs, dsts, lens)
    assert type(rc) is int and rc == 0
    want = np.zeros_like(dst)
    want[5000:8000] = src[0:3000]
    want[0:17] = src[1000:1017]
    want[60000:65536] = src[40000:45536]
    np.testing.assert_array_equal(dst, want)


def test_single_write_and_pointer_objects(pair, buffers):
    a, b = pair
    src, dst = buffers

    class Tensor:  # what torch tensors offer
        def __init__(self, array):
            self.array = array

        def data_ptr(self):
            return addr(self.array)

    assert a.register_memory(Tensor(src), src.nbytes) == 0
    assert b.register_memory(dst, dst.nbytes) == 0  # __array_interface__
    assert a.transfer_sync_write(session_of(b), Tensor(src[64:]), addr(dst) + 8, 100) == 0
    np.testing.assert_array_equal(dst[8:108], src[64:164])
    # Addresses and lengths as uint64 / int64 numpy arrays (e.g. plan() columns).
    srcs = np.array([addr(src), addr(src) + 200], dtype=np.uint64)
    dsts = np.array([addr(dst) + 1000, addr(dst) + 2000], dtype=np.int64)
    assert a.batch_transfer_sync_write(session_of(b), srcs, dsts, np.array([10, 20])) == 0
    np.testing.assert_array_equal(dst[1000:1010], src[0:10])
    np.testing.assert_array_equal(dst[2000:2020], src[200:220])
    # numpy integers are values (e.g. list(array_of_pointers)); a 0-d array
    # is an array, whose address counts, not its value.
    assert a.transfer_sync_write(session_of(b), np.uint64(addr(src)), np.int64(addr(dst) + 3000), np.uint32(4)) == 0
    np.testing.assert_array_equal(dst[3000:3004], src[0:4])
    assert a.transfer_sync_write(session_of(b), np.array(addr(src) + 4), addr(dst), 4) < 0
    with pytest.raises(TypeError):
        a.transfer_sync_write(session_of(b), True, addr(dst), 4)
    assert a.unregister_memory(src) == 0
    assert b.batch_unregister_memory(np.array([addr(dst)], dtype=np.uint64)) == 0


def test_concurrent_writes_from_python_threads(pair, buffers):
    a, b = pair
    src, dst = buffers
    register(a, src)
    register(b, dst)
    session = session_of(b)
    threads, per_thread, block = 8, 16, 256
    start = threading.Barrier(threads)
    codes = [[] for _ in range(threads)]

    def worker(t):
        start.wait()
        for i in range(per_thread):
            off = (t * per_thread + i) * block
            # Each block its own 256-byte slot; two blocks per call.
            codes[t].append(
                a.batch_transfer_sync_write(
                    session,
                    [addr(src) + off, addr(src) + off + 128],
                    [addr(dst) + off, addr(dst) + off + 128],
                    [128, 128],
                )
            )

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert codes == [[0] * per_thread for _ in range(threads)]
    n = threads * per_thread * block
    np.testing.assert_array_equal(dst[:n], src[:n])
    assert not dst[n:].any()


@pytest.mark.parametrize("call", ["probe", "transfer"])
def test_gil_is_released_while_a_call_blocks(call, monkeypatch, tmp_path, buffers, caplog):
    # A peer that accepts and then says nothing: the call blocks in Rust
    # until this thread closes the connection, which it can only do while
    # the call has the GIL released. Were the GIL held, the call would end
    # by its handshake timeout instead, with another reason.
    cfg = tmp_path / "engine.json"
    cfg.write_text('{"connect_timeout_ms": 10000, "tcp": {"connections_per_peer": 1}}')
    monkeypatch.setenv("KVBRIDGE_ENGINE_CONFIG", str(cfg))
    a = start_engine()
    src, _ = buffers
    register(a, src)
    silent = socket.socket()
    silent.bind((HOST, 0))
    silent.listen(8)
    session = f"{HOST}:{silent.getsockname()[1]}"
    result = []

    def blocked():
        if call == "probe":
            result.append(a.send_probe(session))
        else:
            result.append(a.batch_transfer_sync_write(session, [addr(src)], [4096], [64]))

    with caplog.at_level("WARNING", logger="kvbridge"):
        t = threading.Thread(target=blocked)
        t.start()
        conn, _ = silent.accept()  # the engine is inside the call now
        conn.close()
        silent.close()
        t.join()
    assert result == [-1]
    reasons = [r.getMessage() for r in caplog.records if r.name == "kvbridge"]
    assert len(reasons) == 1 and "timeout" not in reasons[0], reasons


def test_failures_are_negative_codes(pair, buffers):
    a, b = pair
    src, dst = buffers
    register(a, src)
    register(b, dst[:4096])
    session = session_of(b)
    # Destination outside the peer's registered memory: refused, nothing written.
    assert a.batch_transfer_sync_write(session, [addr(src)], [addr(dst) + 4000], [200]) < 0
    assert a.batch_transfer_sync_write(session, [addr(src)], [addr(dst) + 8192], [1]) < 0
    assert not dst.any()
    # Source not registered locally.
    other = np.ones(64, dtype=np.uint8)
    assert a.transfer_sync_write(session, addr(other), addr(dst), 64) < 0
    # Unknown session: nobody listens, or no port at all.
    assert a.batch_transfer_sync_write(f"{HOST}:{dead_port()}", [addr(src)], [addr(dst)], [8]) < 0
    assert a.transfer_sync_write("not-a-session", addr(src), addr(dst), 8) < 0
    assert not dst.any()
    # After the peer unregisters, its memory is no destination any more.
    assert a.transfer_sync_write(session, addr(src), addr(dst), 8) == 0
    assert b.batch_unregister_memory([addr(dst)]) == 0
    assert a.transfer_sync_write(session, addr(src), addr(dst) + 8, 8) < 0
    # Unregistering what is not registered, or overlapping registrations.
    assert b.unregister_memory(addr(dst)) < 0
    assert a.register_memory(addr(src) + 8, 16) < 0


def test_send_probe(pair):
    a, b = pair
    assert a.send_probe(session_of(b)) == 0
    assert b.send_probe(session_of(a)) == 0
    assert a.send_probe(f"{HOST}:{dead_port()}") < 0


def test_misuse_raises():
    fresh = kvbridge.TransferEngine()
    for call in (
        lambda: fresh.get_rpc_port(),
        lambda: fresh.get_session_id(),
        lambda: fresh.transport,
        lambda: fresh.batch_register_memory([1], [1]),
        lambda: fresh.batch_unregister_memory([1]),
        lambda: fresh.batch_transfer_sync_write("h:1", [1], [1], [1]),
        lambda: fresh.send_probe("h:1"),
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    e = start_engine()
    with pytest.raises(RuntimeError, match="already initialized"):
        e.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    with pytest.raises(ValueError, match="buffers has 2 entries but lengths has 1"):
        e.batch_transfer_sync_write("h:1", [1, 2], [3, 4], [5])
    with pytest.raises(ValueError, match="has 1 entries but capacities has 2"):
        e.batch_register_memory([1], [1, 2])
    with pytest.raises(TypeError, match=r"buffers\[1\] must be an int address"):
        e.batch_transfer_sync_write("h:1", [1, "2"], [3, 4], [5, 6])
    with pytest.raises(TypeError, match="lengths must be a list"):
        e.batch_transfer_sync_write("h:1", [1], [3], 5)
    with pytest.raises(TypeError):
        e.register_memory(1.5, 10)
    with pytest.raises(ValueError, match="outside 0..2"):
        e.register_memory(-1, 10)
    with pytest.raises(ValueError, match="outside 0..2"):
        e.transfer_sync_write("h:1", 1, 2, 1 << 64)
    with pytest.raises(ValueError, match="negative"):
        e.batch_unregister_memory(np.array([-5], dtype=np.int64))


def test_initialize_failures_are_codes(monkeypatch):
    assert kvbridge.TransferEngine().initialize(HOST, "P2PHANDSHAKE", "efa", "") == -1
    assert kvbridge.TransferEngine().initialize(HOST, "etcd://h:2379", "tcp", "") == -1
    assert kvbridge.TransferEngine().initialize("", "P2PHANDSHAKE", "tcp", "") == -1
    busy = start_engine()
    monkeypatch.setenv("KVBRIDGE_ENGINE_PORT", str(busy.get_rpc_port()))
    late = kvbridge.TransferEngine()
    assert late.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == -1
    # A failed initialize leaves the engine uninitialized; it may try again.
    monkeypatch.delenv("KVBRIDGE_ENGINE_PORT")
    assert late.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0


def test_port_from_hostname_or_environment(monkeypatch):
    port = dead_port()
    e = kvbridge.TransferEngine()
    assert e.initialize(f"{HOST}:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.get_rpc_port() == port
    port = dead_port()
    monkeypatch.setenv("KVBRIDGE_ENGINE_PORT", str(port))
    assert start_engine().get_rpc_port() == port


def test_mc_force_tcp_picks_tcp(monkeypatch):
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert start_engine("rdma").transport == "tcp"


def test_cluster_secret_from_environment(monkeypatch, buffers):
    src, dst = buffers
    open_engine = start_engine()
    monkeypatch.setenv("KVBRIDGE_SECRET", "kvbridge-python-test-secret")
    a, b = start_engine(), start_engine()
    register(a, src)
    register(b, dst)
    register(open_engine, src)
    assert a.transfer_sync_write(session_of(b), addr(src), addr(dst), 4096) == 0
    np.testing.assert_array_equal(dst[:4096], src[:4096])
    # A peer without the secret fails the handshake, both ways.
    assert open_engine.transfer_sync_write(session_of(b), addr(src), addr(dst) + 4096, 8) < 0
    assert a.send_probe(session_of(open_engine)) < 0
    assert not dst[4096:].any()
    monkeypatch.setenv("KVBRIDGE_SECRET", "short")
    assert kvbridge.TransferEngine().initialize(HOST, "P2PHANDSHAKE", "tcp", "") == -1


def test_failures_reach_python_logging(pair, caplog):
    a, _ = pair
    with caplog.at_level("WARNING", logger="kvbridge"):
        assert a.send_probe(f"{HOST}:{dead_port()}") < 0
    assert any("send_probe failed" in r.getMessage() for r in caplog.records)


def test_rdma_protocol_runs_the_ucx_engine(monkeypatch, tmp_path, buffers):
    # UCX over TCP, so that no RDMA NIC is needed.
    cfg = tmp_path / "engine.json"
    cfg.write_text('{"ucx": {"settings": {"TLS": "tcp"}}}')
    monkeypatch.setenv("KVBRIDGE_ENGINE_CONFIG", str(cfg))
    a = kvbridge.TransferEngine()
    if a.initialize(HOST, "P2PHANDSHAKE", "rdma", "") != 0:
        if os.environ.get("KVBRIDGE_REQUIRE_UCX") == "1":
            pytest.fail("KVBRIDGE_REQUIRE_UCX=1 but the UCX engine does not start")
        pytest.skip("no UCX here (libucx0)")
    b = start_engine("rdma")
    assert a.transport == b.transport == "ucx"
    src, dst = buffers
    register(a, src)
    register(b, dst)
    assert a.batch_transfer_sync_write(session_of(b), [addr(src) + 7, addr(src)], [addr(dst), addr(dst) + 5000], [1000, 64]) == 0
    np.testing.assert_array_equal(dst[:1000], src[7:1007])
    np.testing.assert_array_equal(dst[5000:5064], src[:64])
    assert a.batch_transfer_sync_write(session_of(b), [addr(src)], [addr(dst) + dst.nbytes], [8]) < 0
    assert a.send_probe(session_of(b)) == 0


def test_nvlink_protocol_is_the_cuda_ipc_engine():
    e = kvbridge.TransferEngine()
    rc = e.initialize(HOST, "P2PHANDSHAKE", "nvlink_intra", "")
    # Without a GPU the CUDA IPC engine cannot start: -1, as Mooncake.
    assert rc in (0, -1)
    if rc == 0:
        assert e.transport == "ipc"
    else:
        with pytest.raises(RuntimeError):
            e.transport
