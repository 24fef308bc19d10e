#!/usr/bin/env bash
# The GPU test matrix of kvbridge (bundled by `cargo xtask gpu-test`).
# Usage: bash run.sh [--bench]   (logs go to $LOGS, default ./logs;
#        ONLY=regex runs only the steps whose names match)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
logs="${LOGS:-$here/logs}"
mkdir -p "$logs"
bench=0
[ "${1:-}" = "--bench" ] && bench=1
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIP: no GPU or CUDA driver on this machine: the GPU test matrix was not run"
  exit 0
fi
nvidia-smi -L
pass=0; fail=0; summary=()
step() { # name, command...   (ONLY=regex runs just the matching steps)
  local name="$1"; shift
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then return 0; fi
  local t0=$SECONDS
  if timeout "${STEP_TIMEOUT:-240}" "$@" >"$logs/$name.log" 2>&1; then
    pass=$((pass+1)); summary+=("PASS $name ($((SECONDS-t0)) s)")
  else
    fail=$((fail+1)); summary+=("FAIL $name ($((SECONDS-t0)) s): see $logs/$name.log")
    tail -n 25 "$logs/$name.log"
  fi
  echo "${summary[-1]}"
}
kv="$here/kvbridge"
demo=("$kv" demo --device --requests 24 --prompt-tokens 512 --chunk-tokens 128 --timeout-s 180 --json)
step probe-and-device-io "$here/gpu-test-mem" --test-threads=1 --nocapture
step ipc-tcp-kernel "$here/gpu-test-engine" --test-threads=1 --nocapture
step demo-ipc-tp1-1 "${demo[@]}" --engine ipc
step demo-ipc-tp2-1 "${demo[@]}" --engine ipc --prefill-tp 2 --decode-tp 1
step demo-ipc-tp1-2 "${demo[@]}" --engine ipc --prefill-tp 1 --decode-tp 2
step demo-ipc-tp4-2 "${demo[@]}" --engine ipc --prefill-tp 4 --decode-tp 2
step demo-ipc-tp2-4 "${demo[@]}" --engine ipc --prefill-tp 2 --decode-tp 4
step demo-ipc-mla "${demo[@]}" --engine ipc --model deepseek-v3 --layers 16 --prefill-tp 2 --decode-tp 2
step demo-ipc-pp2 "${demo[@]}" --engine ipc --prefill-pp 2 --layers 16
step demo-ipc-host-blocks "${demo[@]}" --engine ipc --host-kv-buffers 4 --prefill-tp 2 --decode-tp 1
step demo-tcp-device "${demo[@]}" --engine tcp --prefill-tp 2 --decode-tp 1
step demo-tcp-nvlink-intra-host-blocks "${demo[@]}" --engine tcp --nvlink-intra --host-kv-buffers 4
step demo-ipc-abort "${demo[@]}" --engine ipc --abort-fraction 0.3
# The staging path with KV in device memory: gather and scatter on the GPU
# (the IPC engine's batched kernel), the bulk writes over TCP.
step demo-tcp-device-staged-tp2-4 "${demo[@]}" --engine tcp --prefill-tp 2 --decode-tp 4 --staging
step demo-tcp-device-staged-tp4-2 "${demo[@]}" --engine tcp --prefill-tp 4 --decode-tp 2 --staging
step demo-tcp-device-staged-tp8-2 "${demo[@]}" --engine tcp --prefill-tp 8 --decode-tp 2 --staging
step demo-tcp-device-staged-abort "${demo[@]}" --engine tcp --prefill-tp 2 --decode-tp 4 --staging --abort-fraction 0.3
# Every model layout with KV and state buffers in device memory: mamba
# slots (TP-sliced), SWA windows, DSA pages, draft layers, decode context
# parallelism; over the IPC engine (device to device) and TCP.
step demo-ipc-qwen3-next-tp2-1 "${demo[@]}" --engine ipc --model qwen3-next --layers 16 --prefill-tp 2 --decode-tp 1
step demo-ipc-qwen3-next-pp2-tp1-2 "${demo[@]}" --engine ipc --model qwen3-next --layers 16 --prefill-pp 2 --decode-tp 2
step demo-ipc-gpt-oss-tp2-2 "${demo[@]}" --engine ipc --model gpt-oss --layers 8 --prefill-tp 2 --decode-tp 2
step demo-ipc-deepseek-v32-tp2-1-draft "${demo[@]}" --engine ipc --model deepseek-v32 --layers 8 --prefill-tp 2 --decode-tp 1 --draft-layers 1
step demo-ipc-dcp2-draft "${demo[@]}" --engine ipc --model deepseek-v3 --layers 8 --decode-tp 2 --decode-cp 2 --draft-layers 1
step demo-ipc-draft-mha-tp2-4 "${demo[@]}" --engine ipc --layers 8 --prefill-tp 2 --decode-tp 4 --draft-layers 2
step demo-tcp-device-qwen3-next-tp2-4 "${demo[@]}" --engine tcp --model qwen3-next --layers 16 --prefill-tp 2 --decode-tp 4
step demo-tcp-device-dcp4-draft "${demo[@]}" --engine tcp --model deepseek-v3 --layers 8 --decode-tp 4 --decode-cp 4 --draft-layers 1
step demo-ipc-prefill-cp2-all-ranks "${demo[@]}" --engine ipc --prefill-cp 2 --all-cp-ranks --prefill-tp 2 --decode-tp 1
step demo-ipc-dp2-round-robin "${demo[@]}" --engine ipc --dp 2 --dp-round-robin --prefill-tp 2 --decode-tp 1
step demo-ipc-deepseek-v4-pp2 "${demo[@]}" --engine ipc --model deepseek-v4 --layers 16 --prefill-pp 2 --prefill-tp 2
step demo-tcp-device-deepseek-v4-hisparse "${demo[@]}" --engine tcp --model deepseek-v4 --layers 16 --prefill-pp 2 --hisparse
step demo-ipc-qwen3-next-abort "${demo[@]}" --engine ipc --model qwen3-next --layers 16 --prefill-tp 2 --decode-tp 1 --abort-fraction 0.3
if [ "$bench" = 1 ]; then
  # Rooms through the roles against the raw engine, KV in device memory:
  # CUDA IPC (MHA, MLA, TP 1->2) and TCP (MHA); one JSON line per room size.
  for l in mha mla hetero; do
    step "bench-roles-ipc-$l" "$kv" bench roles --engine ipc --device 0 --layout "$l" \
      --sizes 1M,16M,64M,256M,1G --rooms 8 --json
    cat "$logs/bench-roles-ipc-$l.log"
  done
  step bench-roles-tcp-device "$kv" bench roles --engine tcp --device 0 --sizes 64M,256M --rooms 6 --json
  cat "$logs/bench-roles-tcp-device.log"
  # Heterogeneous TP against homogeneous, per-slice against staged, KV in
  # device memory: TCP engine, then CUDA IPC (which copies head slices on
  # the GPU without staging). Two alternated rounds; one JSON line a run.
  for round in 1 2; do
    for eng in tcp ipc; do
      for t in "2 2" "2 4" "4 2" "8 2" "8 8"; do
        read -r p d <<< "$t"
        for st in "" "--staging"; do
          [ "$eng" = ipc ] && [ -n "$st" ] && continue
          [ "$p" = "$d" ] && [ -n "$st" ] && continue
          out=$(timeout 300 "${demo[@]}" --engine "$eng" --prefill-tp "$p" --decode-tp "$d" $st 2>/dev/null | tail -n 1)
          echo "staging-bench round=$round engine=$eng tp=$p-$d staging=${st:+on} $out"
        done
      done
    done
  done | tee "$logs/bench-staging-device.log"
