PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test install demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,hf,tools]'
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q -x tests

demo: install
	@echo "make demo arrives with the model zoo (issue 3): there is no trained model in the repo yet."
	@exit 1

clean:
	rm -rf $(VENV) build *.egg-info
