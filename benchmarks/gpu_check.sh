#!/usr/bin/env bash
# The GPU check: random-init models of the full-size configs, no downloads, about 8 minutes on one
# H200. One rollout + update step each; prints tokens/s or images/s, peak GPU memory and an MFU estimate.
#   benchmarks/gpu_check.sh            # on a GPU machine
#   benchmarks/gpu_check.sh --tiny     # the same code on a CPU with tiny configs
set -euo pipefail
cd "$(dirname "$0")/.."
make -s .venv/.installed
HF_HUB_OFFLINE=1 timeout 540 .venv/bin/python benchmarks/gpu_check.py "$@"
