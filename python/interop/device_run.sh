#!/usr/bin/env bash
# The interop suite on the GPU machine, with KV in device memory (torch
# tensors): packed by gpu_pack.py next to this script; run by the GPU
# bundle's run.sh. Usage: bash device_run.sh [pytest args and test ids...]
#                        bash device_run.sh --backend      (kvbridge's sglang backend: its selection)
#                        bash device_run.sh --sched | --sched-staging   (sglang's scheduler)
#                        bash device_run.sh --cluster [cluster.py args...]
#                        bash device_run.sh --bench-rooms [bench_rooms.py args...]
# MOONCAKE_PROTOCOL picks the engine's transport (nvlink: CUDA IPC; set
# MC_FORCE_TCP=0 with it, the interop harness defaults to forcing TCP).
# Needs: python3 with torch (CUDA), numpy and transformers; KVBRIDGE_BIN.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
site="$here/site"

"$py" - <<'EOF'
import sys
missing = []
for m in ("torch", "numpy", "transformers"):
    try:
        __import__(m)
    except Exception as e:  # noqa: BLE001 - report any import failure
        missing.append(f"{m} ({type(e).__name__}: {e})")
if missing:
    sys.exit("device_run: this machine's Python lacks " + ", ".join(missing))
import torch
if not torch.cuda.is_available():
    sys.exit("device_run: torch sees no CUDA device")
print(f"device_run: Python {sys.version.split()[0]}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF

# Unpack the wheels the machine lacks, and sglang's sources, into one
# folder on PYTHONPATH (wheels are zip files; nothing is compiled).
rm -rf "$site" && mkdir -p "$site"
"$py" - "$here/wheels" "$site" "$here/sglang-src.zip" <<'EOF'
import glob, importlib.metadata as md, os, sys, zipfile
wheels, site, sglang = sys.argv[1:4]
unpacked = []
for w in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    dist = os.path.basename(w).split("-")[0]
    if dist != "kvbridge":
        try:
            md.version(dist)
            continue  # the machine has it: keep its own
        except md.PackageNotFoundError:
            pass
    zipfile.ZipFile(w).extractall(site)
    unpacked.append(dist)
zipfile.ZipFile(sglang).extractall(site)
print("device_run: unpacked", ", ".join(unpacked), "and sglang's sources")
EOF

export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export KVB_INTEROP_BUFFERS="${KVB_INTEROP_BUFFERS:-cuda:0}"
cd "$here/interop"
if [ "${1:-}" = "--cluster" ]; then  # one cluster by hand: cluster.py's arguments
  shift
  exec "$py" cluster.py --buffers "$KVB_INTEROP_BUFFERS" "$@"
fi
if [ "${1:-}" = "--bench-rooms" ]; then  # the room-level bench (its buffers: KVB_INTEROP_BUFFERS)
  shift
  exec "$py" bench_rooms.py "$@"
fi
s=tests/test_sched.py::test_real_scheduler
# pytest over sglang's own scheduler classes (tests/test_sched.py) on device
# pools: the case ids among the arguments, else those in `defaults`;
# options pass through (give them as --opt=value).
sched_pytest() {
  local a
  for a in "$@"; do
    case "$a" in -*) ;; *) "$py" -m pytest -q -p no:cacheprovider -rs "$@"; return ;; esac
  done
  "$py" -m pytest -q -p no:cacheprovider -rs "$@" "${defaults[@]}"
}
# About a minute a case there: three selections, each within one 10-minute
# device call.
case "${1:-}" in
  --sched)  # the TP pairings, MLA, and aborts by either side
    shift
    defaults=("$s[kvbridge-both-mha-tp1-tp1]" "$s[sglang-to-kvbridge-mha-tp1-tp2]"
      "$s[kvbridge-to-sglang-mha-tp2-tp1]" "$s[kvbridge-both-mla-tp1-tp2]" "$s[kvbridge-both-abort-prefill]"
      "$s[sglang-to-kvbridge-abort-decode]")
    sched_pytest "$@"; exit $? ;;
  --sched-hybrid)  # hybrid pools, DeepSeek-V4, prefill PP and attention DP
    shift
    defaults=("$s[kvbridge-both-swa-tp1-tp2]" "$s[kvbridge-to-sglang-swa-tp2-tp1]"
      "$s[kvbridge-to-sglang-mamba-tp1-tp2]" "$s[kvbridge-both-dsv4-tp1-tp2]" "$s[kvbridge-both-pp2-tp1]"
      "$s[kvbridge-both-attn-dp2]")
    sched_pytest "$@"; exit $? ;;
  --sched-staging)
    # One staging case on CUDA IPC (the decode keeps no ring; sglang's
    # handler gets an empty one), three with MC_FORCE_TCP=1 (the ring in
    # device memory, gathered and scattered on the GPU).
    shift
    rc=0
    defaults=("$s[kvbridge-both-staging-tp1-tp2]")
    sched_pytest "$@" || rc=$?
    defaults=("$s[kvbridge-both-staging-gqa-tp2-tp1]" "$s[sglang-to-kvbridge-staging-tp1-tp2]"
      "$s[kvbridge-to-sglang-staging-tp2-tp1]")
    (export MC_FORCE_TCP=1; sched_pytest "$@") || rc=$?
    exit "$rc" ;;
esac
# The cases below run kvbridge ranks (the binary) too.
: "${KVBRIDGE_BIN:?KVBRIDGE_BIN must name the kvbridge binary}"
if [ "${1:-}" = "--backend" ]; then
  # kvbridge's whole sglang backend (KVBRIDGE_SGLANG=backend): TP 2->1 and
  # 1->2 on both sides, a PP prefill, and mixed with sglang's connector (on
  # kvbridge's engine) both ways.
  shift
  b=tests/test_backend.py::test_backend
  set -- "$b[kvbridge-both-tp2-tp1]" "$b[kvbridge-both-tp1-tp2]" "$b[kvbridge-both-pp2-tp1]" \
    "$b[kvbridge-to-mooncake-tp2-tp1]" "$b[mooncake-to-kvbridge-tp1-tp2]" "$@"
fi
# Each case starts 3-5 processes that import torch and sglang (about 25 s a
# case there): by default a selection that covers TP 2->1 and 1->2, MLA, PP,
# both directions, aborts by either side and a killed decode.
if [ "$#" = 0 ]; then
  r=tests/test_rust_roles.py
  set -- "$r::test_sglang_and_kvbridge_roles[kvbridge-sglang-to-kvbridge-tp2-tp1]" \
    "$r::test_sglang_and_kvbridge_roles[kvbridge-sglang-to-kvbridge-mla-tp1-tp2]" \
    "$r::test_sglang_and_kvbridge_roles[kvbridge-kvbridge-to-sglang-tp1-tp2]" \
    "$r::test_sglang_and_kvbridge_roles[kvbridge-kvbridge-to-sglang-pp2-tp2]" \
    "$r::test_decode_killed_mid_transfer[kvbridge-sglang-to-kvbridge]" \
    "$r::test_kvbridge_decode_aborts_sglang_prefill[kvbridge]" \
    "$r::test_sglang_decode_aborts_kvbridge_prefill[kvbridge]"
fi
exec "$py" -m pytest -q -p no:cacheprovider -rs "$@"
