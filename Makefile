# ampx front end. Everything installs what it needs (Debian packages; the
# LibTorch 2.6 leg also a cached Debian 13 chroot), then builds and runs.
#
#   make run        build against the host's LibTorch, install the datasets and run
#                   the main job: ampx-train comparing fp32, O1 and O2 on the gpt
#                   workload (about 5 minutes on 2 cores); RUN_ARGS adds flags
#   make data       install the datasets only (scripts/install-data.sh)
#   make test       build and run every test on both LibTorch legs
#   make test-host  LibTorch 1.13 (Debian 12, this machine) only
#   make test-2x    LibTorch 2.6 (Debian 13 chroot) only
#   make sanitize   the whole suite built with AddressSanitizer + UndefinedBehaviorSanitizer
#                   (host leg; build/asan); make sanitize-2x: the same on the 2.6 leg
#   make tsan       the GradScaler and data-parallel tests under ThreadSanitizer (host leg)
#   make fuzz       fuzz every reader of outside bytes (tests/fuzz) for FUZZ_SECONDS
#                   each (default 60; host leg); a finding's input lands in build/fuzz/
#   make bench      every benchmark in one run (host leg, about 25 minutes): GEMM
#                   peaks, micro-benchmarks, ampx-train's workloads in every mode next to
#                   PyTorch's torch.autocast, data parallel; writes docs/PERFORMANCE.md
#                   and docs/performance.json (bench/run_all.py; BENCH_ARGS adds flags)

JOBS ?= $(shell nproc 2>/dev/null || echo 2)
HOST_BUILD := build/host
TRIXIE_BUILD := build/trixie
CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release

.PHONY: all deps data build run test test-host test-2x sanitize sanitize-2x tsan fuzz bench clean

all: build

deps:
	@scripts/install-deps.sh

build: deps
	@mkdir -p build && cmake -S . -B $(HOST_BUILD) $(CMAKE_FLAGS) > $(HOST_BUILD).configure.log 2>&1 \
	  || { cat $(HOST_BUILD).configure.log; exit 1; }
	@cmake --build $(HOST_BUILD) -j$(JOBS)

data: deps
	@scripts/install-data.sh

MAIN_JOB := --workload gpt --compare fp32,O1,O2
# fp32 matrix products go to OpenBLAS. Its pthreads build (Debian's default)
# fights LibTorch's OpenMP threads for the cores and runs fp32 about 2x slower
# here; the OpenMP build shares LibTorch's thread pool. ampx-train itself
# switches to the OpenMP build at run time when it is installed (its settings
# table says so; AMPX_TRAIN_BLAS=keep opts out), so the choice cannot go stale
# between parsing this file and `deps` installing the package.
run: build data
	$(HOST_BUILD)/apps/ampx-train/ampx-train $(MAIN_JOB) $(RUN_ARGS)

# Each leg also fails when its skipped tests differ from tests/skips/<leg>.txt:
# a broken feature probe must not turn tests into silent skips.
test-host: build
	@echo "== ampx tests, LibTorch 1.13 (Debian 12 host) =="
	@rm -f $(HOST_BUILD)/ctest-junit.xml
	cd $(HOST_BUILD) && ctest --output-on-failure -j$(JOBS) --output-junit $(CURDIR)/$(HOST_BUILD)/ctest-junit.xml
	@scripts/check-skips.py tests/skips/host-1.13.txt $(HOST_BUILD)/ctest-junit.xml

test-2x: deps
	@echo "== ampx tests, LibTorch 2.6 (Debian 13 chroot) =="
	scripts/trixie.sh bash -c 'cmake -S /src -B /src/$(TRIXIE_BUILD) $(CMAKE_FLAGS) >/dev/null \
	  && cmake --build /src/$(TRIXIE_BUILD) -j$(JOBS) \
	  && rm -f /src/$(TRIXIE_BUILD)/ctest-junit.xml \
	  && cd /src/$(TRIXIE_BUILD) && ctest --output-on-failure -j$(JOBS) --output-junit /src/$(TRIXIE_BUILD)/ctest-junit.xml'
	@scripts/check-skips.py tests/skips/trixie-2.6.txt $(TRIXIE_BUILD)/ctest-junit.xml

test: test-host test-2x

# Sanitizers (scripts/sanitize.sh; docs/reliability.md, "Sanitizers"): ampx's
# code instrumented, LibTorch not. A run fails on a failing test, on a
# sanitizer report from any process of it (children included), and, as the
# legs of `make test` do, on skips other than the leg's list plus
# tests/skips/sanitizers.txt. Too long for `make test`.
SAN_ENV = CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) CTEST_PARALLEL_LEVEL=$(JOBS)
ASAN_BUILD := build/asan
TRIXIE_ASAN_BUILD := build/trixie-asan
TSAN_BUILD := build/tsan
sanitize: deps
	@echo "== ampx tests under ASan + UBSan, LibTorch 1.13 (Debian 12 host) =="
	$(SAN_ENV) scripts/sanitize.sh asan $(ASAN_BUILD)
	@scripts/check-skips.py tests/skips/host-1.13.txt tests/skips/sanitizers.txt $(ASAN_BUILD)/ctest-junit.xml

sanitize-2x: deps
	@echo "== ampx tests under ASan + UBSan, LibTorch 2.6 (Debian 13 chroot) =="
	$(SAN_ENV) scripts/trixie.sh scripts/sanitize.sh asan $(TRIXIE_ASAN_BUILD)
	@scripts/check-skips.py tests/skips/trixie-2.6.txt tests/skips/sanitizers.txt $(TRIXIE_ASAN_BUILD)/ctest-junit.xml

tsan: deps
	@echo "== GradScaler and data-parallel tests under TSan, LibTorch 1.13 (Debian 12 host) =="
	$(SAN_ENV) scripts/sanitize.sh tsan $(TSAN_BUILD)

# A seeded mutation fuzzer (tests/fuzz/fuzz_driver.cpp): each target in turn,
# FUZZ_SECONDS each; the checkpoint_crc target mutates the checkpoint seeds.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := checkpoint checkpoint_crc checkpoint_state state_dict zero_shard idx text launch_env
fuzz: build
	@mkdir -p build/fuzz && cd build/fuzz && for t in $(FUZZ_TARGETS); do \
	  corpus=$(CURDIR)/tests/fuzz/corpus/$$t; \
	  if [ $$t = checkpoint_crc ]; then corpus=$(CURDIR)/tests/fuzz/corpus/checkpoint; fi; \
	  $(CURDIR)/$(HOST_BUILD)/tests/fuzz/ampx_fuzz run $$t $$corpus $(FUZZ_SECONDS) || exit 1; \
	done

# The benchmarks' PyTorch runs load OpenBLAS through Python's torch: the
# OpenMP build goes first on LD_LIBRARY_PATH here, tested when the recipe runs
# (after `deps`), not when make parses this file.
bench: build data
	@omp=$$(ls /usr/lib/*/openblas-openmp/libopenblas.so.0 2>/dev/null | head -n 1); \
	if [ -n "$$omp" ]; then export LD_LIBRARY_PATH="$$(dirname "$$omp")$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"; fi; \
	echo "LD_LIBRARY_PATH=$$LD_LIBRARY_PATH bench/run_all.py $(BENCH_ARGS)"; \
	bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf build
