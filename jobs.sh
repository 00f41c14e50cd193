#!/usr/bin/env bash
# Async GRPO with LoRA: start the proxy, the rollout replicas and the trainer.
#
#   bash jobs.sh --local              # all three roles on this machine, a directory as the bucket
#   BUCKET=user/name GATEWAY_TOKEN=hf_... bash jobs.sh preflight   # first: 2 cpu-basic jobs,
#        # < 2 min: the token opens the gateway, a 2 MB POST, a 35 s hold, headers, bucket lag
#   BUCKET=user/name GATEWAY_TOKEN=hf_... bash jobs.sh   # on Hugging Face Jobs (launch_hf below)
#   bash jobs.sh status|logs [ROLE]|stop     # the last Hugging Face Jobs run (or NAME=...)
#   DRY_RUN=1 BUCKET=user/name bash jobs.sh  # print the `hf jobs run` commands, run nothing
#
# Every setting is an environment variable; the values in use are printed at start and listed
# in docs/settings.md. The run's contract (G, groups per step, staleness, temperature, completion
# length) is given to the proxy only: replicas and trainer read it from the proxy's /config.
# The run ends when the trainer does: it tells the proxy, then the replicas and the proxy exit
# by themselves. GATEWAY_TOKEN: a fine-grained token of its own for the replica jobs, never your
# HF token (docs/hf-jobs.md). The plumbing (status, logs, stop, preflight, the helpers) is in
# scripts/jobs_lib.sh. Written for bash 3.2 too (macOS's /bin/bash).
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
. "$ROOT/scripts/jobs_lib.sh"   # functions only: die, banner, launch, manage_hf, ...

mode=hf action=launch
case "${1:-}" in
  --local) mode=local ;;
  status|logs|stop|preflight) action=$1 ;;
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
  "") ;;
  *) die "unknown argument '$1': use --local, status, logs [ROLE], stop or preflight" ;;
esac

# ---------------------------------------------------------------------------------------------
# Settings. The defaults differ by mode: a CPU-sized toy locally, the real experiment on GPUs.
# Every role's default (MODEL, TASK, STEPS, the contract, the loss, ...) is one row of
# support/defaults.py, read here as `: "${VAR:=value}"` lines (a variable you set wins):
#   python3 -m support.defaults --shell local      # prints them; --shell hf, or no flag: the table
# What is left below is the launch's own: the run's name, threads and ports, Jobs' machines.
# ---------------------------------------------------------------------------------------------
host_python   # sets PYH: .venv's python, else python3 (before setup.sh made .venv)
defaults=$("$PYH" -m support.defaults --shell "$mode") ||
  die "could not read the defaults (support/defaults.py) with $PYH"
eval "$defaults"
if [ "$mode" = local ]; then      # minutes on a laptop: SmolLM2-135M on "What is A + B?"
  : "${PROXY_PORT:=8000}" "${EVAL_LIMIT:=0}"
  : "${END_GRACE:=60}"            # seconds the replicas and proxy get to exit after the trainer
  : "${THREADS:=1}"               # torch threads of each role's process (the cores are shared)
  : "${TRAINER_GPUS:=1}"          # trainer processes (torchrun ranks, data parallel, on gloo)
  : "${NAME:=local-$(date +%Y%m%d-%H%M%S)}"
