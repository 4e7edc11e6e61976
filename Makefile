# Two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: a bare `torch` would pull a multi-GB CUDA build. Override e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
# the ends of the supported torch range (pyproject.toml, docs/getting_started.md): `make test-compat-all` tests both
TORCH_OLDEST := torch==2.11.0
TORCH_NEWEST := torch==2.14.1
EXTRAS ?= test,plot,deepspeed,fault-tolerance
# compile DeepSpeed's async_io op (NVMe offload) at install: 1 for `make test`, 0 for the compat venvs
AIO_OP ?= 1
# DeepSpeed compiles its ops on first use (minutes on 2 cores): keep them inside the environment.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
PYTEST_ARGS ?=
# the unit tests run in one process per core (pytest-xdist); the multi-process tests one at a time, the slowest
# 12 listed so the suite's time budget (CI under 60 min) can be watched
UNIT_ARGS ?= -n auto
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo "sudo -n")
# one venv per torch release for the compatibility subset, e.g. .venv-torch-2.11.0
COMPAT_VENV = .venv-$(subst ==,-,$(TORCH_SPEC))

.PHONY: compat-torch demo docs lint test test-unit test-distributed test-compat test-compat-all install install-base clean bench

# What the demo needs: torch and the package's own dependencies (no extras, nothing compiled).
$(VENV)/.base: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# one resolver pass: torch (pinned) and the package's own dependencies
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e .
	touch $@

# What the tests add to the same venv: the extras (DeepSpeed, matplotlib, test tools) and the NVMe op.
$(VENV)/.installed: $(VENV)/.base
	# libaio: DeepSpeed's async_io op (NVMe offload) links against it
	test "$(AIO_OP)" = 0 || test -e /usr/include/libaio.h || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libaio-dev; } \
		|| echo "libaio-dev could not be installed: NVMe offload tests will be skipped"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# litgpt: a real model for the tensor-parallel (plan="auto" on its GPT) and pipeline tests. Installed without its
	# dependencies: it pins old jsonargparse/huggingface-hub that would downgrade ours; its GPT needs only torch and Lightning
	$(PY) -m pip install -q --no-deps "litgpt==0.5.13"
	# NVMe offload: compile DeepSpeed's async_io op once into $(TORCH_EXTENSIONS_DIR) (minutes), not in a test
	-test "$(AIO_OP)" = 0 || $(PY) -c "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('AsyncIOBuilder').load()"
	touch $@

install-base: $(VENV)/.base
install: $(VENV)/.installed

# The formatter and linter: ruff, pinned by the `lint` extra, with the settings of [tool.ruff] in pyproject.toml.
$(VENV)/.lint: $(VENV)/.base
	$(PY) -m pip install -q -e ".[lint]"
	touch $@

# formatting and lint rules over the whole tree (what CI runs first); `ruff format .` fixes the formatting
lint: $(VENV)/.lint
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

demo: install-base
	$(PY) -m lightning_dist.demo

# the documentation site into site/ (`make test` builds it too, in strict mode: tests/unit/test_docs.py)
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: install
	$(PY) -m pytest -q $(UNIT_ARGS) -m "not distributed" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "distributed and not compat_only" --durations=12 $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -q $(UNIT_ARGS) -m "not distributed" $(PYTEST_ARGS)

test-distributed: install
	$(PY) -m pytest -q -m "distributed and not compat_only" --durations=12 $(PYTEST_ARGS)

# The compatibility subset on another torch, in its own venv: `make test-compat TORCH_SPEC=torch==2.11.0`.
# Unit tests plus the multi-process tests marked `compat` (parity of every strategy, callbacks, resume, reshard).
test-compat:
	$(MAKE) --no-print-directory $(COMPAT_VENV)/.installed VENV=$(COMPAT_VENV) AIO_OP=0 TORCH_SPEC="$(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -c "import torch, lightning; print('compat subset on torch', torch.__version__, 'lightning', lightning.__version__)"
	TORCH_EXTENSIONS_DIR=$(abspath $(COMPAT_VENV))/torch_extensions $(COMPAT_VENV)/bin/python -m pytest -q $(UNIT_ARGS) -m "not distributed" $(PYTEST_ARGS)
	TORCH_EXTENSIONS_DIR=$(abspath $(COMPAT_VENV))/torch_extensions $(COMPAT_VENV)/bin/python -m pytest -q -m "compat" $(PYTEST_ARGS)

# torch alone into the venvs of both ends (the large CUDA builds; no write to the source tree): .ci/run runs this
# in the background while `make test` runs, and `make test-compat` then finds torch in place
compat-torch:
	for spec in "$(TORCH_OLDEST)" "$(TORCH_NEWEST)"; do \
		venv=.venv-$$(echo "$$spec" | sed 's/==/-/'); \
		test -x $$venv/bin/python || $(PYTHON) -m venv $$venv; \
		$$venv/bin/python -m pip install -q "$$spec" || exit 1; \
	done

# both ends of the supported range (what .ci/run runs after `make test`)
test-compat-all:
	$(MAKE) --no-print-directory test-compat TORCH_SPEC="$(TORCH_OLDEST)"
	$(MAKE) --no-print-directory test-compat TORCH_SPEC="$(TORCH_NEWEST)"

# side-by-side benchmarks (ratios printed, never asserted); each writes JSON next to its table
bench: install
	$(PY) benchmarks/hsdp.py --json bench-hsdp.json
	$(PY) benchmarks/tensor_parallel.py --json bench-tp.json
	$(PY) benchmarks/pipeline.py --json bench-pipeline.json
	$(PY) benchmarks/planner_vs_measured.py --json bench-planner.json

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info
