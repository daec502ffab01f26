# Two commands do everything: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is installed first, on its own, so that CI and local machines can choose the build:
#   make test TORCH_SPEC='torch'          # whatever pip resolves (a CUDA build on Linux from PyPI)
#   make test TORCH_SPEC='torch==2.13.0'  # the default; on this project's machines a CPU wheel on local disk
# The package itself only asks for torch>=2.8, so an installed build is kept.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev

.PHONY: demo demo-core test test-oldest venv lint bench compat clean

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

# The floors in pyproject.toml (lightning>=2.6, accelerate>=1.13) stay true: a few tests, one of each kind
# (SIGKILL crash-resume per adapter, sharded, elastic, a stock framework loading our checkpoint), against
# the oldest releases they allow (.ci/oldest.txt), in a venv of their own on the same torch. CI runs it
# after `make test`. Node ids rather than a marker: a marker cannot pick one parametrization of a test.
VENV_OLDEST := .venv-oldest
PY_OLDEST := $(VENV_OLDEST)/bin/python
OLDEST_TESTS := \
	'tests/lightning/test_crash_resume.py::test_sigkill_mid_epoch_during_each_save_phase_resumes_exactly[snapshot_start-0]' \
	'tests/accelerate/test_crash_resume.py::test_sigkill_mid_epoch_during_each_save_phase_resumes_exactly[snapshot_start-0]' \
	'tests/lightning/test_sharded.py::test_sharded_saves_to_s3_killed_mid_upload_resume_exactly' \
	'tests/lightning/test_sharded.py::test_sharded_fit_killed_between_root_saves_resumes_from_the_local_tier_exactly' \
	'tests/accelerate/test_sharded.py::test_fsdp2_killed_between_root_saves_resumes_from_its_local_tier_exactly' \
	'tests/accelerate/test_elastic.py::test_a_two_process_checkpoint_continues_on_one_and_three_processes_each_sample_once' \
	'tests/accelerate/test_accelerator.py::test_checkpoint_downloaded_from_s3_loads_with_stock_load_state' \
	'tests/transformers/test_crash_resume.py::test_sigkill_during_each_save_phase_resumes_exactly[serialize_start-2]' \
	'tests/transformers/test_trainer.py::test_a_committed_checkpoint_resumes_in_stock_trainer_as_its_own_and_loads_with_from_pretrained' \
	tests/lightning/test_internals.py tests/accelerate/test_internals.py tests/transformers/test_internals.py

$(VENV_OLDEST)/.installed: pyproject.toml .ci/oldest.txt
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install -q --upgrade pip
	$(PY_OLDEST) -c "import torch" 2>/dev/null || $(PY_OLDEST) -m pip install -q "$(TORCH_SPEC)"
	$(PY_OLDEST) -m pip install -q -c .ci/oldest.txt -e ".[dev]"
	touch $@

test-oldest: $(VENV_OLDEST)/.installed
	@$(PY_OLDEST) -c "from importlib.metadata import version as v; \
		print('test-oldest:', *(f'{p}=={v(p)}' for p in ('torch', 'lightning', 'pytorch-lightning', \
		'accelerate', 'transformers', 'torchdata', 'jsonargparse', 'mlflow', 'numpy')))"
	$(PY_OLDEST) -m pip check
	$(PY_OLDEST) -m pytest -q -n 2 --durations=10 $(OLDEST_TESTS)

lint: venv
	$(VENV)/bin/ruff check air_core lightning_air accelerate_air transformers_air tests benchmarks examples compat
	$(VENV)/bin/ruff format --check air_core lightning_air accelerate_air transformers_air tests benchmarks examples compat
	$(VENV)/bin/mypy air_core lightning_air accelerate_air transformers_air

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
	rm -rf $(VENV) $(VENV_OLDEST) .pytest_cache build *.egg-info