else                              # the GPU experiment: Qwen2.5-0.5B-Instruct on GSM8K
  # REPLICAS: add one while the trainer's wait_s (metrics) is large. MICRO_BATCH_TOKENS 2048: one
  # group per forward, ~9 GiB, 40% of an L4 (8192: ~20 GiB, 87%; docs/gpu-round.md's, estimated)
  : "${PROXY_FLAVOR:=cpu-basic}" "${ROLLOUT_FLAVOR:=l4x1}" "${TRAINER_FLAVOR:=l4x1}"
  : "${ROLLOUT_FLAVORS:=}"   # a mixed pool, one replica per flavor: "a10g-small l4x1 t4-small"
  : "${TRAINER_GPUS:=$(flavor_gpus "$TRAINER_FLAVOR")}"   # trainer ranks, one per GPU: h200x2: 2
  [ -z "$ROLLOUT_FLAVORS" ] || pool_size   # sets REPLICAS; the proxy shares each step by speed
  : "${IMAGE:=vllm/vllm-openai:v0.32.0}"   # setup.sh's vLLM pin: torch 2.13.0, transformers <5.20
  # (a CUDA 13.0 build: R580+ drivers; on an older driver the GPU jobs stop at once and say so:
  # IMAGE=vllm/vllm-openai:v0.32.0-cu129 is vLLM's CUDA 12.9 build, docs/hf-jobs.md)
  : "${MODEL_MOUNT:=0}"   # 1: MODEL mounted read-only at /model in the replicas and the trainer,
  # for a gated or private model (the replicas hold no HF token). 0: each job downloads it
  : "${PROXY_IMAGE:=python:3.12-slim}"      # the proxy needs only the standard library
  : "${TIMEOUT:=2h}"
  : "${STARTUP_TIMEOUT:=900}"   # seconds for the proxy job to be RUNNING and answer /healthz
  # PROXY_TRAINER_START_TIMEOUT: s the proxy waits for the trainer's first request (its GPU,
  # image, install, model and first publish), then ends. PROXY_TRAINER_TIMEOUT: s of trainer
  # silence, once it has spoken, after which the proxy ends the run; it must outlast a restart
  # (docs/gpu-round.md)
  : "${TRAINER_ATTEMPTS:=2}"   # runs of the trainer job in all (hf jobs run --attempts): a failed
  # one starts again and resumes from the bucket. One restart covers a lost machine; a failure that
  # repeats (a bug, an OOM at the same step) is billed again on each attempt. The proxy and the
  # replicas run once: the proxy's exit 1 is how it ends a run whose trainer went silent (another
  # attempt would start it again, waiting); a lost replica costs its batch (the others carry on).
  : "${JOB_ENV:=}"             # extra "K=V K=V" for every job (-e), e.g. "HF_HUB_OFFLINE=1"
  if [ "$action" = preflight ]; then : "${NAME:=preflight-$(date +%Y%m%d-%H%M%S)}"
  elif [ "$action" = launch ]; then : "${NAME:=grpo-$(date +%Y%m%d-%H%M%S)}"
  else : "${NAME:=$(cat runs/.last-hf 2>/dev/null || true)}"; fi
fi
MAX_NEW_TOKENS=$MAX_COMPLETION_LENGTH  # the old name, kept equal for scripts that read it
case $TRAINER_GPUS in ''|0*|*[!0-9]*)
  die "TRAINER_GPUS='$TRAINER_GPUS': the trainer's processes (torchrun ranks)," \
      "a whole number >= 1" ;;
esac
: "${TRAINER_FSDP:=0}"   # 1: the trainer's ranks shard the model (FSDP2: trainer.py --fsdp)
case $TRAINER_FSDP:$TRAINER_GPUS in
  0:*|1:[2-9]*|1:1[0-9]*) ;;
  1:*) die "TRAINER_FSDP=1 shards the model over the trainer's ranks: TRAINER_GPUS >= 2" ;;
  *) die "TRAINER_FSDP='$TRAINER_FSDP': 0 or 1" ;;
esac
: "${DATA:=}"                       # gsm8k, math: local JSONL instead of the hub
# Your own task instead of TASK (TRL's dataset and reward functions: docs/own-task.md). Paths
# are from this folder; on Jobs local files travel with the code (ship_task_files).
: "${DATASET:=}"         # rows with a "prompt" column: a .jsonl/.parquet file, a folder, a Hub id
: "${DATASET_CONFIG:=}"  # the Hub dataset's config (TRL's dataset_config)
: "${EVAL_DATA:=}"       # held-out rows for a DATASET without a test split (else 10% held out)
: "${REWARD_FUNCS:=}"    # "file.py:function module:function ...": called as TRL calls them
: "${REWARD_WEIGHTS:=}"  # one weight per function (default 1 each)
: "${HUB_MODEL_ID:=}"    # user/name: at the end, the adapter + a model card to the Hub (docs/hub.md)
: "${HUB_PRIVATE_REPO:=}"  # 1: that repository is created private (TRL's hub_private_repo)
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

