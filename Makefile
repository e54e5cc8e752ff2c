# The two commands that matter (README): `make reproduce` runs every notebook through papermill,
# `make test` runs the tests. Both create/refresh the virtual environment first (scripts/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup reproduce test gpu-run clean-venv

setup:
	@bash scripts/setup_env.sh $(VENV)

reproduce: setup
	$(VENV)/bin/glm5lab notebooks run

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# on a CUDA machine: the whole GPU measurement in one call (scripts/gpu_run.sh; PARTS="tests bench" for some parts)
gpu-run:
	bash scripts/gpu_run.sh $(PARTS)

clean-venv:
	rm -rf $(VENV)
