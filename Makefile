# Two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: a bare `torch` would pull a multi-GB CUDA build. Override e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,plot,deepspeed
# DeepSpeed compiles its ops on first use (minutes on 2 cores): keep them inside the environment.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo "sudo -n")

.PHONY: demo test test-unit test-distributed install clean bench

$(VENV)/.installed: pyproject.toml Makefile
	# libaio: DeepSpeed's async_io op (NVMe offload) links against it
	test -e /usr/include/libaio.h || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libaio-dev; } \
		|| echo "libaio-dev could not be installed: NVMe offload tests will be skipped"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# NVMe offload: compile DeepSpeed's async_io op once into $(TORCH_EXTENSIONS_DIR) (minutes), not in a test
	-$(PY) -c "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('AsyncIOBuilder').load()"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m lightning_dist.demo

test: install
	$(PY) -m pytest -q -m "not distributed" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "distributed" $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -q -m "not distributed" $(PYTEST_ARGS)

test-distributed: install
	$(PY) -m pytest -q -m "distributed" $(PYTEST_ARGS)

# side-by-side benchmarks (ratios printed, never asserted); each writes JSON next to its table
bench: install
	$(PY) benchmarks/hsdp.py --json bench-hsdp.json
	$(PY) benchmarks/tensor_parallel.py --json bench-tp.json
	$(PY) benchmarks/pipeline.py --json bench-pipeline.json
	$(PY) benchmarks/planner_vs_measured.py --json bench-planner.json

clean:
	rm -rf $(VENV) build *.egg-info
