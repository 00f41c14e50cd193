#!/usr/bin/env bash
# jobs.sh's Hugging Face Jobs mode: launch, preflight, status, logs, stop. Sourced by jobs.sh
# (it defines functions only); its settings, the roles' arguments and the helpers it uses
# (die, banner, http_get, host_python, ...) are jobs.sh's. Written for bash 3.2 too.

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
