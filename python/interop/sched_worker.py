"""One PD rank per process through sglang 0.5.23's own scheduler classes
(``sched_world.World``), or the bootstrap server.

    python sched_worker.py bootstrap --bootstrap-port 18998 --backend kvbridge
    python sched_worker.py prefill --bootstrap-port 18998 --backend kvbridge --rooms 8
    python sched_worker.py decode  --bootstrap-port 18998 --backend mooncake --rooms 8

``--backend`` picks the classes sglang's ``get_kv_class`` returns in this
process: ``mooncake`` (sglang's own Mooncake connector, on kvbridge's engine
through the engine hook) or ``kvbridge`` (kvbridge's backend, as
``KVBRIDGE_SGLANG=backend`` switches it on). Every rank derives the same
rooms from ``--rooms``/``--tokens``; the decode checks every KV byte it
received against the pattern each prefill rank wrote (``sched_world``) and
the first token carried in sglang's metadata buffers. Each rank prints one
``RESULT {json}`` line and exits 0 when it saw what its scenario expects.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import sched_parallel  # noqa: E402
from pd_worker import log, result, staged_bytes  # noqa: E402  (one copy of the RESULT protocol)

#: What each scenario does.
SCENARIOS = {
    "ok": "every room succeeds",
    "abort-decode": "the decode aborts the first room once its metadata went out",
    "abort-prefill": "the prefill aborts the first room while it waits to be scheduled "
    "(release_aborted_prefill_waiting_req); the decode sees it fail",
    "kill-decode": "the decode dies once every room's metadata went out; the prefill fails them all",
}


def rooms(args):
    """``(room, tokens)`` of every request; lengths vary around --tokens."""
    return [(1000 + i, args.tokens + (i * 13) % (2 * args.shape.page_size + 5)) for i in range(args.rooms)]


def run_bootstrap(args) -> int:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = get_kv_class(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=args.bootstrap_port)
    log("bootstrap", f"{type(server).__module__}.{type(server).__name__} on 127.0.0.1:{args.bootstrap_port}")
    alive = server.is_alive if hasattr(server, "is_alive") else server.thread.is_alive
    while alive():
        time.sleep(0.5)
    return 0


def aborted(req) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT) or isinstance(req.to_finish, FINISH_ABORT)


def world(mode: str, args):
    import sched_world

    extra = sched_parallel.server_args_extra(args) if mode == "prefill" else {}
    return sched_world.World(mode, args.shape, bootstrap_port=args.bootstrap_port, http_port=args.http_port,
                             gloo_port=args.gloo_port, server_args_extra=extra)


def run_prefill(args) -> int:
    role = f"prefill-tp{args.shape.tp_rank}-pp{args.shape.pp_rank}"
    w = world("prefill", args)
    log(role, f"manager {type(w.kv_manager).__module__}.{type(w.kv_manager).__name__}")
    reqs = {}
    for room, tokens in sched_parallel.routed(args, rooms(args)):  # attention DP: this group's
        reqs[room] = w.make_req(room, tokens)
        w.prefill_add(reqs[room])
    first = min(room for room, _ in rooms(args))
    s = w.scheduler
    succeeded, failed = set(), {}
    aborted_sent = False
    deadline = time.monotonic() + args.timeout
    if args.shape.pp_size > 1:
        # sglang's own PP prefill loop (sched_parallel); what concluded was streamed.
        assert args.scenario in ("ok", "abort-decode"), args.scenario
        rdv = os.path.join(tempfile.gettempdir(), f"kvb-sched-pp-{args.bootstrap_port}-{args.gloo_port}")
        sched_parallel.run_pp_prefill(w, set(reqs), deadline, rdv)
        for req in w.recorder.streamed:
            if aborted(req):
                failed[req.bootstrap_room] = str(req.finished_reason.message)
            else:
                succeeded.add(req.bootstrap_room)
    while len(succeeded) + len(failed) < len(reqs) and time.monotonic() < deadline:
        if args.scenario == "abort-prefill" and not aborted_sent:
            # The router aborts the request before it ran (bootstrap queue).
            w.abort(first)
            aborted_sent = True
        # kill-decode: the forward pass starts only once the decode is gone.
        busy = args.scenario == "kill-decode" and time.monotonic() < deadline - args.timeout + 4.0
        for req in w.prefill_step(run_batches=not busy):
            if aborted(req):
                failed[req.bootstrap_room] = str(req.finished_reason.message)
            else:
                succeeded.add(req.bootstrap_room)
        for req in w.recorder.streamed:  # bootstrap failures, streamed at once
            if aborted(req) and req.bootstrap_room not in failed:
                failed[req.bootstrap_room] = str(req.finished_reason.message)
        time.sleep(0.002)
    expect_failed = {"abort-decode": {first}, "abort-prefill": {first}, "kill-decode": set(reqs)}.get(
        args.scenario, set()) & set(reqs)
    concluded = succeeded | set(failed) == set(reqs)
    ok = concluded and set(failed) == expect_failed
    if w.hybrid:  # each hybrid pool's free capacity against its size
        import sched_hybrid

        leaks = sched_hybrid.leaks(w)
    else:
        leaks = {"free_kv_tokens": w.allocator.available_size() + w.tree_cache.evictable_size(),
                 "pool_tokens": w.shape.pool_tokens}
    leaks["metadata_free"] = s.req_to_metadata_buffer_idx_allocator.available_size()
    return result(role, ok, succeeded=sorted(succeeded), failed={str(k): v for k, v in failed.items()},
                  manager=type(w.kv_manager).__module__, leaks=leaks, staged_bytes=staged_bytes(w.kv_manager),
                  kv_args=w.layout_args())


def run_decode(args) -> int:
    role = f"decode-tp{args.shape.tp_rank}"
    w = world("decode", args)
    log(role, f"manager {type(w.kv_manager).__module__}.{type(w.kv_manager).__name__}")
    reqs = {}
    for room, tokens in rooms(args):
        reqs[room] = w.make_req(room, tokens)
        w.decode_add(reqs[room])
    first = min(reqs)
    s = w.scheduler
    arrived, failed, checks, failed_after = set(), {}, {}, {}
    t0 = time.monotonic()
    aborted_sent = False
    deadline = time.monotonic() + args.timeout
    while len(arrived) + len(failed) < len(reqs) and time.monotonic() < deadline:
        for req in w.decode_step():
            room = req.bootstrap_room
            arrived.add(room)
            checks[room] = w.verify(req)
        transfer_rooms = [d.req.bootstrap_room for d in s.disagg_decode_transfer_queue.queue]
        if args.scenario == "kill-decode" and len(transfer_rooms) == len(reqs):
            # Long enough for zmq to deliver the last metadata message (an
            # undelivered one would leave its room to the prefill's
            # bootstrap timeout, as with sglang's own decode).
            time.sleep(1.0)
            log(role, "scenario kill-decode: dying with every room's metadata sent")
            os._exit(0)
        if args.scenario == "abort-decode" and not aborted_sent and first in transfer_rooms:
            # The router aborts the request after its metadata went out
            # (Scheduler.abort_request marks it; pop_transferred releases it).
            w.abort(first)
            aborted_sent = True
        for req in w.recorder.streamed:
            if aborted(req) and req.bootstrap_room not in failed:
                failed[req.bootstrap_room] = str(req.finished_reason.message)
                failed_after[req.bootstrap_room] = round(time.monotonic() - t0, 2)
        time.sleep(0.002)
    bad = {r: c for r, c in checks.items() if c["mismatched"] or not c["token_ok"]}
    expect_failed = {"abort-decode": {first}, "abort-prefill": {first}}.get(args.scenario, set())
    ok = arrived | set(failed) == set(reqs) and set(failed) == expect_failed and not bad
    return result(role, ok, arrived=sorted(arrived), failed={str(k): v for k, v in failed.items()},
                  verified_bytes=sum(c["bytes"] for c in checks.values()),
                  mismatched=sum(c["mismatched"] for c in checks.values()), bad={str(k): v for k, v in bad.items()},
                  failed_after_s={str(k): v for k, v in failed_after.items()},
                  manager=type(w.kv_manager).__module__, staged_bytes=staged_bytes(w.kv_manager),
                  kv_args=w.layout_args())


def parse_args(argv=None):
    import sched_world

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["bootstrap", "prefill", "decode"])
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--gloo-port", type=int, default=0)
    p.add_argument("--backend", choices=["mooncake", "kvbridge"], default="kvbridge")
    p.add_argument("--layout", choices=sorted(sched_world.MODELS), default="mha")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--page-size", type=int, default=None, help="default: the layout's (16; DeepSeek-V4 256)")
    p.add_argument("--tp", type=int, nargs=2, default=(1, 0), metavar=("SIZE", "RANK"))
    p.add_argument("--pp", type=int, nargs=2, default=(1, 0), metavar=("SIZE", "RANK"))
    p.add_argument("--rooms", type=int, default=6)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--attn-dp", type=int, default=1, help="prefill attention-DP groups in --tp (sched_parallel)")
    p.add_argument("--attn-cp", type=int, default=1, help="prefill attention-CP ranks in --tp (sched_parallel)")
    p.add_argument("--load-balance-method", default="follow_bootstrap_room",
                   choices=["follow_bootstrap_room", "round_robin"])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="ok")
    p.add_argument("--device", default=os.environ.get("KVB_INTEROP_BUFFERS", "cpu"))
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    fields = sched_world.layout_shape(args.layout)
    if args.page_size is not None:
        fields["page_size"] = args.page_size
    args.shape = sched_world.Shape(layout=args.layout, layers=args.layers, tp_size=args.tp[0], tp_rank=args.tp[1],
                                   pp_size=args.pp[0], pp_rank=args.pp[1], device=args.device, **fields)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.setup_process("kvbridge", backend=args.backend)
    logging.basicConfig(level=os.environ.get("KVB_INTEROP_LOGLEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return {"bootstrap": run_bootstrap, "prefill": run_prefill, "decode": run_decode}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
