#!/usr/bin/env bash
# The GPU check on a machine that has its own Python stack (torch, transformers, accelerate, peft,
# safetensors, numpy) and no network: nothing is installed from a registry. The packages that stack
# lacks travel as wheels in .whl/ (`make gpu-wheels`, on a machine with a registry), installed here
# without an index into a temporary folder put on PYTHONPATH. Random-init models of the full-size
# configs, nothing downloaded (HF_HUB_OFFLINE=1); about 8 minutes on one H200.
#   benchmarks/gpu_check.sh            # on the GPU machine (its own python3)
#   benchmarks/gpu_check.sh --tiny     # the same code on a CPU with tiny configs
#   PYTHON=.venv/bin/python benchmarks/gpu_check.sh --tiny   # another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ " $* " != *" --tiny "* && " $* " != *" --plan "* ]] &&
    ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "error: $PYTHON's torch sees no CUDA GPU: run this on the GPU machine, or add --tiny" >&2
    exit 1
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
if ! "$PYTHON" -c "import diffusers, bfcl_eval, math_verify" 2>/dev/null; then
    echo "error: $PYTHON lacks diffusers, bfcl-eval or math-verify: run \`make gpu-wheels\` on a" \
        "machine with a package registry and carry .whl/ with the checkout" >&2
    exit 1
fi
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"