fi
# sglang 0.5.23's connector (its own code, unpacked from the wheel) on
# kvbridge's engine and against kvbridge's ranks, KV in torch device tensors.
if [ -f "$here/interop/device_run.sh" ]; then
  export KVBRIDGE_BIN="$kv"
  STEP_TIMEOUT=480 step interop-sglang-device-tensors bash "$here/interop/device_run.sh"
  grep -E "passed|failed|skipped" "$logs/interop-sglang-device-tensors.log" 2>/dev/null | tail -n 1 || true
  # kvbridge as sglang's transfer backend, KV in device tensors, over CUDA IPC.
  # sglang's connector needs its aux rows (host memory) over its control socket.
  ipc=(env MOONCAKE_PROTOCOL=nvlink MC_FORCE_TCP=0 SGLANG_MOONCAKE_SEND_AUX_TCP=1)
  STEP_TIMEOUT=420 step interop-backend-ipc-device-tensors "${ipc[@]}" bash "$here/interop/device_run.sh" --backend
  grep -E "passed|failed|skipped" "$logs/interop-backend-ipc-device-tensors.log" 2>/dev/null | tail -n 1 || true
  # The same backend under sglang's own scheduler classes (tests/test_sched.py):
  # device KV over CUDA IPC, staging included (it needs CUDA pools).
  STEP_TIMEOUT=540 step interop-sched-ipc-device-tensors "${ipc[@]}" bash "$here/interop/device_run.sh" --sched
  grep -E "passed|failed|skipped" "$logs/interop-sched-ipc-device-tensors.log" 2>/dev/null | tail -n 1 || true
  if [ "$bench" = 1 ]; then
    STEP_TIMEOUT=540 step bench-rooms-backend-ipc "${ipc[@]}" bash "$here/interop/device_run.sh" --bench-rooms \
      --backend --rounds 1
    tail -n 40 "$logs/bench-rooms-backend-ipc.log" 2>/dev/null || true
  fi
else
  summary+=("NOT RUN interop-sglang-device-tensors: $(cat "$here/interop-missing.txt" 2>/dev/null || echo 'not bundled')")
  fail=$((fail+1)); echo "${summary[-1]}"
fi
if [ "$bench" = 1 ]; then
  # One batch of 1 GiB at a time, then as a prefill worker submits:
  # 256 MiB batches, 4 in flight, 4 GiB per run.
  step bench-ipc "$kv" bench ipc --runs 3
  cat "$logs/bench-ipc.log"
  step bench-ipc-inflight "$kv" bench ipc --runs 3 --inflight 4 --batch-bytes 268435456 --passes 4 --run-copies 64
  cat "$logs/bench-ipc-inflight.log"
  step bench-ipc-inflight-2streams "$kv" bench ipc --runs 3 --inflight 4 --batch-bytes 268435456 --passes 4 --kernel-streams 2 --sizes 4096,65536,1048576,16777216
  cat "$logs/bench-ipc-inflight-2streams.log"
fi
echo "---- kvbridge GPU test matrix ----"
printf '%s\n' "${summary[@]}"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