# ---------------------------------------------------------------------------------------------
# The three role commands, shared by both modes. Each sets the array ARGS.
# ---------------------------------------------------------------------------------------------
proxy_args() {  # HOST PORT — the run's contract goes here, and only here
  ARGS=(proxy.py --host "$1" --port "$2" --num-generations "$NUM_GENERATIONS"
        --groups-per-step "$GROUPS_PER_STEP" --max-staleness "$MAX_STALENESS"
        --temperature "$TEMPERATURE" --max-completion-length "$MAX_COMPLETION_LENGTH"
        --zero-variance "$ZERO_VARIANCE")
}
add_task_args() {  # the task's flags, the same for the replicas, the trainer and --eval
  if [ -n "$DATASET" ]; then
    ARGS+=(--dataset "$DATASET")
    if [ -n "$DATASET_CONFIG" ]; then ARGS+=(--dataset-config "$DATASET_CONFIG"); fi
    if [ -n "$EVAL_DATA" ]; then ARGS+=(--eval-dataset "$EVAL_DATA"); fi
  else
    ARGS+=(--task "$TASK")
    if [ -n "$DATA" ]; then ARGS+=(--data "$DATA"); fi
  fi
  if [ -n "$REWARD_FUNCS" ]; then ARGS+=(--reward-funcs); add_words "$REWARD_FUNCS"; fi
  if [ -n "$REWARD_WEIGHTS" ]; then ARGS+=(--reward-weights); add_words "$REWARD_WEIGHTS"; fi
}
rollout_args() {  # MODEL BUCKET PROXY_URL REPLICA_ID
  ARGS=(rollout.py --model "$1" --bucket "$2" --proxy "$3" --engine "$ENGINE"
        --replica-id "$4" --num-replicas "$REPLICAS" --seed "$SEED")
  add_task_args
  add_words "$ROLLOUT_ARGS"
}
hub_push_args() {  # BUCKET [EVAL_FILE...] — HUB_MODEL_ID: the adapter and a card to the Hub
  ARGS=(sync.py push-to-hub "$HUB_MODEL_ID" --bucket "$1" --base-model "$MODEL"
        --dataset "${DATASET:-$TASK}" --reward-funcs)
  add_words "${REWARD_FUNCS:-$TASK}"   # a built-in TASK: its reward (support/tasks.py)
  if [ -n "${REWARD_WEIGHTS:-}" ]; then ARGS+=(--reward-weights); add_words "$REWARD_WEIGHTS"; fi
  if [ "${HUB_PRIVATE_REPO:-0}" = 1 ]; then ARGS+=(--private); fi   # TRL's hub_private_repo
  shift; local f; for f in "$@"; do if [ -f "$f" ]; then ARGS+=(--eval "$f"); fi; done
}
trainer_args() {  # MODEL BUCKET PROXY_URL
  ARGS=(trainer.py --model "$1" --bucket "$2" --proxy "$3" --max-steps "$STEPS"
        --learning-rate "$LEARNING_RATE" --lr-scheduler-type "$LR_SCHEDULER_TYPE"
        --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA"
        --loss-type "$LOSS_TYPE" --beta "$BETA" --save-every "$SAVE_EVERY" --seed "$SEED"
        --micro-batch-tokens "$MICRO_BATCH_TOKENS"   # tokens per forward and backward pass
        --old-logprobs "$OLD_LOGPROBS"   # docs/sampler-mismatch.md: which, and why
        --vllm-importance-sampling-mode "$VLLM_IMPORTANCE_SAMPLING_MODE")
  add_task_args   # the trainer re-scores each group with the task's reward functions
  add_words "$TRAINER_ARGS"
  # TRAINER_GPUS > 1: torchrun starts that many ranks on this machine (data parallel, one GPU
  # each; on CPUs, processes): rank 0 is the trainer the proxy sees (docs/hf-jobs.md)
  if [ "$TRAINER_FSDP" = 1 ]; then ARGS+=(--fsdp); fi   # each rank holds 1/N of the model
  if [ "$TRAINER_GPUS" -gt 1 ]; then
    ARGS=(-m torch.distributed.run --standalone --nproc-per-node "$TRAINER_GPUS" "${ARGS[@]}")
  fi
}

