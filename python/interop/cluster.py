"""Starts a PD cluster on 127.0.0.1 as separate processes and reports what
each process saw: a bootstrap server, prefill ranks (TP × PP) and decode ranks
(TP × PP), each one either sglang's released connector driven by
``pd_worker.py`` or a kvbridge rank (``kvbridge bootstrap`` / ``kvbridge
prefill`` / ``kvbridge decode``, binary from ``$KVBRIDGE_BIN``, default
``target/debug/kvbridge`` in the repository).

    python cluster.py                                  # sglang TP1 -> TP1, Mooncake's TCP engine
    python cluster.py --prefill-tp 2 --decode-tp 1     # TP2 -> TP1
    python cluster.py --prefill-pp 2                   # prefill PP2 -> decode PP1
    python cluster.py --mla --decode-tp 2              # MLA, replicated latent
    python cluster.py --scenario abort                 # decode aborts the first room
    python cluster.py --engine-module kvbridge         # sglang on kvbridge.TransferEngine
    python cluster.py --bootstrap kvbridge             # sglang ranks, kvbridge's bootstrap server
    python cluster.py --prefill kvbridge --decode kvbridge --bootstrap sglang
    python cluster.py --prefill-backend kvbridge --decode-backend kvbridge   # sglang ranks on kvbridge's backend
    python cluster.py --prefill-backend kvbridge --engine-module kvbridge     # mixed: sglang's connector decodes

Exit status 0 when every process that should survive reported success.
``KVB_INTEROP_VERBOSE=1`` prints every process's output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "pd_worker.py")

SGLANG, KVBRIDGE = "sglang", "kvbridge"


def kvbridge_bin() -> str:
    """The kvbridge binary: ``$KVBRIDGE_BIN``, else ``target/debug/kvbridge``."""
    return os.environ.get("KVBRIDGE_BIN") or os.path.join(REPO, "target", "debug", "kvbridge")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


@dataclass
class Spec:
    """One cluster run."""

    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    #: Decode PP: 1, or the prefill's PP (the pairings sglang supports).
    decode_pp: int = 1
    #: Prefill attention-DP groups (TP 1 each; sglang-run prefills only).
    prefill_dp: int = 1
    #: Prefill attention-CP ranks (TP 1 each, each holding the whole KV).
    prefill_cp: int = 1
    #: How rooms reach the prefill DP groups (sglang's --load-balance-method).
    load_balance_method: str = "follow_bootstrap_room"
    model: harness.ModelSpec = field(default_factory=harness.ModelSpec)
    workload: harness.Workload = field(default_factory=harness.Workload)
    pages: int = 64
    aux_slots: int = 16
    scenario: str = "ok"
    #: Module whose TransferEngine the sglang ranks use (None: Mooncake's).
    engine_module: Optional[str] = None
    #: Who runs each part: "sglang" or "kvbridge".
    bootstrap: str = SGLANG
    prefill: str = SGLANG
    decode: str = SGLANG
    #: Which backend classes the sglang-run parts drive (pd_worker --backend):
    #: "mooncake" (sglang's own connector, on ``engine_module``) or
    #: "kvbridge" (kvbridge's backend, KVBRIDGE_SGLANG=backend; always on
    #: kvbridge's engine).
    prefill_backend: str = "mooncake"
    decode_backend: str = "mooncake"
    bootstrap_backend: str = "mooncake"
    #: Buffers of sglang ranks: "cpu" or "cuda[:N]".
    buffers: str = field(default_factory=lambda: os.environ.get("KVB_INTEROP_BUFFERS", "cpu"))
    #: Whether every rank (sglang and kvbridge) publishes its KV buffers'
    #: layer ids, as sglang's hybrid pools do; off: none, as stock sglang
    #: publishes for plain MHA/MLA pools (README.md, "Layer ids").
    layer_ids: bool = False
    timeout: float = 60.0
    #: Extra arguments of every sglang rank (pd_worker.py), e.g. ``--bench``.
    worker_args: List[str] = field(default_factory=list)
    #: Extra environment of every process of the run.
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class Proc:
    """One started process and, once it ended, what it reported."""

    name: str
    kind: str  # "bootstrap", "prefill", "decode"
    impl: str
    popen: subprocess.Popen
    output: str = ""
    returncode: Optional[int] = None
    result: Optional[dict] = None


@dataclass
class Outcome:
    """What a run produced."""

    ok: bool
    procs: Dict[str, Proc]
    seconds: float

    def report(self) -> str:
        lines = [f"{n}: rc={p.returncode} {json.dumps(p.result)}"
                 for n, p in self.procs.items() if p.kind != "bootstrap"]
        return "\n".join(lines + [f"{'PASS' if self.ok else 'FAIL'} in {self.seconds:.2f}s"])

    def outputs(self, tail: int = 6000) -> str:
        return "\n".join(f"===== {n} =====\n{p.output[-tail:]}" for n, p in self.procs.items())


def _rank_file(spec: Spec, rank: harness.RankSpec, boot: str, scratch: str, name: str) -> str:
    """A kvbridge rank configuration equivalent to the sglang ranks'."""
    cfg = {
        "model": spec.model.to_json(),
        "rank": {"tp_size": rank.tp_size, "tp_rank": rank.tp_rank, "pp_size": rank.pp_size, "pp_rank": rank.pp_rank},
        "pages": spec.pages,
        "aux_slots": spec.aux_slots,
        "engine_kind": "tcp",
        "engine": {"listen_host": "127.0.0.1"},
        "prefill": {"local_ip": "127.0.0.1", "bootstrap_addr": boot},
        "decode": {"local_ip": "127.0.0.1"},
        "bootstrap_addr": boot,
        "placement": {"device": _device_index(spec.buffers), "host_kv_buffers": 0},
        "workload": dict(spec.workload.to_json(), forward_s=_send_delay(spec)),
        "publish_layer_ids": spec.layer_ids,
    }
    path = os.path.join(scratch, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _device_index(buffers: str) -> Optional[int]:
    """The GPU of ``"cuda[:N]"`` (None for ``"cpu"``): where kvbridge ranks
    place their KV pools, beside the sglang ranks' torch tensors."""
    if buffers == "cpu":
        return None
    if not buffers.startswith("cuda"):
        raise ValueError(f"buffers must be cpu or cuda[:N], not {buffers!r}")
    return int(buffers.partition(":")[2] or 0)


def _send_delay(spec: Spec) -> float:
    """The prefill ranks' simulated forward pass: long enough, when a decode
    is to die after sending its metadata, that it is dead before any KV."""
    return 1.5 if spec.scenario == "kill-decode" else spec.workload.forward_s


def _event(line: str) -> dict:
    """One JSON event line of a kvbridge rank ({} when it is not one)."""
    try:
        ev = json.loads(line)
    except json.JSONDecodeError:
        return {}
    return ev if isinstance(ev, dict) else {}


def _kill_after_started(p: "Proc", rooms: int) -> threading.Thread:
    """Reads a kvbridge decode rank's events as they come and SIGKILLs it
    0.5 s after it has sent the destinations of ``rooms`` rooms (``started``
    events): a decode that dies between its metadata and the KV."""
    lines: List[str] = []

    def pump() -> None:
        started = 0
        for line in p.popen.stdout:
            lines.append(line)
            if line.startswith("{") and _event(line).get("event") == "started":
                started += 1
                if started == rooms:
                    # zmq sends asynchronously: give the last destination
                    # time to leave (the prefill's forward pass is 1.5 s).
                    threading.Timer(0.5, p.popen.kill).start()
        p.popen.wait()
        p.output = "".join(lines)

    t = threading.Thread(target=pump, name=f"kill-{p.name}", daemon=True)
    t.start()
    return t


def _kvbridge_result(kind: str, output: str, returncode: int, spec: Spec) -> dict:
    """Sums a kvbridge rank's JSON events (docs/cli.md, rank events) into the
    RESULT shape pd_worker prints."""
    done, failed, verified, mismatched, finished = [], {}, 0, 0, False
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") == "done":
            if ev["success"]:
                done.append(ev["room"])
            else:
                failed[str(ev["room"])] = ev.get("reason")
            verified += ev.get("verified", 0)
            mismatched += ev.get("mismatched", 0)
        elif ev.get("event") == "finished":
            finished = True
    rooms = {r.room for r in spec.workload.plan()}
    # Rooms that must fail, and rooms that may (an abort racing the transfer).
    must_fail, may_fail = set(), set()
    if kind == "decode":
        must_fail = spec.workload.aborted_rooms()
    elif spec.decode == KVBRIDGE:
        may_fail = spec.workload.aborted_rooms()
    elif spec.scenario == "abort":
        must_fail = {spec.workload.plan()[0].room}
    elif spec.scenario == "kill-decode":
        must_fail = rooms
    failed_rooms = {int(r) for r in failed}
    ok = (returncode == 0 and finished and mismatched == 0 and set(done) | failed_rooms == rooms
          and must_fail <= failed_rooms <= must_fail | may_fail)
    if kind == "decode" and rooms - must_fail:
        ok = ok and verified > 0
    return {"ok": ok, "done": sorted(done), "failed": failed, "verified_bytes": verified, "mismatched": mismatched}


def _backend_args(spec: Spec, backend: str) -> List[str]:
    """pd_worker's ``--backend`` and ``--engine-module`` for a part."""
    if backend == KVBRIDGE:
        return ["--backend", KVBRIDGE, "--engine-module", "kvbridge"]
    return ["--engine-module", spec.engine_module] if spec.engine_module else []


def run(spec: Spec) -> Outcome:
    """Starts the cluster, waits for every rank to finish (or the deadline),
    stops the bootstrap server and reports. No process it started outlives
    it, whatever happens (its scratch directory neither)."""
    procs: Dict[str, Proc] = {}
    scratch = tempfile.mkdtemp(prefix="kvb-interop-")
    try:
        return _run(spec, procs, scratch)
    finally:
        for p in procs.values():
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.communicate()
        shutil.rmtree(scratch, ignore_errors=True)


def _run(spec: Spec, procs: Dict[str, Proc], scratch: str) -> Outcome:
    t0 = time.monotonic()
    bport = free_port()
    boot = f"127.0.0.1:{bport}"
    env = dict(os.environ, KVB_RDV_DIR=scratch, **spec.env)  # KVB_RDV_DIR: FileGroup rendezvous (PP)
    if spec.scenario == "kill-prefill":
        env.setdefault("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "5")

    def start(name: str, kind: str, impl: str, argv: List[str]) -> None:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE)
        procs[name] = Proc(name, kind, impl, popen)

    py = sys.executable
    common = ["--bootstrap-port", str(bport), "--workload", json.dumps(spec.workload.to_json()),
              "--pages", str(spec.pages), "--aux-slots", str(spec.aux_slots), "--scenario", spec.scenario,
              "--timeout", str(spec.timeout), "--buffers", spec.buffers,
              "--model", json.dumps(spec.model.to_json())]
    if spec.layer_ids:
        common += ["--publish-layer-ids"]
    if spec.bootstrap == KVBRIDGE:
        start("bootstrap", "bootstrap", KVBRIDGE,
              [kvbridge_bin(), "bootstrap", "--host", "127.0.0.1", "--port", str(bport)])
    else:
        start("bootstrap", "bootstrap", SGLANG, [py, WORKER, "bootstrap", "--bootstrap-port", str(bport)]
              + _backend_args(spec, spec.bootstrap_backend))
    up = wait_port(bport, 30)
    parts = (("prefill", spec.prefill_tp, spec.prefill_pp, spec.prefill_dp, spec.prefill_cp, spec.prefill),
             ("decode", spec.decode_tp, spec.decode_pp, 1, 1, spec.decode))
    for kind, tp_size, pp_size, dp_size, cp_size, impl in parts:
        ranks = itertools.product(range(dp_size), range(cp_size), range(pp_size), range(tp_size))
        for dp_rank, cp_rank, pp_rank, tp_rank in ranks:
            rank = harness.RankSpec(tp_size, tp_rank, pp_size, pp_rank)
            name = (f"{kind}-tp{tp_rank}" + (f"-pp{pp_rank}" if pp_size > 1 else "")
                    + (f"-dp{dp_rank}" if dp_size > 1 else "") + (f"-cp{cp_rank}" if cp_size > 1 else ""))
            dp_args = ["--dp", str(dp_size), str(dp_rank)] if dp_size > 1 else []
            dp_args += ["--cp", str(cp_size), str(cp_rank)] if cp_size > 1 else []
            dp_args += ["--load-balance-method", spec.load_balance_method]
            if impl == KVBRIDGE:
                cfg = _rank_file(spec, rank, boot, scratch, name)
                start(name, kind, impl, [kvbridge_bin(), kind, "--config", cfg])
            else:
                backend = spec.prefill_backend if kind == "prefill" else spec.decode_backend
                start(name, kind, impl, [py, WORKER, kind, "--http-port", str(free_port()),
                                         "--tp", str(tp_size), str(tp_rank),
                                         "--pp", str(pp_size), str(pp_rank),
                                         "--send-delay", str(_send_delay(spec))]
                      + dp_args + common + _backend_args(spec, backend) + spec.worker_args)
    killers = {}
    if spec.scenario == "kill-decode" and spec.decode == KVBRIDGE:
        per_rank = min(spec.workload.requests, spec.workload.concurrency)
        killers = {n: _kill_after_started(p, per_rank) for n, p in procs.items() if p.kind == "decode"}
    deadline = time.monotonic() + spec.timeout + 30
    for p in procs.values():
        if p.kind == "bootstrap":
            continue
        if p.name in killers:
            killers[p.name].join(timeout=max(deadline - time.monotonic(), 1))
            if killers[p.name].is_alive():
                p.popen.kill()
                killers[p.name].join()
            p.returncode = p.popen.returncode
            p.result = _kvbridge_result(p.kind, p.output, p.returncode, spec)
            continue
        try:
            p.output, _ = p.popen.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.output, _ = p.popen.communicate()
        p.returncode = p.popen.returncode
        if p.impl == KVBRIDGE:
            p.result = _kvbridge_result(p.kind, p.output, p.returncode, spec)
        else:
            for line in p.output.splitlines():
                if line.startswith("RESULT "):
                    p.result = json.loads(line[len("RESULT "):])
    b = procs["bootstrap"]
    b.popen.terminate()
    try:
        b.output, _ = b.popen.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        b.popen.kill()
        b.output, _ = b.popen.communicate()
    b.returncode = b.popen.returncode
    dead = {"kill-decode": "decode", "kill-prefill": "prefill"}.get(spec.scenario)
    must = [p for p in procs.values() if p.kind not in ("bootstrap", dead)]
    ok = up and all(p.returncode == 0 and (p.result or {}).get("ok") for p in must)
    return Outcome(ok, procs, time.monotonic() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--prefill-pp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--decode-pp", type=int, default=1, help="1 or the prefill's PP")
    ap.add_argument("--mla", action="store_true", help="a small MLA model instead of the small MHA one")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--scenario", default="ok",
                    choices=["ok", "abort", "abort-prefill", "abort-bootstrap", "abort-last-stage", "kill-decode",
                             "kill-prefill"],
                    help="what the sglang ranks do (pd_worker.SCENARIOS)")
    ap.add_argument("--abort-fraction", type=float, default=0.0,
                    help="kvbridge decode ranks abort this fraction of the requests")
    ap.add_argument("--engine-module", default=None, help="TransferEngine of the sglang ranks (default: Mooncake's)")
    ap.add_argument("--bootstrap", choices=[SGLANG, KVBRIDGE], default=SGLANG)
    ap.add_argument("--prefill", choices=[SGLANG, KVBRIDGE], default=SGLANG)
    ap.add_argument("--decode", choices=[SGLANG, KVBRIDGE], default=SGLANG)
    ap.add_argument("--prefill-backend", choices=["mooncake", KVBRIDGE], default="mooncake",
                    help="classes the sglang prefill ranks drive: sglang's Mooncake connector or kvbridge's backend")
    ap.add_argument("--decode-backend", choices=["mooncake", KVBRIDGE], default="mooncake",
                    help="classes the sglang decode ranks drive")
    ap.add_argument("--bootstrap-backend", choices=["mooncake", KVBRIDGE], default="mooncake",
                    help="bootstrap server class of an sglang-run bootstrap process")
    ap.add_argument("--buffers", default="cpu", help="sglang ranks' KV buffers: cpu or cuda[:N]")
    ap.add_argument("--layer-ids", action="store_true",
                    help="every rank publishes its KV layer ids (as sglang's hybrid pools); default: none")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    spec = Spec(prefill_tp=args.prefill_tp, prefill_pp=args.prefill_pp, decode_tp=args.decode_tp,
                decode_pp=args.decode_pp,
                model=harness.ModelSpec.tiny_mla() if args.mla else harness.ModelSpec(),
                workload=harness.Workload(requests=args.requests, abort_fraction=args.abort_fraction),
                scenario=args.scenario,
                engine_module=args.engine_module, bootstrap=args.bootstrap, prefill=args.prefill,
                decode=args.decode, buffers=args.buffers, layer_ids=args.layer_ids,
                prefill_backend=args.prefill_backend, decode_backend=args.decode_backend,
                bootstrap_backend=args.bootstrap_backend,
                timeout=args.timeout)
    outcome = run(spec)
    if not outcome.ok or os.environ.get("KVB_INTEROP_VERBOSE"):
        print(outcome.outputs())
    print(outcome.report())
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
