"""sglang's early send of a cached prefix under overlap scheduling
(``maybe_send_cached_prefix_chunk``): the scheduler records a CUDA event on
its forward stream, sets ``req.disagg_kv_sender._early_send_wait_event``
and sends the chunk at once. The backend must not read those pages before
the event completes, must not block the scheduler thread for it, and must
not let the room's next chunk overtake it."""

import threading

import numpy as np
import pytest
import sgl_sched as w

PAGE = 16
PAGES = 8


@pytest.fixture
def world(monkeypatch):
    s = w.sglang()
    world = w.World(s, monkeypatch)
    yield world
    world.close()


class GateEvent:
    """A stand-in for ``torch.cuda.Event``: ``synchronize()`` blocks until
    the test opens the gate, and logs when it starts and returns."""

    def __init__(self, log):
        self.log, self.gate = log, threading.Event()

    def synchronize(self):
        self.log.append("sync")
        assert self.gate.wait(20), "the gate never opened"
        self.log.append("synced")


class RecordingSender:
    """The Rust sender, with each chunk logged as it is handed over."""

    def __init__(self, rust, log):
        self._rust, self.log = rust, log

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
        self.log.append(("send", list(kv_indices)))
        return self._rust.send(kv_indices, state_indices, num_kv_tokens)

    def __getattr__(self, name):
        return getattr(self._rust, name)


def setup(world):
    s = world.s
    src = w.PlainPool([256] * 2, PAGES, PAGE, seed=11)
    dst = w.PlainPool([256] * 2, PAGES, PAGE)
    p = world.keep(w.prefill_manager(s, src, is_mla=False, layers=1))
    d = world.keep(w.decode_manager(s, dst, is_mla=False, layers=1))
    w.wait_for("the prefill server", lambda: d.try_ensure_parallel_info(world.addr))
    return s, src, dst, p, d


def room(world, s, p, d, room_id, dst_pages):
    rx = s.backend.KVReceiver(d, world.addr, room_id)
    rx.init(0)
    rx.send_metadata(np.asarray(dst_pages, dtype=np.int32), 1, None, decode_prefix_len=0)
    tx = s.backend.KVSender(p, world.addr, room_id)
    w.poll_until(tx, (s.KVPoll.WaitingForInput,))
    return rx, tx


def test_the_sender_declares_what_sglang_reads(world):
    s = world.s
    assert s.backend.KVSender.supports_host_tensor_indices is False
    _, _, _, p, _ = setup(world)
    tx = s.backend.KVSender(p, world.addr, 0x3300)
    assert tx._early_send_wait_event is None
    tx.clear()


def test_an_early_send_waits_for_its_event_off_the_scheduler_thread_in_order(world):
    s, src, dst, p, d = setup(world)
    rx, tx = room(world, s, p, d, 0x3301, [5, 3, 6])
    log = []
    tx._rust = RecordingSender(tx._rust, log)
    tx.init(3, 0)
    ev = GateEvent(log)
    # maybe_send_cached_prefix_chunk: the event, then the prefix chunk.
    tx._early_send_wait_event = ev
    tx.send(np.asarray([0, 1], dtype=np.int32))  # returns while the event is pending
    assert tx._early_send_wait_event is None, "the event belongs to that chunk only"
    w.wait_for("the wait to start", lambda: "sync" in log)
    # The rest of the prompt, no event: it must queue behind the prefix.
    tx.send(np.asarray([2], dtype=np.int32))
    assert log == ["sync"], "nothing reached Rust before the event completed"
    ev.gate.set()
    w.wait_for("both chunks", lambda: len(log) == 4)
    assert log == ["sync", "synced", ("send", [0, 1]), ("send", [2])]
    assert [w.poll_until(e, (s.KVPoll.Success, s.KVPoll.Failed)) for e in (rx, tx)] == [s.KVPoll.Success] * 2
    for b in range(2):
        for sp, dp in zip([0, 1, 2], [5, 3, 6]):
            assert (dst.page(b, dp) == src.page(b, sp)).all()


def test_without_an_event_a_chunk_goes_straight_to_rust(world):
    s, src, dst, p, d = setup(world)
    rx, tx = room(world, s, p, d, 0x3302, [4])
    log = []
    tx._rust = RecordingSender(tx._rust, log)
    tx.init(1, 0)
    tx.send(np.asarray([7], dtype=np.int32))
    assert log == [("send", [7])], "handed over on the caller's thread"
    assert w.poll_until(rx, (s.KVPoll.Success, s.KVPoll.Failed)) == s.KVPoll.Success


def test_a_chunk_refused_after_its_wait_fails_the_room_with_the_reason(world):
    s, src, dst, p, d = setup(world)
    rx, tx = room(world, s, p, d, 0x3303, [4])
    tx.init(1, 0)
    ev = GateEvent([])
    ev.gate.set()
    tx._early_send_wait_event = ev
    tx.send(np.asarray([0, 1], dtype=np.int32))  # more pages than announced
    assert w.poll_until(tx, (s.KVPoll.Failed,)) == s.KVPoll.Failed
    with pytest.raises(Exception, match="2"):
        tx.failure_exception()
