"""Room-level benchmark: sglang 0.5.23's released Mooncake PD connector
(``MooncakeKVManager`` / ``MooncakeKVSender`` / ``MooncakeKVReceiver`` from
the installed wheel) running one prefill rank and one decode rank, once on
Mooncake's own TCP engine (``mooncake-transfer-engine-non-cuda``,
``MC_FORCE_TCP=1``, protocol ``tcp``) and once on ``kvbridge.TransferEngine``
(switched in through ``kvbridge.sglang``), with the same workload.

Workload: Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16:
256 B per head and token; TP1, so 64 KV buffers and one page of one buffer
is ``page_size`` x 2 KiB). Each block size picks the page size (4 KiB: 2,
64 KiB: 32, 1 MiB: 512). Every room is ``--room-tokens`` tokens (1024 = 128
MiB of KV) sent as one chunk; its pages are scattered over both pools (a
seeded shuffle, reshuffled until no two pages of a room are neighbours), so
sglang's merging of contiguous page runs finds nothing and every page of
every buffer is its own block. The decode asks for ``--rooms-per-wave``
rooms at a time (both pools hold one wave), waits for all of them, checks
every byte and zeroes the pages, then asks for the next wave.

Reported per engine and block size (medians over rounds, except latency):
requests/s and GB/s = rooms and KV bytes over the transfer time, the sum
over waves of (first ``sender.send`` of the wave -> last room's
``KVPoll.Success`` seen on the prefill); p50 / p99 room latency, prefill
side, from ``sender.send`` of the room's first chunk to its
``KVPoll.Success`` (polled every ``--poll-ms``), nearest rank over the rooms
of all rounds; bytes verified on the decode; the share of the prefill's
``send_kvcache`` time spent inside the engine call. A second table splits a
room's time on the prefill's transfer thread: sglang's ``send_kvcache``, the
engine call inside it, the rest (sglang's Python: planning the blocks), and
the prefill's garbage collections. ``--freeze-gc`` makes both ranks call
sglang's ``freeze_gc`` first, as its ``/freeze_gc`` endpoint does.

    python bench_rooms.py                      # both engines, 4 KiB / 64 KiB / 1 MiB, 2 rounds
    python bench_rooms.py --json out.json      # also the raw runs
    python bench_rooms.py --engines kvbridge --block-sizes 65536 --rounds 1
    python bench_rooms.py --backend            # connector vs backend, both on kvbridge's engine

``--backend`` compares, instead of engines, two columns on kvbridge's
engine: ``connector`` (sglang's Mooncake connector classes, as above) and
``backend`` (kvbridge's backend classes, ``KVBRIDGE_SGLANG=backend``, for
bootstrap, prefill and decode), same workload and driver, columns
alternated per round. It adds the scheduler thread's cost: pd_worker times
(``time.perf_counter_ns``) every call the driver makes on the calling
thread -- prefill ``sender.poll()`` / ``init()`` / ``send()``, decode
receiver construction, ``init()``, ``send_metadata()``, ``poll()`` -- and
reports per call mean / p50 / p99 and per room the sum, next to requests/s,
GB/s and p50/p99 latency, and whether issue 17's goal holds per block size
(backend's scheduler time per room <= 1/10 of the connector's on both sides,
p50 and p99 latency no higher).

Mooncake's TCP engine rejects a call of more than 2 048 blocks by default
(per peer: ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` 1024 queued +
``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` 1024 pending; sglang then fails
the room). A 1024-token room at 4 KiB blocks is one call of 32 768 blocks,
so the Mooncake column raises both to ``--mooncake-queue`` (default 65535,
their maximum); ``--mooncake-queue 0`` keeps Mooncake's defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import cluster
import harness

#: Engine column -> module given to the engine hook (None: Mooncake's own).
ENGINES = {"kvbridge": "kvbridge", "mooncake": None}
#: ``--backend`` columns -> cluster.Spec fields. "connector": sglang's
#: Mooncake connector classes on kvbridge's engine (the "kvbridge" engine
#: column under another name); "backend": kvbridge's backend classes
#: (KVBRIDGE_SGLANG=backend) for bootstrap, prefill and decode.
BACKEND_COLUMNS = {
    "connector": {"engine_module": "kvbridge"},
    "backend": {"prefill_backend": "kvbridge", "decode_backend": "kvbridge", "bootstrap_backend": "kvbridge"},
}
#: Scheduler-thread calls reported per side (pd_worker's ``sched``).
SCHED_CALLS = {"prefill": ("send", "poll", "init"), "decode": ("poll", "init", "send_metadata", "create")}
#: Llama-3-8B's KV per token and layer at TP1: 8 heads x 128 x bf16.
KV_HEADS, HEAD_BYTES, LAYERS = 8, 256, 32
DEFAULT_ROOMS = {4096: 4, 65536: 12, 1048576: 16}


def model_for(block_bytes: int, layers: int = LAYERS) -> harness.ModelSpec:
    """The Llama-3-8B-shaped model whose page of one KV buffer is ``block_bytes``."""
    per_token = KV_HEADS * HEAD_BYTES
    if block_bytes % per_token:
        raise SystemExit(f"block size {block_bytes} is not a multiple of {per_token} B (one token, 8 heads)")
    return harness.ModelSpec(name="llama-3-8b", layers=layers, kv_heads=KV_HEADS, head_bytes=HEAD_BYTES,
                             page_size=block_bytes // per_token)


def engine_env(engine: str, mooncake_queue: int) -> Dict[str, str]:
    if engine == "mooncake" and mooncake_queue > 0:
        return {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(mooncake_queue),
                "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": str(mooncake_queue)}
    return {}


def run_one(engine: str, block: int, bench: harness.BenchSpec, args) -> dict:
    """One cluster (bootstrap, prefill, decode) on ``engine``; what it measured."""
    model = model_for(block, args.layers)
    fields = BACKEND_COLUMNS[engine] if engine in BACKEND_COLUMNS else {"engine_module": ENGINES[engine]}
    spec = cluster.Spec(model=model, timeout=args.timeout, **fields,
                        worker_args=["--bench", json.dumps(bench.to_json())],
                        env=engine_env(engine, args.mooncake_queue))
    t, load_before = time.monotonic(), list(os.getloadavg())
    outcome = cluster.run(spec)
    pre = outcome.procs["prefill-tp0"].result or {}
    dec = outcome.procs["decode-tp0"].result or {}
    if args.verbose or not outcome.ok:
        print(outcome.outputs(tail=3000 if outcome.ok else 8000), file=sys.stderr)
    run = {
        "engine": engine, "block_bytes": block, "ok": outcome.ok, "seconds": round(time.monotonic() - t, 2),
        "rooms": bench.rooms, "rooms_done": len(dec.get("done", [])), "failed": {**pre.get("failed", {}),
                                                                               **dec.get("failed", {})},
        "kv_bytes": pre.get("kv_bytes", 0), "transfer_s": pre.get("transfer_s", 0.0),
        "span_s": pre.get("span_s", 0.0), "wave_s": pre.get("wave_s", []), "latency_s": pre.get("latency_s", []),
        "verified_bytes": dec.get("verified_bytes", 0), "expected_bytes": dec.get("expected_bytes"),
        "bad": dec.get("bad", []), "blocks_per_room": pre.get("blocks_per_room", []),
        "block_bytes_seen": pre.get("block_bytes"), "engine_module": pre.get("engine_module"),
        "engine_calls": pre.get("engine_calls"), "engine_blocks": pre.get("engine_blocks"),
        "engine_s": pre.get("engine_s"), "engine_kv_s": pre.get("engine_kv_s"),
        "send_kvcache_s": pre.get("send_kvcache_s"),
        "send_kvcache_calls": pre.get("send_kvcache_calls"),
        "prefill_cpu_s": pre.get("cpu_s"), "decode_cpu_s": dec.get("cpu_s"), "decode_wait_s": dec.get("wait_s"),
        "verify_s": dec.get("verify_s"), "prefill_gc_s": pre.get("gc_s"), "prefill_gc_runs": pre.get("gc_runs"),
        "prefill_gc_tracked": pre.get("gc_tracked"), "decode_gc_s": dec.get("gc_s"),
        "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
        "prefill_sched": pre.get("sched", {}), "decode_sched": dec.get("sched", {}),
        "prefill_sleep_late": pre.get("sleep_late", {}), "decode_sleep_late": dec.get("sleep_late", {}),
        "backends": [pre.get("backend"), dec.get("backend")],
    }
    if run["transfer_s"] > 0:
        run["gbps"] = run["kv_bytes"] / run["transfer_s"] / 1e9
        run["rps"] = len(run["latency_s"]) / run["transfer_s"]
    return run


def summarize(runs: List[dict]) -> dict:
    """Medians over the rounds of one (engine, block size); latency
    percentiles over all their rooms."""
    good = [r for r in runs if r["ok"] and r.get("transfer_s", 0) > 0]
    lat = [x for r in good for x in r["latency_s"]]
    s = {"runs": len(runs), "ok_runs": len(good), "rooms": sum(r["rooms"] for r in runs),
         "rooms_done": sum(r["rooms_done"] for r in runs),
         "verified_bytes": sum(r["verified_bytes"] for r in runs),
         "expected_bytes": sum(r["expected_bytes"] or 0 for r in runs)}
    if good:
        s.update(
            gbps=statistics.median(r["gbps"] for r in good),
            rps=statistics.median(r["rps"] for r in good),
            p50_ms=1e3 * _percentile(lat, 50),
            p99_ms=1e3 * _percentile(lat, 99),
            latency_samples=len(lat),
            blocks_per_room=statistics.median(b for r in good for b in r["blocks_per_room"]),
            engine_share=statistics.median([r["engine_kv_s"] / r["send_kvcache_s"] for r in good
                                            if r.get("send_kvcache_s")] or [0.0]),
            prefill_cpu_per_s=statistics.median(r["prefill_cpu_s"] / r["span_s"] for r in good if r["span_s"]),
            # Per room, on the prefill's transfer thread: all of send_kvcache,
            # the engine call inside it, and Python's garbage collections.
            send_ms_per_room=statistics.median(1e3 * r["send_kvcache_s"] / r["rooms"] for r in good),
            engine_ms_per_room=statistics.median(1e3 * r["engine_kv_s"] / r["rooms"] for r in good),
            gc_ms_per_room=statistics.median(1e3 * r["prefill_gc_s"] / r["rooms"] for r in good),
            sched=_sched_summary(good),
        )
    return s


def _sched_summary(good: List[dict]) -> dict:
    """Scheduler-thread time per side and call (µs; medians over rounds of
    each run's per-call mean/p50/p99 and per-room sum), and per room the
    prefill's send()+poll()+init() and the decode's calls altogether."""
    out: Dict[str, dict] = {}
    for side, calls in SCHED_CALLS.items():
        for call in calls:
            rs = [r[f"{side}_sched"][call] for r in good if call in r.get(f"{side}_sched", {})]
            if rs:
                out[f"{side}.{call}"] = {
                    k: statistics.median(x[k + "_ns"] for x in rs) / 1e3
                    for k in ("mean", "p50", "p99", "max", "per_room")} | {
                    "calls": statistics.median(x["calls"] for x in rs)}
        late = [r[f"{side}_sleep_late"] for r in good if r.get(f"{side}_sleep_late")]
        if late:
            out[f"{side}.sleep_late"] = {k: statistics.median(x[k + "_ns"] for x in late) / 1e3
                                         for k in ("mean", "p50", "p99", "max")}
            out[f"{side}.sleep_late"]["per_room"] = statistics.median(
                x["total_ns"] / r["rooms"] / 1e3 for x, r in zip(late, [r for r in good
                                                                       if r.get(f"{side}_sleep_late")]))
        per_room = [sum(x["total_ns"] for x in r.get(f"{side}_sched", {}).values()) / r["rooms"] / 1e3
                    for r in good if r.get(f"{side}_sched")]
        if per_room:
            out[f"{side}.all_per_room"] = statistics.median(per_room)
    return out


def _percentile(values, q: float) -> float:
    """Nearest rank (the maximum for q=99 below 100 samples)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def table(summary: Dict[str, Dict[str, dict]], engines: List[str]) -> str:
    head = ("| block | engine | rooms ok | GB/s | requests/s | p50 ms | p99 ms | verified | blocks/room "
            "| engine share | kvbridge/Mooncake GB/s |")
    lines = [head, "|" + " --- |" * 11]
    for block, per in summary.items():
        for e in engines:
            s = per[e]
            ratio = ""
            if e == "kvbridge" and "mooncake" in per and per["mooncake"].get("gbps") and s.get("gbps"):
                ratio = f"{s['gbps'] / per['mooncake']['gbps']:.1f}×"
            if "gbps" not in s:
                lines.append(f"| {_size(int(block))} | {e} | {s['rooms_done']}/{s['rooms']} | FAILED | | | | "
                             f"{s['verified_bytes']} / {s['expected_bytes']} B | | | |")
                continue
            lines.append(
                f"| {_size(int(block))} | {e} | {s['rooms_done']}/{s['rooms']} | {s['gbps']:.2f} | {s['rps']:.1f} "
                f"| {s['p50_ms']:.0f} | {s['p99_ms']:.0f} | {s['verified_bytes'] / 2**20:.0f} / "
                f"{s['expected_bytes'] / 2**20:.0f} MiB | {s['blocks_per_room']:.0f} | {s['engine_share']:.0%} "
                f"| {ratio} |")
    return "\n".join(lines)


def breakdown(summary: Dict[str, Dict[str, dict]], engines: List[str]) -> str:
    """Where a room's time on the prefill's transfer thread goes (medians)."""
    lines = ["| block | engine | send_kvcache ms/room | engine call ms/room | sglang Python ms/room "
             "| GC ms/room (prefill process) |", "|" + " --- |" * 6]
    for block, per in summary.items():
        for e in engines:
            s = per[e]
            if "send_ms_per_room" not in s:
                continue
            py = s["send_ms_per_room"] - s["engine_ms_per_room"]
            lines.append(f"| {_size(int(block))} | {e} | {s['send_ms_per_room']:.1f} | {s['engine_ms_per_room']:.1f} "
                         f"| {py:.1f} | {s['gc_ms_per_room']:.1f} |")
    return "\n".join(lines)


def sched_table(summary: Dict[str, Dict[str, dict]], columns: List[str]) -> str:
    """Scheduler-thread time (µs) per call and per room, with each column's
    rooms/s, GB/s and latency."""
    lines = ["| block | column | send() µs/call mean / p50 / p99 | send() µs/room | poll() µs/call mean / p50 / p99 "
             "| poll() µs/room | prefill calls µs/room | decode calls µs/room | prefill sleep overshoot µs/room "
             "(p99 per sleep) | requests/s | GB/s | p50 ms | p99 ms |", "|" + " --- |" * 13]
    for block, per in summary.items():
        for c in columns:
            s = per[c]
            if "sched" not in s:
                lines.append(f"| {_size(int(block))} | {c} | FAILED |" + " |" * 11)
                continue
            sc = s["sched"]
            cell = []
            for call in ("send", "poll"):
                x = sc.get(f"prefill.{call}")
                cell += ([f"{x['mean']:.1f} / {x['p50']:.1f} / {x['p99']:.1f}", f"{x['per_room']:.0f}"]
                         if x else ["", ""])
            lines.append(f"| {_size(int(block))} | {c} | {' | '.join(cell)} | {sc.get('prefill.all_per_room', 0):.0f} "
                         f"| {sc.get('decode.all_per_room', 0):.0f} | {_late(sc.get('prefill.sleep_late'))} "
                         f"| {s['rps']:.1f} | {s['gbps']:.2f} "
                         f"| {s['p50_ms']:.0f} | {s['p99_ms']:.0f} |")
    return "\n".join(lines)


def _late(x: Optional[dict]) -> str:
    return f"{x['per_room']:.0f} ({x['p99']:.0f})" if x else ""


def verdict(summary: Dict[str, Dict[str, dict]]) -> List[str]:
    """Issue 17's goal per block size: the backend's scheduler-thread time
    per room (prefill: send+poll+init; decode: create+init+send_metadata+poll)
    at most 1/10 of the connector's on both sides, and its p50 and p99 room
    latency no higher."""
    out = []
    for block, per in summary.items():
        con, bk = per.get("connector", {}), per.get("backend", {})
        if "sched" not in con or "sched" not in bk:
            out.append(f"{_size(int(block))}: no result for both columns")
            continue
        ratio = bk["sched"]["prefill.all_per_room"] / con["sched"]["prefill.all_per_room"]
        dec = bk["sched"].get("decode.all_per_room", 0) / max(con["sched"].get("decode.all_per_room", 0), 1e-9)
        lat = bk["p50_ms"] <= con["p50_ms"] and bk["p99_ms"] <= con["p99_ms"]
        met = ratio <= 0.1 and dec <= 0.1 and lat
        late_c, late_b = con["sched"].get("prefill.sleep_late"), bk["sched"].get("prefill.sleep_late")
        stall = ""
        if late_c and late_b:
            tot_c = con["sched"]["prefill.all_per_room"] + late_c["per_room"]
            tot_b = bk["sched"]["prefill.all_per_room"] + late_b["per_room"]
            stall = f", with sleep overshoot {tot_b / tot_c:.3f}"
        out.append(f"{_size(int(block))}: prefill scheduler time backend/connector {ratio:.3f} "
                   f"(decode {dec:.3f}{stall}), p50 {bk['p50_ms']:.0f} vs {con['p50_ms']:.0f} ms, "
                   f"p99 {bk['p99_ms']:.0f} vs {con['p99_ms']:.0f} ms: goal {'met' if met else 'NOT met'}")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="kvbridge,mooncake", help="comma-separated: kvbridge, mooncake")
    ap.add_argument("--backend", action="store_true",
                    help="compare columns 'connector' (sglang's Mooncake connector classes on kvbridge's engine) "
                         "and 'backend' (kvbridge's backend classes, KVBRIDGE_SGLANG=backend) instead of engines; "
                         "adds the scheduler-thread table")
    ap.add_argument("--block-sizes", default="4096,65536,1048576",
                    help="bytes of one page of one KV buffer (page_size x 2 KiB)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds; the engine order alternates per block size and round (A/B, B/A, ...)")
    ap.add_argument("--rooms", default=None,
                    help="rooms per run: one number, or BLOCK:N,... (default "
                         + ",".join(f"{k}:{v}" for k, v in DEFAULT_ROOMS.items()) + ")")
    ap.add_argument("--rooms-per-wave", type=int, default=2, help="rooms the decode asks for at a time")
    ap.add_argument("--room-tokens", type=int, default=1024, help="tokens per room (1024 = 128 MiB of KV)")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="tokens per sender.send (0: the whole room)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="model layers (32 for Llama-3-8B)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--poll-ms", type=float, default=1.0, help="sleep between polls of every open room")
    ap.add_argument("--freeze-gc", action="store_true",
                    help="both ranks call sglang's freeze_gc (as its /freeze_gc endpoint) before the first room")
    ap.add_argument("--mooncake-queue", type=int, default=65535,
                    help="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and ..._PENDING_ADMISSIONS_PER_PEER of the "
                         "Mooncake column (0: Mooncake's defaults, 1024 each)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per run")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every run and the summary as JSON "
                                                                "('-': stdout, the table then goes to stderr)")
    ap.add_argument("--verbose", action="store_true", help="print every process's output")
    args = ap.parse_args(argv)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} (kvbridge, mooncake)")
    if args.backend:
        engines = list(BACKEND_COLUMNS)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    rooms = dict(DEFAULT_ROOMS)
    if args.rooms:
        if ":" in args.rooms:
            rooms.update({int(k): int(v) for k, v in (x.split(":") for x in args.rooms.split(","))})
        else:
            rooms = {b: int(args.rooms) for b in blocks}
    out = sys.stderr if args.json == "-" else sys.stdout
    runs: List[dict] = []
    t0 = time.monotonic()
    for rnd in range(args.rounds):
        for k, block in enumerate(blocks):
            bench = harness.BenchSpec(rooms=rooms.get(block, 8), rooms_per_wave=args.rooms_per_wave,
                                      room_tokens=args.room_tokens, chunk_tokens=args.chunk_tokens,
                                      seed=args.seed + rnd, poll_s=args.poll_ms / 1e3, freeze_gc=args.freeze_gc)
            order = engines if (rnd + k) % 2 == 0 else engines[::-1]
            for e in order:
                run = run_one(e, block, bench, args)
                run["round"] = rnd
                runs.append(run)
                msg = (f"round {rnd} {_size(block):>7} {e:<9} " + (
                    f"{run['gbps']:6.2f} GB/s {run['rps']:6.1f} req/s" if run.get("gbps") else "FAILED")
                    + f"  ({run['rooms_done']}/{run['rooms']} rooms, {run['seconds']:.1f} s)")
                print(msg, file=out, flush=True)
    summary = {str(b): {e: summarize([r for r in runs if r["engine"] == e and r["block_bytes"] == b])
                        for e in engines} for b in blocks}
    print("\n" + table(summary, engines), file=out)
    if args.backend:
        print("\n" + sched_table(summary, engines), file=out)
        verdicts = verdict(summary)
        print("\n" + "\n".join(verdicts), file=out)
    else:
        print("\n" + breakdown(summary, engines), file=out)
    print(f"\n{len(runs)} runs in {time.monotonic() - t0:.0f} s", file=out)
    doc = {"args": vars(args), "summary": summary, "runs": runs}
    if args.backend:
        doc["goal"] = verdicts
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
