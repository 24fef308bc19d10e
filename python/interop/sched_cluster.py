"""Starts a PD cluster of ``sched_worker.py`` processes on 127.0.0.1 (a
bootstrap server, prefill ranks TP x PP, decode ranks TP) and collects
what each reported.

    python sched_cluster.py --prefill-backend kvbridge --decode-backend mooncake --decode-tp 2
    python sched_cluster.py --layout mla --prefill-tp 2 --scenario abort-decode

Exit status 0 when every rank that should survive reported success.
``KVB_INTEROP_VERBOSE=1`` prints every process's output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cluster import free_port, wait_port  # noqa: E402

WORKER = os.path.join(HERE, "sched_worker.py")


@dataclass
class Spec:
    """One run."""

    prefill_backend: str = "kvbridge"
    decode_backend: str = "kvbridge"
    #: Whose bootstrap server: "mooncake" (sglang's) or "kvbridge".
    bootstrap_backend: str = "kvbridge"
    layout: str = "mha"
    layers: int = 2
    prefill_tp: int = 1
    prefill_pp: int = 1
    #: Attention-DP groups / CP ranks within the prefill's TP ranks (sched_parallel).
    prefill_attn_dp: int = 1
    prefill_attn_cp: int = 1
    load_balance_method: str = "follow_bootstrap_room"
    decode_tp: int = 1
    rooms: int = 6
    tokens: int = 100
    scenario: str = "ok"
    timeout: float = 40.0
    env: Dict[str, str] = field(default_factory=dict)
    #: Extra arguments of every rank.
    args: List[str] = field(default_factory=list)


@dataclass
class Outcome:
    ok: bool
    results: Dict[str, dict]
    outputs: Dict[str, str]

    def report(self) -> str:
        lines = [f"{name}: {json.dumps(r)}" for name, r in self.results.items()]
        return "\n".join(lines + ["PASS" if self.ok else "FAIL"])


def _start(cmd: List[str], env: Dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE)


def run(spec: Spec) -> Outcome:
    env = dict(os.environ, **spec.env)
    python = sys.executable
    boot = free_port()
    common = ["--bootstrap-port", str(boot), "--layout", spec.layout, "--layers", str(spec.layers),
              "--rooms", str(spec.rooms), "--tokens", str(spec.tokens), "--scenario", spec.scenario,
              "--timeout", str(spec.timeout), *spec.args]
    procs: Dict[str, subprocess.Popen] = {}
    procs["bootstrap"] = _start([python, WORKER, "bootstrap", "--bootstrap-port", str(boot), "--backend",
                                 spec.bootstrap_backend], env)
    try:
        if not wait_port(boot, 60):
            raise RuntimeError("the bootstrap server did not come up")
        gloo = {"prefill": free_port(), "decode": free_port()}
        for pp in range(spec.prefill_pp):
            for tp in range(spec.prefill_tp):
                procs[f"prefill-tp{tp}-pp{pp}"] = _start(
                    [python, WORKER, "prefill", *common, "--backend", spec.prefill_backend,
                     "--tp", str(spec.prefill_tp), str(tp), "--pp", str(spec.prefill_pp), str(pp),
                     "--gloo-port", str(gloo["prefill"]), "--http-port", str(free_port()),
                     "--attn-dp", str(spec.prefill_attn_dp), "--attn-cp", str(spec.prefill_attn_cp),
                     "--load-balance-method", spec.load_balance_method], env)
        for tp in range(spec.decode_tp):
            procs[f"decode-tp{tp}"] = _start(
                [python, WORKER, "decode", *common, "--backend", spec.decode_backend,
                 "--tp", str(spec.decode_tp), str(tp), "--gloo-port", str(gloo["decode"]),
                 "--http-port", str(free_port())], env)
        outputs, results = {}, {}
        for name, p in procs.items():
            if name == "bootstrap":
                continue
            try:
                out, _ = p.communicate(timeout=spec.timeout + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs[name] = out
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    results[name] = json.loads(line[len("RESULT "):])
            results.setdefault(name, {"ok": False, "rc": p.returncode, "no_result": True})
            results[name]["rc"] = p.returncode
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    if os.environ.get("KVB_INTEROP_VERBOSE"):
        for name, out in outputs.items():
            print(f"===== {name}\n{out}")
    expect_dead = {n for n in results if n.startswith("decode")} if spec.scenario == "kill-decode" else set()
    ok = all(r.get("ok") for n, r in results.items() if n not in expect_dead)
    return Outcome(ok, results, outputs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in vars(Spec()).items():
        if isinstance(default, (dict, list)):
            continue
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    a = vars(p.parse_args(argv))
    outcome = run(Spec(**a))
    print(outcome.report())
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
