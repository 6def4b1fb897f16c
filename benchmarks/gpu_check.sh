#!/usr/bin/env bash
# The executor's GPU path in one step, on any machine with CUDA (about 3 minutes on one GPU; the
# multi-GPU steps add a few more; every step runs under its own timeout).
#
#   benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT, else benchmarks/results/gpu_check/
#
# Runs, writing one JSON per step to OUT_DIR and a summary.json:
#   1. gpu_device_check.py: on-device checksum (same value on host and GPU, catches a flipped
#      bit), the reference transformer on cuda:0 with no tensor off the GPU, logits vs host;
#   2. with 2+ GPUs: nereus reshard-check --backend nccl (transitions bit for bit), then with
#      --inject-fault before-send and corrupt (rollback over NCCL: abort, rebuild, gloo vote),
#      and benchmarks/reshard_vs_dcp.py --backend nccl (Nereus vs DCP vs raw on the GPUs);
#      with one GPU these need two ranks on distinct GPUs (NCCL refuses two ranks on one GPU)
#      and are recorded as skipped;
#   3. nereus calibrate --quick --device cuda.
# Exits non-zero, saying why, when CUDA is absent or any step fails.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-benchmarks/results/gpu_check}}"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
if [ -z "$NGPU" ] || [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False or torch is missing); nothing checked" >&2
  exit 3
fi
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 2; }
WORLD=$(( NGPU >= 4 ? 4 : NGPU ))
BENCH_WORLD=$(( NGPU >= 4 ? 4 : 2 ))  # the benchmark's layouts need an even world
echo "gpu_check: $NGPU GPU(s), writing to $OUT_DIR"
FAILED=()
STEPS=()

run() {  # run NAME TIMEOUT_S CMD...: one step, its log and exit status
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$OUT_DIR/$name.log"
  STEPS+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $(( SECONDS - t0 ))}")
  [ $rc -eq 0 ] || FAILED+=("$name (exit $rc, see $OUT_DIR/$name.log)")
}

skip() {
  echo "== $1: skipped ($2)"
  STEPS+=("{\"step\": \"$1\", \"skipped\": \"$2\"}")
}

run device_check 120 "$PY" benchmarks/gpu_device_check.py --json "$OUT_DIR/device_check.json"
if [ "$WORLD" -ge 2 ]; then
  run reshard_nccl 120 "$PY" -m nereus.cli reshard-check --backend nccl --world "$WORLD" --cases 3 --seed 1 \
      --json "$OUT_DIR/reshard_nccl.json"
  run reshard_nccl_bf16 90 "$PY" -m nereus.cli reshard-check --backend nccl --world "$WORLD" --cases 2 --seed 2 \
      --arch qwen3 --precision bf16-mixed --json "$OUT_DIR/reshard_nccl_bf16.json"
  for f in before-send corrupt; do
    run "fault_nccl_$f" 120 "$PY" -m nereus.cli reshard-check --backend nccl --world "$WORLD" --cases 2 --seed 3 \
        --inject-fault "$f" --timeout 5 --json "$OUT_DIR/fault_nccl_$f.json"
  done
  run reshard_vs_dcp_gpu 150 "$PY" benchmarks/reshard_vs_dcp.py --backend nccl --world "$BENCH_WORLD" --repeat 3 \
      --shapes 8l-512h,llama-bf16 --json "$OUT_DIR/reshard_vs_dcp_gpu.json"
else
  for s in reshard_nccl reshard_nccl_bf16 fault_nccl_before-send fault_nccl_corrupt reshard_vs_dcp_gpu; do
    skip "$s" "needs 2 GPUs: NCCL does not put two ranks on one GPU"
  done
fi
run calibrate_cuda 240 "$PY" -m nereus.cli calibrate --quick --device cuda --world "$WORLD" \
    --out "$OUT_DIR/calibrate_cuda_profile.json" --report "$OUT_DIR/calibrate_cuda.md"

{
  echo "{\"gpus\": $NGPU, \"world\": $WORLD, \"failed\": ${#FAILED[@]}, \"steps\": ["
  for i in "${!STEPS[@]}"; do
    [ "$i" -gt 0 ] && echo ","
    echo "  ${STEPS[$i]}"
  done
  echo "]}"
} > "$OUT_DIR/summary.json"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'gpu_check: FAILED: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
echo "gpu_check: all steps passed ($OUT_DIR/summary.json)"
