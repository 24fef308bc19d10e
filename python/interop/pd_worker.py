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
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

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
    role = f"prefill-tp{args.tp[1]}-pp{args.pp[1]}"
    requests = args.workload.plan()
    plans = harness.allocate(requests, args.model, args.pages, args.aux_slots, reverse=False)
    t0 = time.monotonic()
    mgr, pool = build_manager("prefill", args)
    for plan in plans:  # the "forward pass"
        pool.fill(plan.room, plan.pages, plan.aux_slot)
    by_room = {p.room: p for p in plans}
    tokens = {r.room: r.tokens for r in requests}
    chunk_pages = max(harness.pages_for(args.workload.chunk_tokens, args.model.page_size), 1)
    boot = f"127.0.0.1:{args.bootstrap_port}"
    senders = {p.room: sender_class(mgr, boot, p.room) for p in plans}
    first = requests[0].room
    if args.scenario == "abort-bootstrap":
        assert senders[first].poll() == KVPoll.Bootstrapping
        senders[first].abort()  # sglang: release_aborted_prefill_waiting_req
    sent, done, failed, waiting_since = set(), set(), {}, {}
    metrics = {}

    def conclude(room: int) -> None:
        # process_disagg_prefill_inflight_queue: clear(), then the metric.
        # A later PP stage keeps its room (sglang clears it on PP0's
        # consensus, which this driver does not relay), so PP0 reads it.
        if args.pp[0] == 1 or args.pp[1] == 0:
            senders[room].clear()
        m = senders[room].get_transfer_metric()
        metrics[str(room)] = [m.transfer_latency_s, m.transfer_total_bytes]

    deadline = time.monotonic() + args.timeout
    while len(done) + len(failed) < len(senders) and time.monotonic() < deadline:
        for room, sender in senders.items():
            if room in done or room in failed:
                continue
            state = sender.poll()
            if state == KVPoll.WaitingForInput and room not in sent:
                since = waiting_since.setdefault(room, time.monotonic())
                if args.scenario == "kill-prefill":
                    if len(waiting_since) == len(senders):
                        log(role, "scenario kill-prefill: dying before sending any KV")
                        os._exit(0)
                    continue
                if args.scenario == "abort-prefill" and room == first:
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
                try:
                    sender.failure_exception()
                except Exception as e:  # KVTransferError
                    failed[room] = str(e)
        time.sleep(0.005)
    rooms = set(senders)
    expect_failed = {
        "kill-decode": rooms,
        "abort": {first},
        "abort-prefill": {first},
        "abort-bootstrap": {first},
    }.get(args.scenario, set())
    # A kvbridge decode aborts these; each may fail or, if the transfer won
    # the race, succeed.
    may_fail = args.workload.aborted_rooms()
    ok = done | set(failed) == rooms and expect_failed <= set(failed) <= expect_failed | may_fail
    extra = {}
    if args.pp[0] > 1 and args.pp[1] == 0 and ok:
        # What sglang's PP0 polls: the minimum status over all PP ranks.
        end = time.monotonic() + 10
        while time.monotonic() < end and not all(mgr.check_status_pp_consensus(r) == KVPoll.Success for r in done):
            time.sleep(0.05)
        extra["pp_consensus_success"] = all(mgr.check_status_pp_consensus(r) == KVPoll.Success for r in done)
        ok = ok and extra["pp_consensus_success"]
    # With PP, PP0 reads the consensus above before any stage clears its room.
    for room in done - {int(r) for r in metrics}:
        conclude(room)
    time.sleep(0.5)  # let the last status messages leave
    shut_down(mgr)
    return result(role, ok, done=sorted(done), failed=failed, metrics=metrics,
                  secs=round(time.monotonic() - t0, 3), **extra)


def run_decode(args) -> int:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.environ import envs

    receiver_class = kv_class("receiver")
    role = f"decode-tp{args.tp[1]}-pp{args.pp[1]}"
    requests = args.workload.plan()
    plans = harness.allocate(requests, args.model, args.pages, args.aux_slots, reverse=True)
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
            receiver.init(0)  # prefill DP rank
        receivers[plan.room] = receiver
    sent, done, failed = set(), set(), {}
    drained, held = {}, {}
    release_timeout = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
    while (len(done) + len(failed) < len(receivers) or held) and time.monotonic() < deadline:
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
        "abort-bootstrap": {first},
        "kill-prefill": rooms,
    }.get(args.scenario, set())
    ok = done == rooms - expect_failed and set(failed) == expect_failed and not bad and untouched
    shut_down(mgr)
    return result(role, ok, done=sorted(done), failed=failed, verified_bytes=verified, bad=bad[:10],
                  untouched_ok=untouched, drained=drained, secs=round(time.monotonic() - t0, 3))


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
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.setup_process(args.engine_module, backend=args.backend)
    logging.basicConfig(level=os.environ.get("KVB_INTEROP_LOGLEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return {"bootstrap": run_bootstrap, "prefill": run_prefill, "decode": run_decode}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
