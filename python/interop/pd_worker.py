"""One PD role per process, driving sglang 0.5.23's released Mooncake
connector the way sglang's scheduler does (``disaggregation/prefill.py`` and
``decode.py``): ``bootstrap`` (sglang's bootstrap server), ``prefill`` or
``decode`` (one TP/PP rank).

    python pd_worker.py bootstrap --bootstrap-port 18998
    python pd_worker.py prefill --bootstrap-port 18998 --workload '{"requests": 4}'
    python pd_worker.py decode  --bootstrap-port 18998 --workload '{"requests": 4}'

``--backend`` picks the classes the rank drives: ``mooncake`` (sglang's own
Mooncake connector, on the engine ``--engine-module`` names) or ``kvbridge``
(kvbridge's backend, ``kvbridge.sglang_backend``, switched on as an operator
does with ``KVBRIDGE_SGLANG=backend``: engine hook plus backend classes).
Either way the classes come from sglang's own ``get_kv_class(TransferBackend.MOONCAKE, ...)``,
the call its scheduler makes, so the switch itself is exercised.

Every rank derives the same requests from ``--workload`` (kvbridge's
synthetic workload, so a ``kvbridge prefill``/``decode`` rank with the same
workload serves the same rooms). The prefill fills each request's pages with
kvbridge's byte pattern; the decode checks every byte it received, its aux
rows, and that pages no request owns stayed zero. Each rank prints one line
``RESULT {json}`` and exits 0 when it saw what its scenario expects.

``--scatter-pages SEED`` scatters each request's pages over the pool
(``harness.scatter_pages``) instead of contiguous runs. ``--bench JSON``
(``harness.BenchSpec``) runs the room-level benchmark's workload instead
(``bench_rooms.py``): many rooms in waves, scattered pages, room latencies
and timed engine calls in the prefill's RESULT, every byte verified on the
decode.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import threading
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

#: What each scenario does.
SCENARIOS = {
    "ok": "every room succeeds",
    "abort": "the decode aborts the first room right after sending its metadata",
    "kill-decode": "the decode dies after sending every room's metadata; the prefill fails them all",
    "kill-prefill": "the prefill dies before sending; the decode fails every room by its waiting timeout",
    "abort-prefill": "the prefill aborts the first room once it is WaitingForInput, before any KV; the decode "
    "aborts it once its metadata went out (as a router aborting both sides does)",
    "abort-bootstrap": "both sides abort the first room while it is still Bootstrapping (decode: before its "
    "metadata; prefill: before the decode's destination arrived)",
    "abort-last-stage": "only the prefill's last pipeline stage aborts the first room (in WaitingForInput); "
    "the other stages send it, PP0's consensus poll fails it; the decode aborts it 1 s after its metadata",
}


def kv_class(kind: str):
    """sglang's backend class of ``kind`` (manager, sender, receiver,
    bootstrap_server), as its scheduler looks it up."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend.MOONCAKE, KVClassType(kind))


def log(role: str, *parts) -> None:
    print(f"[{role} {time.monotonic():.3f}]", *parts, flush=True)


def result(role: str, ok: bool, **fields) -> int:
    print("RESULT " + json.dumps({"role": role, "ok": ok, **fields}), flush=True)
    return 0 if ok else 1


def staged_bytes(mgr) -> int:
    """The kvbridge backend's staged-bytes counter (gathered on a prefill,
    scattered on a decode); 0 for sglang's connector."""
    text = mgr.render_metrics() if hasattr(mgr, "render_metrics") else ""
    for line in text.splitlines():
        if line.startswith("kvbridge_staged_bytes_total "):
            return int(float(line.split()[1]))
    return 0


def model_from_arg(text: str) -> harness.ModelSpec:
    """``tiny``, ``tiny-mla`` or a JSON ModelSpec object."""
    if text == "tiny":
        return harness.ModelSpec()
    if text == "tiny-mla":
        return harness.ModelSpec.tiny_mla()
    spec = json.loads(text)
    spec["aux_item_lens"] = tuple(spec["aux_item_lens"])
    return harness.ModelSpec(**spec)


def run_bootstrap(args) -> int:
    server = kv_class("bootstrap_server")(host="127.0.0.1", port=args.bootstrap_port)
    log("bootstrap", f"{type(server).__module__}.{type(server).__name__} listening on 127.0.0.1:{args.bootstrap_port}")
    alive = server.is_alive if hasattr(server, "is_alive") else server.thread.is_alive
    while alive():
        time.sleep(0.5)
    return 0


