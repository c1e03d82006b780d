# PageKV: the only commands a user needs.
#   make run    install deps if missing, build (release), run the demo
#   make test   same set-up, then the whole suite (release), and again under ASan+UBSan
#   make bench  microbenchmarks (never part of make test)
SHELL := /bin/bash
JOBS ?= $(shell nproc)
PAGEKV := build/release/bin/pagekv

.PHONY: all deps build run test test-release test-asan test-tsan bench clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	@cmake --preset release >/dev/null
	cmake --build build/release -j $(JOBS)

PROMPT := Once upon a time there was a little girl named Lily.
run: build
	@model=$$(bash scripts/find-model.sh); \
	if [ -n "$$model" ]; then \
	  echo "== pagekv generate: stories260K, three prompts sharing a prefix, one batch"; \
	  $(PAGEKV) generate --model "$$model" --prompt "$(PROMPT) She" --prompt "$(PROMPT) One day" \
	    --prompt "$(PROMPT) Her mom" -n 48 --block-len 8; \
	else \
	  echo "== no model available: skipping pagekv generate (see README, Models and data)"; \
	fi
	@echo
	@echo "== pagekv plan: the per-head worked example, then DeepSeek-V3's MLA cache"
	$(PAGEKV) plan --preset seed-deepseek-v3 --explain
	@echo
	$(PAGEKV) plan --preset deepseek-v3 --dtype bf16 --budget 24GiB --seq-len 32768
	@echo
	@echo "== pagekv demo: a few hundred sequences through one pool"
	$(PAGEKV) demo --report-every 500

test: test-release test-asan

test-release: build
	ctest --test-dir build/release --output-on-failure -j $(JOBS)

test-asan: deps
	@cmake --preset asan >/dev/null
	cmake --build build/asan -j $(JOBS)
	ctest --test-dir build/asan --output-on-failure -j $(JOBS)

# libgomp is not instrumented: TSan must ignore it (see CMakePresets.json).
test-tsan: deps
	@cmake --preset tsan >/dev/null
	cmake --build build/tsan -j $(JOBS)
	ctest --preset tsan -j $(JOBS)

bench: build
	@set -e; for b in build/release/src/*/pagekv_*_bench; do \
	  echo "== $$b"; $$b --benchmark_counters_tabular=true; \
	done

clean:
	rm -rf build
