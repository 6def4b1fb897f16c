#!/usr/bin/env bash
# The executor's GPU path on one machine with CUDA, sized for ONE GPU (an H200) in <= 8 minutes:
# every check runs under its own time budget, the budgets add up to at most 480 s.
#
#   benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT, else benchmarks/results/gpu_check/
#   benchmarks/gpu_check.sh --dry-run      # list each check, its budget, and what one GPU cannot check
#   benchmarks/gpu_check.sh --cpu-smoke [OUT_DIR]   # the checks that have a CPU form, on the CPU (tests;
#                                                   # never a GPU result)
#
# One-GPU checks (gpu_device_check.py unless said otherwise):
#   device_check   on-device checksum = host value, catches a flipped bit; reference transformer
#                  (logits, log-probs, a training step) with every tensor on the GPU, logits vs host
#   nccl_single    one NCCL rank: self send/receive; a receive nobody answers, polled against a
#                  deadline, then abort + rebuild of the group; self send/receive on the rebuilt one
#   watchdog       TORCH_NCCL_ASYNC_ERROR_HANDLING=0 survives a stuck op past a 10 s group timeout,
#                  =1 is torn down (two child processes)
#   hash_speed     device_hash throughput and memory beside the piece on 64 MiB, 256 MiB, 1 GiB
#   calibrate_cuda nereus calibrate --quick --device cuda (collectives not fitted from CPU gloo)
#   hf_bf16        tiny Llama / Qwen2 / Qwen3 (from configs, random weights): the executor's bf16 forward
#                  and logits on the GPU vs transformers' bf16 on the GPU and fp32 on the host
#   model_timings  prefill / decode / training-pass times of small HF models (Qwen2.5-0.5B's shape, an
#                  8-layer Llama) at batch 1-32, bf16, as corpus rows (source: this check, the GPU's name)
#                  in OUT_DIR/corpus/{prefill,decode,training}.csv
# With 2+ GPUs it also runs the multi-rank NCCL checks (reshard-check --backend nccl with and without
# faults, reshard_vs_dcp.py --backend nccl), outside the one-GPU budget.
# Writes one JSON per check and summary.json to OUT_DIR; exits non-zero, saying why, when CUDA is
# absent or any check fails.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DC=benchmarks/gpu_device_check.py

# name|budget_s|command (OUT_DIR substituted at run time): the one table the run and --dry-run read
ONE_GPU=(
  "device_check|60|$PY $DC --json @OUT@/device_check.json"
  "nccl_single|45|$PY $DC --nccl-single --json @OUT@/nccl_single.json"
  "watchdog|60|$PY $DC --watchdog --json @OUT@/watchdog.json"
  "hash_speed|45|$PY $DC --hash-speed cuda --sizes-mib 64,256,1024 --json @OUT@/hash_speed.json"
  "calibrate_cuda|180|$PY -m nereus.cli calibrate --quick --device cuda --world 1 --out @OUT@/calibrate_cuda_profile.json --report @OUT@/calibrate_cuda.md"
  "hf_bf16|35|$PY $DC --hf-bf16 --device cuda --json @OUT@/hf_bf16.json"
  "model_timings|50|$PY $DC --model-timings --device cuda --corpus-dir @OUT@/corpus --json @OUT@/model_timings.json"
)
# the checks with a CPU form (--cpu-smoke): the same code on the host, small sizes; not a GPU result
CPU_SMOKE=(
  "hash_speed_cpu|60|$PY $DC --hash-speed cpu --sizes-mib 4,16 --json @OUT@/hash_speed_cpu.json"
  "hf_bf16_cpu|90|$PY $DC --hf-bf16 --device cpu --json @OUT@/hf_bf16_cpu.json"
  "model_timings_cpu|90|$PY $DC --model-timings --device cpu --quick --corpus-dir @OUT@/corpus --json @OUT@/model_timings_cpu.json"
)
MULTI_GPU=(
  "reshard_nccl|120|$PY -m nereus.cli reshard-check --backend nccl --world @WORLD@ --cases 3 --seed 1 --json @OUT@/reshard_nccl.json"
  "fault_nccl_corrupt-pack|150|$PY -m nereus.cli reshard-check --backend nccl --world @WORLD@ --cases 2 --seed 3 --inject-fault corrupt-pack --timeout 5 --json @OUT@/fault_nccl_corrupt-pack.json"
  "fault_nccl_before-send|150|$PY -m nereus.cli reshard-check --backend nccl --world @WORLD@ --cases 2 --seed 3 --inject-fault before-send --timeout 5 --json @OUT@/fault_nccl_before-send.json"
  "reshard_vs_dcp_gpu|150|$PY benchmarks/reshard_vs_dcp.py --backend nccl --world @BENCH_WORLD@ --repeat 3 --shapes 8l-512h,llama-bf16 --json @OUT@/reshard_vs_dcp_gpu.json"
)
NOT_ON_ONE_GPU=(
  "transitions between ranks over NCCL (NCCL refuses two ranks on one GPU; gloo moves host tensors only)"
  "eager communicator init and batched send/receive across ranks, ranks with nothing to send"
  "rollback across ranks: the vote on the gloo side group, abort on every rank, the second agreement, the rebuild"
  "a rank killed mid-transition under NCCL (survivors report their groups gone)"
  "every Engine rebinding after a multi-rank rebuild; HF gather on the side group between ranks"
  "reshard_vs_dcp.py --backend nccl (Nereus vs DCP vs raw point-to-point on GPUs)"
)

