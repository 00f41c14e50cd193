#!/usr/bin/env bash
# One GPU box, end to end: `bash jobs.sh --local` with the replica on vLLM and the trainer on the
# same NVIDIA GPU, Qwen2.5-0.5B-Instruct on GSM8K. Under 10 minutes once setup.sh has installed
# (a fresh .venv first downloads torch and vLLM: a few minutes more).
#
#   bash scripts/gpu_check.sh             # one NVIDIA GPU; the Hub for the model (and for GSM8K
#                                         # unless ../shared/data/gsm8k is there)
#   GPU_SHARE=0.3 STEPS=10 bash scripts/gpu_check.sh
#
# It checks the wiring, not the learning: 20 steps of 8 prompts x 8 completions. vLLM takes
# GPU_SHARE of the GPU's memory (its gpu_memory_utilization), the trainer uses what is left.
# Exits non-zero if there is no GPU, the run fails, or a role did not exit by itself at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi -L failed): nothing to check" >&2; exit 2
fi
nvidia-smi -L
t0=$SECONDS
bash setup.sh   # on a GPU machine: torch 2.13 (CUDA build) and the pinned vLLM
echo "[gpu_check] setup: $((SECONDS - t0)) s"
if ! .venv/bin/python rollout.py --help | grep -q -- --gpu-memory-utilization; then
  echo "gpu_check.sh: rollout.py has no --gpu-memory-utilization: vLLM would take 90% of the GPU and starve the trainer" >&2
  exit 1
fi

export MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct} TASK=gsm8k ENGINE=vllm REPLICAS=1
if [ -z "${DATA:-}" ] && [ -d ../shared/data/gsm8k ]; then export DATA=../shared/data/gsm8k; fi
export STEPS=${STEPS:-20} GROUPS_PER_STEP=${GROUPS_PER_STEP:-8} NUM_GENERATIONS=8
export MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256} MAX_STALENESS=4 LEARNING_RATE=${LEARNING_RATE:-5e-5}
export EVAL_LIMIT=${EVAL_LIMIT:-100} SAVE_EVERY=10
export ROLLOUT_ARGS="--gpu-memory-utilization ${GPU_SHARE:-0.35} ${ROLLOUT_ARGS:-}"
export NAME=${NAME:-gpu-check-$(date +%Y%m%d-%H%M%S)}
export PROXY_PORT=${PROXY_PORT:-$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

t1=$SECONDS
mkdir -p "runs/$NAME"
bash jobs.sh --local 2>&1 | tee "runs/$NAME/gpu_check.log"
run_s=$((SECONDS - t1))

log=runs/$NAME/gpu_check.log
fail=""
grep -q "proxy exited by itself (status 0)" "$log" || fail="$fail; the proxy did not exit by itself with status 0"
grep -q "rollout-0 exited by itself (status 0)" "$log" || fail="$fail; the replica did not exit by itself with status 0"
[ "$(.venv/bin/python sync.py metrics "runs/$NAME/bucket" | wc -l)" -ge "$STEPS" ] || fail="$fail; fewer than $STEPS step records in the bucket"
echo
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "[gpu_check] jobs.sh --local: $run_s s (budget 600 s), whole check: $((SECONDS - t0)) s; logs in runs/$NAME/"
if [ -n "$fail" ]; then echo "[gpu_check] FAILED${fail}" >&2; exit 1; fi
echo "[gpu_check] passed"
