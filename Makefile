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

clean-venv:
	rm -rf $(VENV)