# ---------------------------------------------------------------------------------------------
# Local mode: three kinds of processes on this machine, one thread each (their plumbing: start,
# stop_all, finish_all, show_steps in scripts/jobs_lib.sh).
# ---------------------------------------------------------------------------------------------
run_local() {
  case $THREADS in  # a whole number >= 1, no leading zero
    ''|0*|*[!0-9]*) die "THREADS='$THREADS': torch threads per role, a whole number >= 1" ;;
  esac
  export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
  export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  # This run's tokens: the trainer's (PROXY_TOKEN) and the replicas' (ROLLOUT_TOKEN: /rollouts,
  # /quota, /config, /stats only). Nothing else on the machine can feed or drain this proxy.
  # Each replica gets ROLLOUT_TOKEN bound to its worker name (proxy.py --print-replica-token).
  export PROXY_TOKEN=${PROXY_TOKEN:-$(new_token)} ROLLOUT_TOKEN=${ROLLOUT_TOKEN:-$(new_token)}
  # ADAPTER_KEY and TRAINER_STATE_KEY stay unset unless you export them (Jobs sets both:
  # run_secrets): here adapters, LATEST and the resume state are neither tagged nor checked.
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
  ARGS=(-m support.rewards); add_task_args   # before anything starts: what to fix, if anything
  banner "task: the dataset and the reward functions (docs/own-task.md)"
  "$PY" "${ARGS[@]}" || die "the task above cannot run (nothing was started)"
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

  banner "base model: greedy on the held-out rows of ${DATASET:-$TASK} (EVAL_LIMIT $EVAL_LIMIT)"
  # The evaluations run alone: they get every core (torch's default), the roles one thread each.
  ARGS=(rollout.py --eval --adapter base --model "$MODEL_PATH" --bucket "$BUCKET"
        --limit "$EVAL_LIMIT" --max-completion-length "$MAX_COMPLETION_LENGTH"
        --eval-out "$RUN/eval-base.json"); add_task_args
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "$PY" "${ARGS[@]}" 2>"$RUN/eval-base.log" | tail -1

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
  # replica i's ROLLOUT_TOKEN is bound to its worker name replica-i: the proxy takes groups and
  # quota asks for that name only (support/proxy_service.replica_token, via proxy.py)
  for ((i = 0; i < REPLICAS; i++)); do  # tokens travel in the environment, never on a command line
    rollout_args "$MODEL_PATH" "$BUCKET" "$url" "$i"; ROLLOUT_TOKEN=$(replica_token "replica-$i")
    start "rollout-$i" env -u PROXY_TOKEN "$PY" "${ARGS[@]}"; ROLLOUT_TOKEN=$secret
  done
  local stats_t=$SECONDS
  while kill -0 "$trainer_pid" 2>/dev/null; do  # every step, once: "[N/STEPS mm:ss] step N ..."
    sleep 1
    show_steps "$train_t0"
    if [ $((SECONDS - stats_t)) -ge 3 ]; then save_stats "$url"; stats_t=$SECONDS; fi
  done
  show_steps "$train_t0"   # the last steps, logged since the last look
  wait "$trainer_pid" || die "the trainer failed, see $RUN/trainer.log:
$(tail -5 "$RUN/trainer.log")"
  local train_s=$((SECONDS - train_t0))
  save_stats "$url"   # the proxy stays up until every replica has heard that the run is over
  [ -f "$RUN/stats.json" ] || echo '{}' >"$RUN/stats.json"
  STARTED=$(echo "$STARTED" | sed "s/ trainer:$trainer_pid//")
  banner "end of the run: the replicas and the proxy exit by themselves"
  finish_all

  banner "final adapter: greedy on the same held-out rows"
  ARGS=(rollout.py --eval --adapter latest --model "$MODEL_PATH" --bucket "$BUCKET"
        --limit "$EVAL_LIMIT" --max-completion-length "$MAX_COMPLETION_LENGTH"
        --eval-out "$RUN/eval-final.json"); add_task_args
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "$PY" "${ARGS[@]}" 2>"$RUN/eval-final.log" | tail -1

  banner "result"
  "$PY" scripts/report.py "$RUN" --bucket "$BUCKET" --train-seconds "$train_s" \
    --wall-seconds "$((SECONDS - t0))" | tee "$RUN/summary.md"
  if [ -n "${HUB_MODEL_ID:-}" ]; then  # needs HF_TOKEN (or hf auth login) with write access
    banner "the adapter and a model card to the Hub: $HUB_MODEL_ID"
    hub_push_args "$BUCKET" "$RUN/eval-base.json" "$RUN/eval-final.json"
    "$PY" "${ARGS[@]}" || echo "[hub] the push failed (above); the adapter stays in $BUCKET"
  fi
}

