#!/usr/bin/env bash
# The test command:  bash tests/run.sh [pytest arguments]
# Creates .venv when missing, installs what the tests need (nothing when already there), then
# runs the whole suite on CPU with one thread per process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash setup.sh --test
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q -ra "${@:-tests}"   # no arguments: the whole suite
