#!/usr/bin/env bash
# What a replica or trainer job runs in the vLLM image before its role (jobs.sh's job_command):
#
#   cd /code && exec bash scripts/job_start.sh python3 trainer.py ...
#   bash scripts/job_start.sh --packages    # print the packages it installs, nothing else
#
# 1. The machine, first in the job's log: the driver and the newest CUDA it runs, torch's CUDA
#    build, each GPU and its memory (scripts/gpu_tools.py machine). When the image's CUDA needs a
#    newer driver than the machine has, the job stops here and says which image to use.
# 2. The rest of requirements.txt into the image (it has torch, transformers and vLLM; not torch,
#    not gguf), at their pins: up to 4 tries, 15, 30 then 60 s apart (one registry hiccup must not
#    lose a replica, which runs once); failing, it names the package pip could not get.
# 3. exec the role's command.
set -u
cd "$(dirname "$0")/.."
PACKAGES=$(grep -E '^[a-z]' requirements.txt | grep -vE '^(torch|gguf)==' | cut -d' ' -f1)
if [ "${1:-}" = --packages ]; then echo $PACKAGES; exit 0; fi

python3 scripts/gpu_tools.py machine || exit 1

log=$(mktemp)
for try in 1 2 3 4; do
  # shellcheck disable=SC2086  # one word per package
  if python3 -m pip install -q --disable-pip-version-check $PACKAGES >"$log" 2>&1; then
    cat "$log"; break
  fi
  cat "$log"
  if [ $try = 4 ]; then
    what=$(grep -oE '(requirement|found for) [A-Za-z0-9_.=<>-]+' "$log" | tail -1 |
           awk '{print $NF}')
    [ -n "$what" ] || what="unknown, see the output above"
    echo "[install] error: pip install failed 4 times; the package it could not get:" \
         "$what; the packages: $PACKAGES"
    exit 1
  fi
  wait_s=$((${JOB_START_RETRY_S:-15} * (1 << (try - 1))))   # a test sets it to 0
  echo "[install] pip install failed (try $try of 4): again in $wait_s s"
  sleep "$wait_s"
done
rm -f "$log"
exec "$@"
