# `make test` and `make demo` work on a fresh machine: they create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The main job, locally: trainer, relays and workers as processes on loopback (~3 minutes).
demo: $(STAMP)
	$(BIN)/sparrowrl run examples/local-job.yaml --run-dir runs/demo

bench: $(STAMP)
	$(BIN)/python hack/bench_codec.py --out docs/bench_codec.json

clean:
	rm -rf $(VENV) .pytest_cache runs
