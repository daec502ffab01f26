# Two commands do everything: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is installed first, on its own, so that CI and local machines can choose the build:
#   make test TORCH_SPEC='torch'          # whatever pip resolves (a CUDA build on Linux from PyPI)
#   make test TORCH_SPEC='torch==2.13.0'  # the default; on this project's machines a CPU wheel on local disk
# The package itself only asks for torch>=2.4, so an installed build is kept.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev

.PHONY: demo demo-core test venv lint bench compat clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/lightning/demo.py

demo-core: venv
	$(PY) examples/core_demo.py

# Two test processes (pytest-xdist, tests handed out as workers free up): most tests wait on the jobs
# they launch, so one process leaves the second core idle.
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

lint: venv
	$(VENV)/bin/ruff check air_core lightning_air accelerate_air tests benchmarks examples
	$(VENV)/bin/ruff format --check air_core lightning_air accelerate_air tests benchmarks examples
	$(VENV)/bin/mypy air_core lightning_air accelerate_air

bench: venv
	$(PY) benchmarks/checkpoint_stall.py

# The frameworks' own checkpoint tests, stock and with our classes substituted (docs/compat.md); not part
# of `make test`. Test-only dependencies, not the package's. Pass options: make compat COMPAT_ARGS='--mode io'
COMPAT_ARGS ?=
compat: venv
	$(PY) -c "import tensorboardX, parameterized, pytest_timeout" 2>/dev/null || \
		$(PY) -m pip install -q tensorboardX parameterized pytest-timeout
	$(PY) -m compat.run $(COMPAT_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
