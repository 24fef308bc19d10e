"""Mooncake's API from Python, kvbridge vs Mooncake: throughput and call overhead.

Two engines of one kind (kvbridge's ``kvbridge.TransferEngine`` or Mooncake's
``mooncake.engine.TransferEngine``, ``pip install
mooncake-transfer-engine-non-cuda``) in two processes on 127.0.0.1, over TCP
(``protocol="tcp"``, ``MC_FORCE_TCP=1``), called exactly as sglang's Mooncake
connector calls them: ``batch_transfer_sync_write(session, srcs, dsts,
lens)`` with Python lists of ints.

Two measurements, each alternating the engines round by round:

* ``throughput``: ``--bytes`` moved in blocks of each ``--sizes``, in calls of
  at most ``--batch`` blocks; GB/s of the best of ``--runs`` runs per round.
* ``overhead``: microseconds per call with 1, 1 000 and 100 000 blocks of
  64 bytes (what a call costs beyond moving bytes: list conversion,
  checks, the round trip).

Prints one JSON object per (measurement, engine, size) on stdout, then a
table of medians. Not a test: numbers vary by machine.

    python engines.py --engines kvbridge,mooncake --rounds 3
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

HOST = "127.0.0.1"


def make_engine(kind):
    """An initialized engine of `kind` ('kvbridge' or 'mooncake')."""
    if kind == "kvbridge":
        import kvbridge

        engine = kvbridge.TransferEngine()
    elif kind == "mooncake":
        os.environ["MC_FORCE_TCP"] = "1"
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
    else:
        raise SystemExit(f"unknown engine {kind!r}")
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"{kind}: initialize returned {rc}")
    return engine


def target(kind, nbytes, conn):
    """The receiving process: registers a buffer, reports it, waits for QUIT."""
    engine = make_engine(kind)
    buf = np.zeros(nbytes, dtype=np.uint8)
    rc = engine.batch_register_memory([buf.ctypes.data], [nbytes])
    if rc != 0:
        conn.send(("error", f"register returned {rc}"))
        return
    conn.send(("ready", f"{HOST}:{engine.get_rpc_port()}", buf.ctypes.data))
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        if msg[0] == "check":
            _, offset, expected = msg
            got = bytes(buf[offset : offset + len(expected)])
            conn.send(got == expected)
    engine.batch_unregister_memory([buf.ctypes.data])


class Pair:
    """An initiator engine here and a target engine in a child process."""

    def __init__(self, kind, nbytes):
        self.kind = kind
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(kind, nbytes, child), daemon=True)
        self.proc.start()
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise SystemExit(f"{kind} target: {msg[1]}")
        _, self.session, self.dst = msg
        self.engine = make_engine(kind)
        self.src = (np.arange(nbytes, dtype=np.uint64) * 0x9E3779B97F4A7C15 >> 56).astype(np.uint8)
        rc = self.engine.batch_register_memory([self.src.ctypes.data], [nbytes])
        if rc != 0:
            raise SystemExit(f"{kind}: register returned {rc}")

    def write(self, srcs, dsts, lens, fatal=True):
        """One call; a non-zero return ends the bench unless not `fatal`."""
        rc = self.engine.batch_transfer_sync_write(self.session, srcs, dsts, lens)
        if rc != 0 and fatal:
            raise SystemExit(f"{self.kind}: batch_transfer_sync_write returned {rc}")
        return rc

    def verify(self, offset, length):
        """Whether the target holds our bytes at `offset` (a sample)."""
        length = min(length, 1 << 20)
        self.conn.send(("check", offset, bytes(self.src[offset : offset + length])))
        return self.conn.recv()

    def close(self):
        self.engine.batch_unregister_memory([self.src.ctypes.data])
        self.conn.send(("quit",))
        self.proc.join(10)


def throughput(pair, size, nbytes, batch, runs):
    """GB/s of the best of `runs` runs moving `nbytes` in `size`-byte blocks."""
    n = nbytes // size
    offs = [i * size for i in range(n)]
    srcs = [pair.src.ctypes.data + o for o in offs]
    dsts = [pair.dst + o for o in offs]
    lens = [size] * n
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        for i in range(0, n, batch):
            pair.write(srcs[i : i + batch], dsts[i : i + batch], lens[i : i + batch])
        best = min(best, time.perf_counter() - t)
    if not pair.verify(0, n * size) or not pair.verify((n - 1) * size, size):
        raise SystemExit(f"{pair.kind}: bytes differ at the target")
    return n * size / best / 1e9


def overhead(pair, blocks, calls):
    """Median microseconds per call of `blocks` 64-byte blocks; NaN when
    the engine refuses such a call (returns non-zero)."""
    srcs = [pair.src.ctypes.data + 64 * i for i in range(blocks)]
    dsts = [pair.dst + 64 * i for i in range(blocks)]
    lens = [64] * blocks
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        rc = pair.write(srcs, dsts, lens, fatal=False)
        times.append(time.perf_counter() - t)
        if rc != 0:
            print(f"{pair.kind}: a call of {blocks} blocks returned {rc}", file=sys.stderr)
            return float("nan")
    return statistics.median(times) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="kvbridge,mooncake")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bytes", type=int, default=256 << 20)
    p.add_argument("--sizes", default="4096,65536,1048576")
    p.add_argument("--batch", type=int, default=1024, help="most blocks per call")
    args = p.parse_args(argv)
    kinds = args.engines.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    nbytes = max(args.bytes, 64 * 100_000)
    results = {}
    pairs = {k: Pair(k, nbytes) for k in kinds}
    try:
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for kind in order:
                pair = pairs[kind]
                for size in sizes:
                    gbps = throughput(pair, size, args.bytes, args.batch, args.runs)
                    results.setdefault(("throughput GB/s", kind, size), []).append(gbps)
                    print(json.dumps({"measure": "throughput", "engine": kind, "block_size": size, "gbps": gbps}))
                # 100 000 blocks only in the last round: Mooncake's TCP
                # engine refuses such a call and is not usable after it.
                sets = ((1, 2000), (1000, 200)) + (((100_000, 5),) if r == args.rounds - 1 else ())
                for blocks, calls in sets:
                    us = overhead(pair, blocks, calls)
                    results.setdefault(("call µs", kind, blocks), []).append(us)
                    print(json.dumps({"measure": "overhead", "engine": kind, "blocks": blocks, "us_per_call": us}))
                sys.stdout.flush()
    finally:
        for pair in pairs.values():
            pair.close()
    print(f"\n{'measure':<18}{'size/blocks':>12}" + "".join(f"{k:>14}" for k in kinds))
    keys = sorted({(m, s) for (m, _, s) in results}, key=lambda x: (x[0], x[1]))
    for m, s in keys:
        row = "".join(f"{statistics.median(results[(m, k, s)]):>14.2f}" for k in kinds)
        print(f"{m:<18}{s:>12}{row}")


if __name__ == "__main__":
    main()