# ---------------------------------------------------------------------------------------------
# Hugging Face Jobs: three `hf jobs run` commands. `launch ROLE CMD...` runs CMD and records the
# job's id; with DRY_RUN=1 it prints CMD instead, word for word. prepare_hf (scripts/jobs_lib.sh)
# does what comes first: the checks, the bucket, the per-run secrets, the code in CODE.
# ---------------------------------------------------------------------------------------------
launch_hf() {
  local PYH i tid
  prepare_hf   # sets BUCKET_PATH, CODE, BUCKET_RW, BUCKET_RO, JOB_ENV_OPTS
  banner "1. the proxy, then its health through the gateway; 2. the replicas; 3. the trainer"

  # 1. The proxy: the standard library only, on a CPU. CMD: cd /code && exec python3 proxy.py ...
  proxy_args 0.0.0.0 8000; job_command proxy
  launch proxy hf jobs run \
    --detach                  `# print the job id and return` \
    --name "$NAME-proxy"      `# what hf jobs ps shows, and bash jobs.sh stop cancels` \
    --flavor "$PROXY_FLAVOR"  `# cpu-basic: it only hands out work and relays groups` \
    --timeout "$TIMEOUT"      `# a bound: the run ends by itself after STEPS steps` \
    -e HF_HOME=/tmp/hf        `# a writable cache` \
    -e PYTHONUNBUFFERED=1     `# each log line as it is printed` \
    -e PROXY_TRAINER_START_TIMEOUT="$PROXY_TRAINER_START_TIMEOUT"  `# a trainer that never came` \
    -e PROXY_TRAINER_TIMEOUT="$PROXY_TRAINER_TIMEOUT"  `# a silent trainer ends the run: no bill` \
    ${JOB_ENV_OPTS[@]+"${JOB_ENV_OPTS[@]}"}  `# JOB_ENV, one -e K=V per word` \
    -v "$CODE:/code"          `# this checkout, uploaded, mounted read-only` \
    --secrets PROXY_TOKEN     `# the trainer token: hf reads each value from this environment` \
    --secrets ROLLOUT_TOKEN   `# the secret behind each replica token` \
    --expose 8000             `# https://ID--8000.hf.jobs, behind the gateway` \
    -- "$PROXY_IMAGE" bash -c "$CMD"   `# no option of hf past the --`
  URL=https://$JOB_ID--8000.hf.jobs
  wait_for_proxy "$JOB_ID"   # RUNNING, and /healthz answers; sets URL to the exposed one

  # 2. The replicas. CMD: the machine, the rest of requirements.txt, exec python3 rollout.py ...
  for ((i = 0; i < REPLICAS; i++)); do
    rollout_args "$JOB_MODEL" "$BUCKET_PATH" "$URL" "$i"; job_command rollout
    launch "rollout-$i" hf jobs run \
      --detach                `# print the job id and return` \
      --name "$NAME-rollout-$i"  `# worker replica-i at the proxy` \
      --flavor "$(replica_flavor "$i")"  `# word i of ROLLOUT_FLAVORS, else ROLLOUT_FLAVOR` \
      --timeout "$TIMEOUT"    `# a bound: it exits once the trainer is done` \
      -e HF_HOME=/tmp/hf      `# a writable cache for the model` \
      -e PYTHONUNBUFFERED=1   `# each log line as it is printed` \
      -e PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  `# less fragmentation` \
      ${JOB_ENV_OPTS[@]+"${JOB_ENV_OPTS[@]}"}  `# JOB_ENV, one -e K=V per word` \
      -v "$CODE:/code"        `# this checkout, uploaded, mounted read-only` \
      --secrets ROLLOUT_TOKEN `# its own: the secret bound to replica-i (job_env)` \
      --secrets GATEWAY_TOKEN `# opens the gateway: never your HF token` \
      --secrets ADAPTER_KEY   `# checks the trainer's tag on each adapter and LATEST` \
      "${BUCKET_RO[@]}"       `# the bucket read-only; on s3, read-only keys` \
      ${MODEL_VOL[@]+"${MODEL_VOL[@]}"}  `# MODEL_MOUNT=1: the model at /model, read-only` \
      -- "$IMAGE" bash -c "$CMD"   `# the vLLM image: torch and vLLM at the setup.sh pins`
  done

  # 3. The trainer. CMD: the machine, the rest of requirements.txt, exec python3 trainer.py ...
  trainer_args "$JOB_MODEL" "$BUCKET_PATH" "$URL"; job_command trainer
  # HUB_MODEL_ID: after trainer.py (no longer exec'd), the adapter and a card to the Hub with the
  # job's HF_TOKEN. A failed push is only reported: the adapter stays in the bucket and the job
  # ends well, so TRAINER_ATTEMPTS does not train again (docs/hub.md)
  if [ -n "${HUB_MODEL_ID:-}" ]; then
    hub_push_args "$BUCKET_PATH"
    CMD="${CMD/ exec / } && { python3 $(q "${ARGS[@]}")|| echo '[hub] push failed'; }"
  fi
  launch trainer hf jobs run \
    --detach                  `# print the job id and return` \
    --name "$NAME-trainer"    `# bash jobs.sh logs trainer follows it` \
    --flavor "$TRAINER_FLAVOR"  `# a GPU: the forward and backward passes` \
    --timeout "$TIMEOUT"      `# a bound: it exits after STEPS steps` \
    --attempts "$TRAINER_ATTEMPTS"  `# a failed run starts again (a cancel does not), same job` \
                              `# id; it resumes from the bucket (huggingface_hub >= 2.1)` \
    -e HF_HOME=/tmp/hf        `# a writable cache for the model` \
    -e PYTHONUNBUFFERED=1     `# each log line as it is printed` \
    -e PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  `# less fragmentation` \
    ${JOB_ENV_OPTS[@]+"${JOB_ENV_OPTS[@]}"}  `# JOB_ENV, one -e K=V per word` \
    -v "$CODE:/code"          `# this checkout, uploaded, mounted read-only` \
    --secrets PROXY_TOKEN     `# every proxy endpoint` \
    --secrets TRAINER_STATE_KEY  `# signs its resume state and its own manifests` \
    --secrets ADAPTER_KEY     `# tags each adapter and LATEST for the replicas` \
    --secrets GATEWAY_TOKEN   `# opens the gateway` \
    --secrets HF_TOKEN        `# the bucket and gated models: the trainer only` \
    "${BUCKET_RW[@]}"         `# the bucket read-write: adapters, metrics, state` \
    ${MODEL_VOL[@]+"${MODEL_VOL[@]}"}  `# MODEL_MOUNT=1: the model at /model, read-only` \
    -- "$IMAGE" bash -c "$CMD"   `# the same image as the replicas`
  tid=$JOB_ID
  trap - INT TERM
  if [ -n "${DRY_RUN:-}" ]; then
    echo "Dry run: nothing was launched (the commands are above, on stderr)."; return
  fi
  cat <<EOT

Launched run $NAME (job ids in $RUN/jobs.txt). Billed until each job ends: the proxy
($PROXY_FLAVOR), $REPLICAS replica(s) (${ROLLOUT_FLAVORS:-$ROLLOUT_FLAVOR}) and the trainer
($TRAINER_FLAVOR), each at most TIMEOUT=$TIMEOUT. They end by themselves after $STEPS steps. A
trainer that fails starts again and resumes from the bucket (TRAINER_ATTEMPTS=$TRAINER_ATTEMPTS
runs in all; up to $TRAINER_ATTEMPTS x $TIMEOUT if Jobs counts TIMEOUT per run). If the trainer
has not spoken within PROXY_TRAINER_START_TIMEOUT=${PROXY_TRAINER_START_TIMEOUT}s, or is then
silent for PROXY_TRAINER_TIMEOUT=${PROXY_TRAINER_TIMEOUT}s, the proxy ends the run and the
replicas exit. Each GPU job's log starts with its machine ([machine]: driver, CUDA, GPU).
Stop everything now (billing stops, nothing restarts): bash jobs.sh stop
  follow the trainer:   bash jobs.sh logs trainer      (or: ${HF[*]} jobs logs -f $tid)
  all stages:           bash jobs.sh status
  stop everything:      bash jobs.sh stop
  metrics:              $BUCKET_PATH/metrics/ in the bucket
                        (a JSON file per step: python sync.py metrics)
EOT
}

{  # one command, read whole before it runs: editing this file during a run cannot change the run
  if [ "$mode" = local ]; then run_local
  elif [ "$action" = launch ]; then launch_hf
  elif [ "$action" = preflight ]; then preflight_hf
  else manage_hf "$@"; fi
  exit
}