if [ "${1:-}" = "--dry-run" ]; then
  total=0
  echo "gpu_check --dry-run: checks on one GPU (name, budget):"
  for c in "${ONE_GPU[@]}"; do
    IFS='|' read -r name budget _ <<< "$c"
    printf '  %-24s %4d s\n' "$name" "$budget"
    total=$(( total + budget ))
  done
  echo "  total                    $total s (limit 480 s)"
  echo "with 2+ GPUs, also (outside the one-GPU budget):"
  for c in "${MULTI_GPU[@]}"; do
    IFS='|' read -r name budget _ <<< "$c"
    printf '  %-24s %4d s\n' "$name" "$budget"
  done
  echo "cannot be checked on one GPU:"
  printf '  - %s\n' "${NOT_ON_ONE_GPU[@]}"
  echo "CPU smoke form (--cpu-smoke, not a GPU result):"
  for c in "${CPU_SMOKE[@]}"; do
    IFS='|' read -r name budget _ <<< "$c"
    printf '  %-24s %4d s\n' "$name" "$budget"
  done
  [ "$total" -le 480 ] || { echo "gpu_check: budgets add up to $total s > 480 s" >&2; exit 1; }
  exit 0
fi

FAILED=()
STEPS=()
WORLD=1
BENCH_WORLD=2

run() {  # run "name|budget|command": one check, its log and exit status
  local name budget cmd
  IFS='|' read -r name budget cmd <<< "$1"
  cmd=${cmd//@OUT@/$OUT_DIR}; cmd=${cmd//@WORLD@/$WORLD}; cmd=${cmd//@BENCH_WORLD@/$BENCH_WORLD}
  echo "== $name (budget $budget s): $cmd"
  local t0=$SECONDS
  # shellcheck disable=SC2086 - the command is a word list from the table above
  timeout "$budget" $cmd > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$OUT_DIR/$name.log"
  STEPS+=("{\"step\": \"$name\", \"budget_s\": $budget, \"exit\": $rc, \"seconds\": $(( SECONDS - t0 ))}")
  [ $rc -eq 0 ] || FAILED+=("$name (exit $rc, see $OUT_DIR/$name.log)")
}

json_list() {  # the arguments as a JSON list of strings
  local i
  echo "["
  for i in $(seq 1 $#); do
    [ "$i" -gt 1 ] && echo ","
    echo "  \"${!i}\""
  done
  echo "]"
}

steps_json() {
  local i
  for i in "${!STEPS[@]}"; do
    [ "$i" -gt 0 ] && echo ","
    echo "  ${STEPS[$i]}"
  done
}

finish() {  # exit status from FAILED
  if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'gpu_check: FAILED: %s\n' "${FAILED[@]}" >&2
    exit 1
  fi
  echo "gpu_check: all checks passed ($OUT_DIR/summary.json)"
  exit 0
}

if [ "${1:-}" = "--cpu-smoke" ]; then
  OUT_DIR="${2:-${OUT:-benchmarks/results/gpu_check_cpu_smoke}}"
  mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 2; }
  echo "gpu_check --cpu-smoke: the checks with a CPU form, on the CPU (not a GPU result), writing to $OUT_DIR"
  for c in "${CPU_SMOKE[@]}"; do run "$c"; done
  {
    echo "{\"cpu_smoke\": true, \"note\": \"CPU smoke run: the GPU checks' code on the host, not a GPU result\","
    echo "\"failed\": ${#FAILED[@]}, \"steps\": ["
    steps_json
    echo "]}"
  } > "$OUT_DIR/summary.json"
  finish
fi

OUT_DIR="${1:-${OUT:-benchmarks/results/gpu_check}}"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
if [ -z "$NGPU" ] || [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False or torch is missing); nothing checked" >&2
  exit 3
fi
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 2; }
WORLD=$(( NGPU >= 4 ? 4 : NGPU ))
BENCH_WORLD=$(( NGPU >= 4 ? 4 : 2 ))  # the benchmark's layouts need an even world
GPU_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)
echo "gpu_check: $NGPU GPU(s) ($GPU_NAME), writing to $OUT_DIR"

for c in "${ONE_GPU[@]}"; do run "$c"; done
if [ "$WORLD" -ge 2 ]; then
  for c in "${MULTI_GPU[@]}"; do run "$c"; done
else
  for c in "${MULTI_GPU[@]}"; do
    STEPS+=("{\"step\": \"${c%%|*}\", \"skipped\": \"needs 2 GPUs: NCCL does not put two ranks on one GPU\"}")
  done
fi

{
  echo "{\"gpus\": $NGPU, \"gpu\": \"$GPU_NAME\", \"world\": $WORLD, \"failed\": ${#FAILED[@]}, \"steps\": ["
  steps_json
  echo "], \"not_checked_on_one_gpu\": "
  json_list "${NOT_ON_ONE_GPU[@]}"
  echo "}"
} > "$OUT_DIR/summary.json"
finish