def shut_down(mgr) -> None:
    """Ends a rank's manager: kvbridge's tears down (threads joined, memory
    deregistered); sglang's ``teardown()`` aborts the process (libzmq
    assertion: the context is destroyed while its bootstrap thread polls),
    so only its memory is deregistered."""
    if hasattr(mgr, "deregister_buffer_to_engine") and not hasattr(mgr, "render_metrics"):
        mgr.deregister_buffer_to_engine()
    else:
        mgr.teardown()


def build_manager(mode: str, args):
    """Publishes the runtime context, creates the engine and the manager over
    a freshly allocated pool; returns (manager, pool)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    rank = harness.RankSpec(args.tp[0], args.tp[1], args.pp[0], args.pp[1])
    sa = harness.publish_server_args(mode, bootstrap_port=args.bootstrap_port, rank=rank, http_port=args.http_port)
    if args.dp[0] > 1:
        harness.override_dp(args.dp[0], args.dp[1], args.load_balance_method)
    if args.cp[0] > 1:
        harness.override_cp(args.cp[0], args.cp[1])
    engine = harness.init_engine(gpu_id=rank.tp_rank)
    manager_class = kv_class("manager")
    log(mode, f"engine session {engine.get_session_id()} ({type(engine.engine).__module__}), "
        f"manager {manager_class.__module__}.{manager_class.__name__}")
    pool = harness.KVPool(args.model, rank, args.pages, args.aux_slots, device=args.buffers)
    kv_args = harness.make_kv_args(pool, publish_layer_ids=args.publish_layer_ids)
    dmode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return manager_class(kv_args, dmode, sa, is_mla_backend=args.model.mla), pool


def run_prefill(args) -> int:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    sender_class = kv_class("sender")
    role = (f"prefill-tp{args.tp[1]}-pp{args.pp[1]}" + (f"-dp{args.dp[1]}" if args.dp[0] > 1 else "")
            + (f"-cp{args.cp[1]}" if args.cp[0] > 1 else ""))
    # A DP group serves only the rooms dispatched to it.
    requests = [r for r in args.workload.plan() if dp_of(args, r) == args.dp[1]]
    plans = harness.allocate(requests, args.model, args.pages, args.aux_slots, reverse=False,
                             scatter_seed=args.scatter_pages)
    t0 = time.monotonic()
    mgr, pool = build_manager("prefill", args)
    for plan in plans:  # the "forward pass"
        pool.fill(plan.room, plan.pages, plan.aux_slot)
    by_room = {p.room: p for p in plans}
    tokens = {r.room: r.tokens for r in requests}
    chunk_pages = max(harness.pages_for(args.workload.chunk_tokens, args.model.page_size), 1)
    boot = f"127.0.0.1:{args.bootstrap_port}"
    senders = {p.room: sender_class(mgr, boot, p.room) for p in plans}
    first = requests[0].room if requests else None
    if args.scenario == "abort-bootstrap":
        assert senders[first].poll() == KVPoll.Bootstrapping
        senders[first].abort()  # sglang: release_aborted_prefill_waiting_req
    sent, done, failed, waiting_since = set(), set(), {}, {}
    metrics = {}

    def conclude(room: int) -> None:
        # process_disagg_prefill_inflight_queue: clear(), then the metric
        # (with PP, once PP0 decided the room: below).
        senders[room].clear()
        m = senders[room].get_transfer_metric()
        metrics[str(room)] = [m.transfer_latency_s, m.transfer_total_bytes]

    pp0_of_many = args.pp[0] > 1 and args.pp[1] == 0
    later_stage = args.pp[0] > 1 and args.pp[1] > 0
    deadline = time.monotonic() + args.timeout
    while len(done) + len(failed) < len(senders) and time.monotonic() < deadline:
        for room, sender in senders.items():
            if room in done or room in failed:
                continue
            # sglang's PP0 scheduler polls the lowest state over all stages
            # (poll_and_all_reduce_prefill_pp) and later stages act on PP0's
            # answer; here they poll their own until their rooms conclude,
            # then wait for PP0's decision (below) before clearing them.
            state = sender.poll_pp_consensus() if pp0_of_many else sender.poll()
            if state == KVPoll.WaitingForInput and room not in sent:
                since = waiting_since.setdefault(room, time.monotonic())
                if args.scenario == "kill-prefill":
                    if len(waiting_since) == len(senders):
                        log(role, "scenario kill-prefill: dying before sending any KV")
                        os._exit(0)
                    continue
                last_stage = args.pp[1] == args.pp[0] - 1
                if room == first and (args.scenario == "abort-prefill"
                                      or (args.scenario == "abort-last-stage" and last_stage)):
                    sender.abort()  # aborted in WaitingForInput, before any KV
                    continue
                if time.monotonic() - since < args.send_delay:
                    continue  # the forward pass is still running
                plan = by_room[room]
                sender.init(len(plan.pages), plan.aux_slot)  # counts pages
                left = tokens[room]
                # send_kv_chunk: one send per chunk; the last chunk completes
                # the room (carries aux); a chunk with no page is skipped
                # unless it is the last (should_send_kv_chunk).
                for i in range(0, len(plan.pages), chunk_pages):
                    chunk = np.array(plan.pages[i : i + chunk_pages], dtype=np.int32)
                    last = i + chunk_pages >= len(plan.pages)
                    n = min(len(chunk) * args.model.page_size, left)
                    left -= n
                    if sender.should_send_kv_chunk(len(chunk), last):
                        sender.send(chunk, None, n)
                sent.add(room)
            elif state == KVPoll.Success:
                done.add(room)
                if args.pp[0] == 1:
                    conclude(room)
            elif state == KVPoll.Failed:
                if later_stage:
                    failed[room] = None  # failure_exception once PP0 decided (below)
                    continue
                try:
                    sender.failure_exception()
                except Exception as e:  # KVTransferError
                    failed[room] = str(e)
        time.sleep(0.005)
    extra = {}
    if pp0_of_many:
        # What sglang's PP0 polls: the minimum status over all PP ranks.
        end = time.monotonic() + 10
        while time.monotonic() < end and not all(mgr.check_status_pp_consensus(r) == KVPoll.Success for r in done):
            time.sleep(0.05)
        extra["pp_consensus_success"] = all(mgr.check_status_pp_consensus(r) == KVPoll.Success for r in done)
    if args.pp[0] > 1:
        # pp_sync_polls: the later stages act on rooms only once PP0 has
        # decided them (a stage's clear() would retract its state from PP0).
        from sglang.srt.runtime_context import get_parallel

        get_parallel().pp_group.broadcast_object(sorted(done) if pp0_of_many else None, src=0)
        for room in [r for r, why in failed.items() if why is None]:
            try:
                senders[room].failure_exception()
            except Exception as e:  # KVTransferError
                failed[room] = str(e)
    rooms = set(senders)
    expect_failed = {
        "kill-decode": rooms,
        "abort": {first},
        "abort-prefill": {first},
        "abort-last-stage": {first},
        "abort-bootstrap": {first},
    }.get(args.scenario, set())
    # A kvbridge decode aborts these; each may fail or, if the transfer won
    # the race, succeed.
    may_fail = args.workload.aborted_rooms()
    ok = done | set(failed) == rooms and expect_failed <= set(failed) <= expect_failed | may_fail
    ok = ok and extra.get("pp_consensus_success", True)
    for room in done - {int(r) for r in metrics}:
        conclude(room)
    time.sleep(0.5)  # let the last status messages leave
    shut_down(mgr)
    return result(role, ok, done=sorted(done), failed=failed, metrics=metrics,
                  secs=round(time.monotonic() - t0, 3), **extra)


def dp_of(args, request) -> int:
    """The prefill DP group a request is dispatched to: by the bootstrap
    room (follow_bootstrap_room), else round robin by position, which a
    decode cannot compute."""
    size = args.dp[0]
    if size <= 1:
        return 0
    if args.load_balance_method == "follow_bootstrap_room":
        return request.room % size
    return request.index % size


def resolve_prefill_dp_rank(mgr, boot: str, room: int, deadline: float):
    """The prefill DP rank of ``room`` as sglang's decode scheduler finds it
    (``_resolve_prefill_dp_rank``, then ``query_prefill_dp_ranks`` on the
    manager's executor until the prefill registered the room)."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.environ import envs

    info = mgr.prefill_info_table.get(boot)
    if info is None or info.dp_size == 1:
        return 0
    if info.follow_bootstrap_room and not envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get():
        return room % info.dp_size
    while time.monotonic() < deadline:
        future = mgr._ensure_prefill_recompute_executor().submit(
            CommonKVReceiver.query_prefill_dp_ranks, boot, [room])
        found = future.result().get(str(room))
        if found is not None:
            return int(found)
        time.sleep(0.05)
    return None


def run_decode(args) -> int:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.environ import envs

    receiver_class = kv_class("receiver")
    role = f"decode-tp{args.tp[1]}-pp{args.pp[1]}"
    requests = args.workload.plan()
    plans = harness.allocate(requests, args.model, args.pages, args.aux_slots, reverse=True,
                             scatter_seed=args.scatter_pages)
    by_room = {p.room: p for p in plans}
    t0 = time.monotonic()
    mgr, pool = build_manager("decode", args)
    boot = f"127.0.0.1:{args.bootstrap_port}"
    deadline = time.monotonic() + args.timeout
    while not mgr.try_ensure_parallel_info(boot):  # 503 until every prefill rank registered
        if time.monotonic() > deadline:
            return result(role, False, error="prefill never registered")
        time.sleep(0.2)
    receivers = {}
    first = requests[0].room
    for plan in plans:
        receiver = receiver_class(mgr, boot, plan.room)
        if args.scenario == "abort-bootstrap" and plan.room == first:
            receiver.abort()  # aborted before init: never told any prefill rank
        else:
            dp = resolve_prefill_dp_rank(mgr, boot, plan.room, deadline)
            if dp is None:
                return result(role, False, error=f"no prefill DP rank for room {plan.room}")
            receiver.init(dp)
        receivers[plan.room] = receiver
    sent, done, failed = set(), set(), {}
    drained, held = {}, {}
    release_timeout = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
    abort_at = None
    while (len(done) + len(failed) < len(receivers) or held) and time.monotonic() < deadline:
        if abort_at is not None and time.monotonic() >= abort_at:
            receivers[first].abort()
            abort_at = None
        for room, receiver in receivers.items():
            if room in done or room in failed:
                continue
            state = receiver.poll()
            if state == KVPoll.WaitingForInput and room not in sent:
                plan = by_room[room]
                receiver.send_metadata(np.array(plan.pages, dtype=np.int32), plan.aux_slot)
                sent.add(room)
                if args.scenario in ("abort", "abort-prefill") and room == first:
                    receiver.abort()  # local Failed + ABORT to the prefill
                if args.scenario == "abort-last-stage" and room == first:
                    # Late, so the prefill's stages settle the room among
                    # themselves first (the last stage's abort reaches PP0).
                    abort_at = time.monotonic() + 1.0
                if args.scenario == "kill-decode" and len(sent) == len(receivers):
                    time.sleep(0.5)  # zmq sends are asynchronous: let the metadata leave
                    log(role, "scenario kill-decode: dying after sending every room's metadata")
                    os._exit(0)
            elif state == KVPoll.Success:
                done.add(room)
                receiver.clear()
            elif state == KVPoll.Failed:
                # pop_transferred: failure_exception() first, then (deferred
                # KV release) the pages are held until every prefill rank
                # that was told about the room acknowledged the abort.
                try:
                    receiver.failure_exception()
                except Exception as e:
                    failed[room] = str(e)
                if getattr(receiver, "abort_notified", False) and mgr.enable_deferred_decode_kv_release:
                    held[room] = (len(receiver.bootstrap_infos), time.monotonic() + release_timeout)
                else:
                    receiver.clear()
        # resolve_deferred_releases: drained, or (device pages) past the deadline.
        for room, (required, until) in list(held.items()):
            is_drained = mgr.is_abort_release_safe(room, required)
            if is_drained or time.monotonic() >= until:
                drained[str(room)] = is_drained
                mgr.clear_deferred_abort_state(room)
                receivers[room].clear()
                del held[room]
        time.sleep(0.005)
    for room in held:  # still held at the test's deadline
        drained[str(room)] = False
    verified, bad = 0, []
    for room in sorted(done):
        plan = by_room[room]
        n, wrong = pool.verify(room, plan.pages, plan.aux_slot)
        verified += n
        bad += [(room, *w) for w in wrong]
    # Pages no request owns must still be zero (an aborted room's own pages may hold part of it).
    untouched = pool.untouched([p for plan in plans for p in plan.pages])
    rooms = set(receivers)
    expect_failed = {
        "abort": {first},
        "abort-prefill": {first},
        "abort-last-stage": {first},
        "abort-bootstrap": {first},
        "kill-prefill": rooms,
    }.get(args.scenario, set())
    ok = done == rooms - expect_failed and set(failed) == expect_failed and not bad and untouched
    staged = staged_bytes(mgr)
    shut_down(mgr)
    return result(role, ok, done=sorted(done), failed=failed, verified_bytes=verified, bad=bad[:10],
                  untouched_ok=untouched, drained=drained, staged_bytes=staged,
                  secs=round(time.monotonic() - t0, 3))


def _percentile(values, q: float) -> float:
    """Nearest-rank percentile (the maximum for q=99 below 100 samples)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _instrument(mgr) -> dict:
    """Counts and times, without changing what they do, the calls sglang's
    prefill worker makes: ``send_kvcache`` (one per chunk: plans the blocks
    in Python, then calls the engine) and the engine wrapper's
    ``batch_transfer_sync`` (KV chunks and aux rows; ``engine_kv_s`` the
    part inside ``send_kvcache``). Instance attributes
    over the installed classes' methods; sglang's code is not touched."""
    stats = {"engine_calls": 0, "engine_blocks": 0, "engine_s": 0.0, "engine_kv_s": 0.0,
             "send_kvcache_calls": 0, "send_kvcache_s": 0.0}
    lock, inside = threading.Lock(), threading.local()
    engine = getattr(mgr, "engine", None)
    if engine is None or not hasattr(mgr, "send_kvcache"):
        return stats  # kvbridge's backend: no Python transfer thread to time
    engine_call, send_kvcache = engine.batch_transfer_sync, mgr.send_kvcache

    def timed_engine(session_id, buffers, peer_buffer_addresses, lengths):
        t = time.perf_counter()
        try:
            return engine_call(session_id, buffers, peer_buffer_addresses, lengths)
        finally:
            dt = time.perf_counter() - t
            with lock:
                stats["engine_calls"] += 1
                stats["engine_blocks"] += len(lengths)
                stats["engine_s"] += dt
                if getattr(inside, "send_kvcache", False):
                    stats["engine_kv_s"] += dt

    def timed_send_kvcache(*a, **kw):
        t = time.perf_counter()
        inside.send_kvcache = True
        try:
            return send_kvcache(*a, **kw)
        finally:
            inside.send_kvcache = False
            dt = time.perf_counter() - t
            with lock:
                stats["send_kvcache_calls"] += 1
                stats["send_kvcache_s"] += dt

    engine.batch_transfer_sync = timed_engine
    mgr.send_kvcache = timed_send_kvcache
    return stats


class _CallTimer:
    """Scheduler-thread cost: ``time.perf_counter_ns`` around every call the
    bench's driver (the stand-in for sglang's scheduler thread) makes on a
    sender or receiver, per kind of call and per room."""

    def __init__(self):
        self.calls: Dict[str, List[int]] = {}
        self.per_room: Dict[str, Dict[int, int]] = {}
        self.late: List[int] = []
        #: This thread's CPU time per kind (thread_time_ns, around the wall
        #: clock reads): wall time well above it is time spent off the CPU
        #: (preempted on a busy machine, or waiting for the GIL or a lock).
        self.cpu: Dict[str, int] = {}

    def __call__(self, kind: str, room: int, fn, *a):
        c = time.thread_time_ns()
        t = time.perf_counter_ns()
        try:
            return fn(*a)
        finally:
            dt = time.perf_counter_ns() - t
            self.cpu[kind] = self.cpu.get(kind, 0) + time.thread_time_ns() - c
            self.calls.setdefault(kind, []).append(dt)
            rooms = self.per_room.setdefault(kind, {})
            rooms[room] = rooms.get(room, 0) + dt

    def report(self) -> dict:
        """Per kind: calls, total, mean/p50/p99/max per call, and the mean
        per room of each room's sum (ns)."""
        out = {}
        for kind, ns in self.calls.items():
            per_room = list(self.per_room[kind].values())
            out[kind] = {"calls": len(ns), "total_ns": sum(ns), "mean_ns": sum(ns) / len(ns),
                         "p50_ns": _percentile(ns, 50), "p99_ns": _percentile(ns, 99), "max_ns": max(ns),
                         "rooms": len(per_room), "per_room_ns": sum(per_room) / len(per_room),
                         "cpu_ns": self.cpu.get(kind, 0)}
            if kind in ("send", "init", "send_metadata", "create"):  # one per room (chunk): keep them all
                out[kind]["each_ns"] = ns
        return out

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` between polling rounds; records how much later than
        asked it returned (``late_ns``): waking needs the GIL back, so a
        Python thread holding it (sglang's transfer thread planning blocks,
        a garbage collection there) shows up here as a scheduler stall."""
        t = time.perf_counter_ns()
        time.sleep(seconds)
        self.late.append(time.perf_counter_ns() - t - int(seconds * 1e9))

    def late_report(self) -> dict:
        ns = self.late
        if not ns:
            return {}
        return {"calls": len(ns), "total_ns": sum(ns), "mean_ns": sum(ns) / len(ns),
                "p50_ns": _percentile(ns, 50), "p99_ns": _percentile(ns, 99), "max_ns": max(ns)}


def _gc_watch() -> dict:
    """Counts Python's cyclic garbage collections of this process by
    generation and the seconds they took (``gc.callbacks``), from now on;
    ``gc_tracked`` is how many objects a full collection visits now."""
    import gc

    stats = {"gc_s": 0.0, "gc_runs": [0, 0, 0], "gc_tracked": len(gc.get_objects())}
    started = {}

    def callback(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            stats["gc_s"] += time.perf_counter() - started.pop("t")
            stats["gc_runs"][info["generation"]] += 1

    gc.callbacks.append(callback)
    return stats


def _maybe_freeze_gc(bench) -> None:
    """``BenchSpec.freeze_gc``: what sglang's ``/freeze_gc`` endpoint makes
    a scheduler do (``sglang.srt.utils.common.freeze_gc``): every object
    alive now moves to the permanent generation, which collections skip."""
    if bench.freeze_gc:
        from sglang.srt.utils.common import freeze_gc

        freeze_gc("Scheduler")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def run_prefill_bench(args) -> int:
    """``--bench``: the prefill of bench_rooms.py (harness.BenchSpec). Sends
    every room as soon as the decode asked for it; reports per room the time
    from ``sender.send`` of its first chunk to ``KVPoll.Success`` seen by
    polling, and per wave the time from its first send to its last Success."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    role = "prefill-bench"
    bench, model = args.bench, args.model
    rooms = bench.room_ids()
    slot_pages = bench.prefill_pages(model)
    args.pages, args.aux_slots = bench.pool_pages(model), bench.rooms_per_wave
    t0 = time.monotonic()
    mgr, pool = build_manager("prefill", args)
    for slot, pages in enumerate(slot_pages):  # the "forward pass", once per content slot
        pool.fill_request(bench.content_seed(slot), pages, slot)
    setup_s = time.monotonic() - t0
    log(role, f"pool filled ({setup_s:.2f} s with the manager)")
    stats = _instrument(mgr)
    _maybe_freeze_gc(bench)
    gc_stats = _gc_watch()
    # Blocks per room as sglang's own planner makes them (both sides derive the plan).
    blocks = []
    for w, wave in enumerate(bench.waves()):
        wave_dst = bench.decode_pages(model, w)
        for j, i in enumerate(wave):
            src, dst = slot_pages[bench.slot(i)], wave_dst[j]
            groups, _ = group_concurrent_contiguous(np.array(src, dtype=np.int32), np.array(dst, dtype=np.int32))
            blocks.append(len(groups) * len(pool.kv))
    chunk_pages = bench.chunk_pages(model)
    boot = f"127.0.0.1:{args.bootstrap_port}"
    sender_class = kv_class("sender")
    senders = {room: sender_class(mgr, boot, room) for room in rooms}
    timer = _CallTimer()
    index = {room: i for i, room in enumerate(rooms)}
    sent, done, failed = {}, {}, {}
    cpu0 = None
    deadline = time.monotonic() + args.timeout
    while len(done) + len(failed) < len(rooms) and time.monotonic() < deadline:
        for room, sender in senders.items():
            if room in done or room in failed:
                continue
            state = timer("poll", room, sender.poll)
            if state == KVPoll.WaitingForInput and room not in sent:
                pages = slot_pages[bench.slot(index[room])]
                if cpu0 is None:
                    cpu0 = _cpu()
                sent[room] = time.perf_counter()
                timer("init", room, sender.init, len(pages), bench.slot(index[room]))
                left = bench.room_tokens
                for k in range(0, len(pages), chunk_pages):
                    chunk = np.array(pages[k : k + chunk_pages], dtype=np.int32)
                    n = min(len(chunk) * model.page_size, left)
                    left -= n
                    timer("send", room, sender.send, chunk, None, n)
            elif state == KVPoll.Success:
                done[room] = time.perf_counter()
            elif state == KVPoll.Failed:
                try:
                    sender.failure_exception()
                except Exception as e:  # KVTransferError
                    failed[room] = str(e)
        timer.sleep(bench.poll_s)
    cpu_s = _cpu() - (cpu0 if cpu0 is not None else _cpu())
    log(role, f"{len(done)} rooms done, {len(failed)} failed")
    ok = len(done) == len(rooms) and not failed
    latency = [done[r] - sent[r] for r in rooms if r in done]
    windows = []
    for wave in bench.waves():
        ws = [rooms[i] for i in wave]
        if all(r in done for r in ws):
            windows.append(max(done[r] for r in ws) - min(sent[r] for r in ws))
    transfer_s = sum(windows)
    span_s = (max(done.values()) - min(sent.values())) if done else 0.0
    kv_bytes = len(done) * bench.kv_bytes_per_room(model, pool.rank)
    time.sleep(0.5)  # let the last status messages leave
    shut_down(mgr)
    engine = getattr(mgr, "engine", None)
    engine_module = type(engine.engine).__module__ if engine is not None else type(mgr).__module__
    return result(role, ok, sched=timer.report(), sleep_late=timer.late_report(), backend=args.backend,
                  done=sorted(done), failed=failed, rooms=len(rooms), kv_bytes=kv_bytes,
                  transfer_s=transfer_s, wave_s=windows, span_s=span_s, latency_s=latency,
                  latency_p50_s=_percentile(latency, 50), latency_p99_s=_percentile(latency, 99),
                  blocks_per_room=blocks, block_bytes=pool.item_len, cpu_s=cpu_s, setup_s=round(setup_s, 3),
                  engine_module=engine_module, **stats, **gc_stats)


def run_decode_bench(args) -> int:
    """``--bench``: the decode of bench_rooms.py. Wave by wave: destinations
    of the wave's rooms, wait for every room's Success, check every byte
    (outside the prefill's timed windows) and zero the pages again."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    role = "decode-bench"
    bench, model = args.bench, args.model
    rooms = bench.room_ids()
    args.pages, args.aux_slots = bench.pool_pages(model), bench.rooms_per_wave
    mgr, pool = build_manager("decode", args)
    for buf in pool.kv:  # touch every page now: first-write page faults would land in the first wave
        buf[:] = 0
    npages = bench.pages_per_room(model)
    expected = [pool.request_patterns(bench.content_seed(s), npages) for s in range(bench.rooms_per_wave)]
    log(role, "pool filled with zeros, expected bytes computed")
    _maybe_freeze_gc(bench)
    gc_stats = _gc_watch()
    boot = f"127.0.0.1:{args.bootstrap_port}"
    deadline = time.monotonic() + args.timeout
    while not mgr.try_ensure_parallel_info(boot):  # 503 until the prefill registered
        if time.monotonic() > deadline:
            return result(role, False, error="prefill never registered")
        time.sleep(0.2)
    done, failed, verified, bad, wait_s, verify_s, cpu_s = [], {}, 0, [], 0.0, 0.0, 0.0
    receiver_class, timer = kv_class("receiver"), _CallTimer()
    for w, wave in enumerate(bench.waves()):
        dst = bench.decode_pages(model, w)
        receivers = {}
        for j, i in enumerate(wave):
            receiver = timer("create", rooms[i], receiver_class, mgr, boot, rooms[i])
            timer("init", rooms[i], receiver.init, 0)  # prefill DP rank
            receivers[rooms[i]] = (receiver, j, i)
        t, c = time.perf_counter(), _cpu()
        sent, ended = set(), {}
        while len(ended) < len(receivers) and time.monotonic() < deadline:
            for room, (receiver, j, _) in receivers.items():
                if room in ended:
                    continue
                state = timer("poll", room, receiver.poll)
                if state == KVPoll.WaitingForInput and room not in sent:
                    timer("send_metadata", room, receiver.send_metadata, np.array(dst[j], dtype=np.int32), j)
                    sent.add(room)
                elif state == KVPoll.Success:
                    ended[room] = True
                elif state == KVPoll.Failed:
                    try:
                        receiver.failure_exception()
                    except Exception as e:
                        failed[room] = str(e)
                    ended[room] = False
            timer.sleep(bench.poll_s)
        wait_s += time.perf_counter() - t
        cpu_s += _cpu() - c
        t = time.perf_counter()
        for room, (_, j, i) in receivers.items():
            if ended.get(room):
                n, wrong = pool.verify_request(bench.content_seed(bench.slot(i)), dst[j], j,
                                               expected[bench.slot(i)])
                verified += n
                bad += [(room, *x) for x in wrong]
                done.append(room)
            pool.clear_request(dst[j], j)
        verify_s += time.perf_counter() - t
        if len(ended) < len(receivers):
            break  # deadline
    ok = sorted(done) == sorted(rooms) and not failed and not bad
    shut_down(mgr)
    return result(role, ok, sched=timer.report(), sleep_late=timer.late_report(), backend=args.backend,
                  done=sorted(done), failed=failed, verified_bytes=verified, bad=bad[:10],
                  expected_bytes=len(rooms) * bench.bytes_per_room(model, pool.rank),
                  wait_s=wait_s, verify_s=verify_s, cpu_s=cpu_s, **gc_stats)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["bootstrap", "prefill", "decode"])
    ap.add_argument("--bootstrap-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, default=30000, help="the prefill's HTTP port it registers")
    ap.add_argument("--model", type=model_from_arg, default=harness.ModelSpec(),
                    help="tiny (default), tiny-mla, or a JSON ModelSpec")
    ap.add_argument("--workload", default="{}", type=lambda s: harness.Workload(**json.loads(s)),
                    help="JSON Workload fields (requests, prompt_tokens, chunk_tokens, seed)")
    ap.add_argument("--tp", type=int, nargs=2, default=[1, 0], metavar=("SIZE", "RANK"))
    ap.add_argument("--pp", type=int, nargs=2, default=[1, 0], metavar=("SIZE", "RANK"))
    ap.add_argument("--dp", type=int, nargs=2, default=[1, 0], metavar=("SIZE", "RANK"),
                    help="prefill: attention-DP size and this process's DP rank (one attention-TP rank each)")
    ap.add_argument("--cp", type=int, nargs=2, default=[1, 0], metavar=("SIZE", "RANK"),
                    help="prefill: attention-CP size and this process's CP rank (each holds the whole KV)")
    ap.add_argument("--load-balance-method", default="follow_bootstrap_room",
                    help="how rooms reach prefill DP ranks (sglang's --load-balance-method)")
    ap.add_argument("--pages", type=int, default=64, help="pages per KV buffer")
    ap.add_argument("--aux-slots", type=int, default=16, help="rows per aux buffer")
    ap.add_argument("--buffers", default="cpu", help="cpu (numpy) or cuda[:N] (torch device tensors)")
    ap.add_argument("--publish-layer-ids", action="store_true",
                    help="publish every KV buffer's layer id (as kvbridge ranks do)")
    ap.add_argument("--engine-module", default=None,
                    help="module whose TransferEngine sglang uses (e.g. kvbridge); default: Mooncake's")
    ap.add_argument("--backend", default="mooncake", choices=["mooncake", "kvbridge"],
                    help="sglang's own Mooncake connector, or kvbridge's backend (KVBRIDGE_SGLANG=backend)")
    ap.add_argument("--scenario", default="ok", choices=sorted(SCENARIOS))
    ap.add_argument("--send-delay", type=float, default=0.0, help="prefill: seconds between WaitingForInput and send")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--scatter-pages", type=int, default=None, metavar="SEED",
                    help="scatter each request's pages over the pool (seeded) instead of contiguous runs")
    ap.add_argument("--bench", default=None, type=lambda s: harness.BenchSpec(**json.loads(s)),
                    help="JSON BenchSpec: run bench_rooms.py's workload instead of --workload/--scenario "
                         "(prefill and decode ranks, TP1; --buffers as for the other workloads)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.setup_process(args.engine_module, backend=args.backend)
    logging.basicConfig(level=os.environ.get("KVB_INTEROP_LOGLEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.bench is not None and args.role != "bootstrap":
        return {"prefill": run_prefill_bench, "decode": run_decode_bench}[args.role](args)
    return {"bootstrap": run_bootstrap, "prefill": run_prefill, "decode": run_decode}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
