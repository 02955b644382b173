# ampx front end. Everything installs what it needs (Debian packages; the
# chroot legs also a cached Debian chroot each: scripts/chroot.sh), then builds
# and runs.
#
#   make run        the main job on today's LibTorch (2.14.1, Debian testing's,
#                   in the forky chroot, made on the first run: about 8
#                   minutes): builds the library and ampx-train only, installs
#                   the datasets, and runs ampx-train comparing fp32, O1 and O2
#                   on the gpt workload (about 10 minutes on 2 cores);
#                   RUN_ARGS adds flags
#   make run-host   the same against the host's LibTorch 1.13 (no chroot)
#   make data       install the datasets only (scripts/install-data.sh)
#   make docs       the API reference from the public headers' comments (Doxygen,
#                   docs/Doxyfile) in build/docs/html/; fails on an undocumented
#                   public symbol or a broken reference (make test-host runs it too)
#   make test       build and run every test on the host, forky and wheel legs
#                   (forky: all but ampx-train's end-to-end tests); a warning in
#                   ampx's code fails the build (AMPX_WARNINGS_AS_ERRORS)
#   make test-host  LibTorch 1.13 (Debian 12, this machine), GCC 12
#   make test-forky LibTorch 2.14 (Debian testing chroot), GCC 16
#   make test-wheel LibTorch 2.15 from PyTorch's own wheel (PyPI, CUDA 13.2
#                   build; scripts/wheel-env.sh), nvcc 13.2: everything
#                   compiled and linked against libtorch_cuda, the tests run on
#                   the CPU, the CUDA ones skip (no GPU)
#   make test-cuda  (not in make test) LibTorch 2.6 built with CUDA (Debian 13
#                   chroot), nvcc 12.4, as test-wheel
#   make sanitize   the whole suite built with AddressSanitizer + UndefinedBehaviorSanitizer
#                   (host leg; build/asan); make sanitize-forky: the same on the 2.14 leg
#   make tsan       the GradScaler, data-parallel and fully sharded tests under ThreadSanitizer (host leg)
#   make soak       the preemption test with 100 signals per mode instead of
#                   make test's 4 (host leg; about 15 minutes)
#   make test-shard-long  ampx-train's sharded O2 runs against DDP's on 2 and 4
#                   ranks, SHARD_LONG_STEPS steps (default 50; host leg)
#   make fuzz       fuzz every reader of outside bytes (tests/fuzz) for FUZZ_SECONDS
#                   each (default 60; host leg); a finding's input lands in build/fuzz/
#   make bench      every benchmark in one run: GEMM peaks, micro-benchmarks,
#                   ampx-train's workloads in every mode (on the wheel, on 1.13, on
#                   2.14) next to the wheel's Python, eager and torch.compile'd, with
#                   the default and the fused AdamW, and Debian's Python 1.13, FP8
#                   against torchao, data parallel, causal attention by shape (on
#                   1.13 and on 2.14, against LibTorch's SDPA); writes the run of
#                   record of this kind of CPU under docs/performance/ and its row
#                   of docs/PERFORMANCE.md (bench/run_all.py; BENCH_ARGS adds flags).
#                   Over an hour on 2 cores with AVX512-BF16; many hours on a CPU
#                   without AVX-512, where Python's bf16 products are a scalar loop
#   make help       this list
#
# The scripts behind them, and the ones for the lent GPU machine:
#   scripts/install-deps.sh, install-data.sh   Debian packages; the datasets
#   scripts/chroot.sh LEG [CMD]                a leg's Debian chroot (forky, cuda)
#   scripts/wheel-env.sh                       PyTorch's wheel, pinned, in a venv
#   scripts/check-skips.py                     a leg's skipped tests against its list
#   scripts/sanitize.sh, check-sanitizer-logs.py   the sanitizer builds and their reports
#   scripts/docs.sh                            the API reference (Doxygen)
#   scripts/device-call.sh                     the GPU proof in one device call:
#     device-run.sh (build, test, bench), device-test.sh (tests only),
#     device-build.sh (the build against the wheel both use),
#     device_report.py (its summary)

JOBS ?= $(shell nproc 2>/dev/null || echo 2)
HOST_BUILD := build/host
FORKY_BUILD := build/forky
CUDA_BUILD := build/cuda
# AMPX_TEST_SHARDS: each GoogleTest binary runs as a few ctest shards, one
# process each, rather than one process per test (cmake/AmpxGTest.cmake).
# AMPX_PRECOMPILE_TORCH: <torch/torch.h> parsed once per build, not once per
# file (cmake/AmpxPrecompileTorch.cmake).
CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DAMPX_WARNINGS_AS_ERRORS=ON -DCMAKE_UNITY_BUILD=ON \
	-DAMPX_TEST_SHARDS=ON -DAMPX_PRECOMPILE_TORCH=ON
# The forky leg builds no benchmarks (the wheel leg compiles them; `make
# bench` builds its own): about 3 minutes of its build. Nor
# ampx-train's end-to-end tests (tests/train: several trainer processes
# each, half of a leg's test time): they run on the host and wheel legs, the
# oldest LibTorch and the one users run, whose 2.15 differs from forky's
# 2.14 in no branch the trainer takes; forky still builds ampx-train itself.
# Three legs fit make test's 45 minutes this way.
FORKY_CMAKE_FLAGS := -DAMPX_BUILD_BENCHMARKS=OFF -DAMPX_BUILD_TRAIN_TESTS=OFF
# The CUDA leg: NCCL required (a missing piece fails the configure). nvcc
# 12.4 takes GCC 13 at most; Debian's nvcc picks g++-13 itself.
# It builds and links everything (ampx-train included) but ampx-train's
# end-to-end tests (tests/train: several trainer processes each), which run
# on the host and wheel legs: on 2.6 they took a third of the leg's time and
# test no CUDA code.
CUDA_CMAKE_FLAGS := -DAMPX_NCCL=ON -DAMPX_BUILD_TRAIN_TESTS=OFF
# The host leg always runs the API reference's test (docs.reference) and the
# structure check (structure): a missing doxygen or Universal Ctags fails its
# configure.
HOST_CMAKE_FLAGS := -DAMPX_REQUIRE_DOCS_TEST=ON -DAMPX_REQUIRE_STRUCTURE_TEST=ON

# The datasets, on the host; the chroot legs see them at the same path.
DATA_DIR := $(or $(AMPX_DATA_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ampx/data)

.PHONY: all help deps data docs build run run-host test test-host test-forky test-wheel test-cuda \
	test-shard-long \
	sanitize sanitize-forky tsan soak fuzz bench clean

all: build

# The header above, as written: one list of targets and scripts.
help:
	@sed -n '/^#   make run /,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

deps:
	@scripts/install-deps.sh

# Configures and builds the host leg: $(call host_build,CMAKE_FLAGS,TARGET)
# (TARGET empty: everything). The configure output is kept in build/host.configure.log.
define host_build
	@mkdir -p build && cmake -S . -B $(HOST_BUILD) $(CMAKE_FLAGS) $(HOST_CMAKE_FLAGS) $(1) > $(HOST_BUILD).configure.log 2>&1 \
	  || { cat $(HOST_BUILD).configure.log; exit 1; }
	@cmake --build $(HOST_BUILD) -j$(JOBS) $(if $(2),--target $(2))
endef

build: deps
	$(call host_build,-DAMPX_BUILD_BENCHMARKS=ON)

data: deps
	@AMPX_DATA_DIR=$(DATA_DIR) scripts/install-data.sh

docs: deps
	@scripts/docs.sh build/docs

# Configures and builds a chroot leg: $(call leg_build,LEG,BUILD_DIR,CMAKE_FLAGS,TARGET)
# (TARGET empty: everything). The configure output is kept in BUILD_DIR.configure.log.
define leg_build
	@mkdir -p build
	scripts/chroot.sh $(1) sh -c 'cmake -S /src -B /src/$(2) $(CMAKE_FLAGS) $(3) > /src/$(2).configure.log 2>&1 \
	  || { cat /src/$(2).configure.log; exit 1; }; cmake --build /src/$(2) -j$(JOBS) $(if $(4),--target $(4))'
endef

MAIN_JOB := --workload gpt --compare fp32,O1,O2
# fp32 matrix products go to OpenBLAS. Its pthreads build (Debian's default)
# fights LibTorch's OpenMP threads for the cores and runs fp32 about 2x slower
# here; the OpenMP build shares LibTorch's thread pool. ampx-train itself
# switches to the OpenMP build at run time when it is installed (its settings
# table says so; AMPX_TRAIN_BLAS=keep opts out), so the choice cannot go stale
# between parsing this file and `deps` installing the package.
run: deps data
	$(call leg_build,forky,$(FORKY_BUILD),$(FORKY_CMAKE_FLAGS),ampx-train)
	AMPX_DATA_DIR=$(DATA_DIR) scripts/chroot.sh forky $(FORKY_BUILD)/apps/ampx-train/ampx-train $(MAIN_JOB) $(RUN_ARGS)

run-host: deps data
	$(call host_build,,ampx-train)
	AMPX_DATA_DIR=$(DATA_DIR) $(HOST_BUILD)/apps/ampx-train/ampx-train $(MAIN_JOB) $(RUN_ARGS)

# The legs' tests, as ampx-train and the benchmarks, multiply fp32 in OpenBLAS's
# OpenMP build where it is installed (a shell command, run where the tests run:
# the host or the chroot, after `deps` installed it). The pthreads build's
# threads fight LibTorch's spinning OpenMP threads: on LibTorch 2.14 they made
# BlockLinearTest.TrainingUnderEachRecipeFollowsFloat32 take 27 s instead of
# 0.9 on 2 cores. ampx-train's own tests still start it on the system's build
# (CompareTest.MakeRunsCommandTrainsFp32OnTheOpenMpBlasWhenItIsInstalled).
OPENMP_BLAS = omp=$$(ls /usr/lib/*/openblas-openmp/libopenblas.so.0 2>/dev/null | head -n 1); \
	if [ -n "$$omp" ]; then export LD_LIBRARY_PATH="$$(dirname "$$omp")$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"; fi

# Each leg also fails when its skipped tests differ from tests/skips/<leg>.txt:
# a broken feature probe must not turn tests into silent skips.
# The host leg compiles no benchmarks: the wheel leg does (its GPU rehearsal
# runs them), and `make bench` builds them here itself (`build`). Eleven
# programs, each a parse of LibTorch's headers: 3.5 of the host leg's 14
# minutes of compiling on 2 cores.
test-host: deps
	$(call host_build,-DAMPX_BUILD_BENCHMARKS=OFF)
	@echo "== ampx tests, LibTorch 1.13 (Debian 12 host) =="
	@rm -rf $(HOST_BUILD)/ctest-junit.xml $(HOST_BUILD)/gtest-xml
	$(OPENMP_BLAS); cd $(HOST_BUILD) && ctest --output-on-failure -j$(JOBS) --output-junit $(CURDIR)/$(HOST_BUILD)/ctest-junit.xml
	@scripts/check-skips.py tests/skips/host-1.13.txt $(HOST_BUILD)/ctest-junit.xml --gtest-xml $(HOST_BUILD)/gtest-xml

# $(call leg_test,LEG,BUILD_DIR)
define leg_test
	@rm -rf $(2)/ctest-junit.xml $(2)/gtest-xml
	scripts/chroot.sh $(1) sh -c '$(OPENMP_BLAS); cd /src/$(2) && ctest --output-on-failure -j$(JOBS) --output-junit /src/$(2)/ctest-junit.xml'
endef

test-forky: deps
	@echo "== ampx tests, LibTorch 2.14 (Debian testing chroot) =="
	$(call leg_build,forky,$(FORKY_BUILD),$(FORKY_CMAKE_FLAGS))
	$(call leg_test,forky,$(FORKY_BUILD))
	@scripts/check-skips.py tests/skips/forky-2.14.txt $(FORKY_BUILD)/ctest-junit.xml --gtest-xml $(FORKY_BUILD)/gtest-xml

# The wheel leg: PyTorch's own wheel (PyPI torch 2.15.0, the CUDA 13.2 build)
# in a virtual environment of Debian's Python (scripts/wheel-env.sh: made on
# the first run, about 3 GB to download, then reused), on this machine.
# Configured by the wheel's own CMake config (torch.utils.cmake_prefix_path),
# with the environment's CMake 3.31 (Debian 12's 3.25 has no C++20 for nvcc)
# and nvcc 13.2 from NVIDIA's wheels: every .cu source compiled, everything
# linked against libtorch_cuda and NCCL's wheel, the tests run on the CPU (the
# CUDA ones skip: no GPU) with the wheel's Python for the reference values.
WHEEL_BUILD := build/wheel
# Its unity build takes every target's sources in reverse order
# (AMPX_UNITY_REVERSED): a source that compiles only after another of its
# batch fails on this leg or on the host's, as it would in a plain build.
WHEEL_CMAKE_FLAGS := -DAMPX_NCCL=ON -DAMPX_UNITY_REVERSED=ON
# Configures and builds the wheel leg: $(call wheel_build,TARGETS) (empty: everything).
define wheel_build
	@scripts/wheel-env.sh --ensure
	@mkdir -p build && bin=$$(scripts/wheel-env.sh --bin) && \
	  $$bin/cmake -S . -B $(WHEEL_BUILD) $(CMAKE_FLAGS) $(WHEEL_CMAKE_FLAGS) $$(scripts/wheel-env.sh --cmake-args) \
	    > $(WHEEL_BUILD).configure.log 2>&1 || { cat $(WHEEL_BUILD).configure.log; exit 1; }; \
	  $$bin/cmake --build $(WHEEL_BUILD) -j$(JOBS) $(if $(1),--target $(1))
endef
test-wheel: deps
	@echo "== ampx tests, LibTorch 2.15 (PyTorch's wheel, CUDA 13.2 build; no GPU) =="
	$(call wheel_build)
	@rm -rf $(WHEEL_BUILD)/ctest-junit.xml $(WHEEL_BUILD)/gtest-xml
	cd $(WHEEL_BUILD) && $$($(CURDIR)/scripts/wheel-env.sh --bin)/ctest --output-on-failure -j$(JOBS) \
	  --output-junit $(CURDIR)/$(WHEEL_BUILD)/ctest-junit.xml
	@scripts/check-skips.py tests/skips/wheel-2.15.txt $(WHEEL_BUILD)/ctest-junit.xml --gtest-xml $(WHEEL_BUILD)/gtest-xml

test-cuda: deps
	@echo "== ampx tests, LibTorch 2.6 with CUDA (Debian 13 chroot, no GPU) =="
	$(call leg_build,cuda,$(CUDA_BUILD),$(CUDA_CMAKE_FLAGS))
	$(call leg_test,cuda,$(CUDA_BUILD))
	@scripts/check-skips.py tests/skips/cuda-2.6.txt $(CUDA_BUILD)/ctest-junit.xml --gtest-xml $(CUDA_BUILD)/gtest-xml

# The forky chroot and the wheel's environment are made (first run) or
# checked in the background while the host leg builds and runs: downloading
# and unpacking overlap compiling. Their legs wait for them (the locks of
# scripts/chroot.sh and scripts/wheel-env.sh) and, should the background run
# have failed, make them again, saying why.
test: deps
	@mkdir -p build
	@echo "ampx: making or checking the forky chroot and the wheel's environment in the background (build/chroots.log, build/wheel-env.log)"
	@(scripts/chroot.sh forky --ensure) > build/chroots.log 2>&1 &
	@(scripts/wheel-env.sh --ensure) > build/wheel-env.log 2>&1 &
	@$(MAKE) --no-print-directory test-host test-forky test-wheel

# Sanitizers (scripts/sanitize.sh; docs/reliability.md, "Sanitizers"): ampx's
# code instrumented, LibTorch not. A run fails on a failing test, on a
# sanitizer report from any process of it (children included), and, as the
# legs of `make test` do, on skips other than the leg's list plus
# tests/skips/sanitizers.txt. Too long for `make test`.
SAN_ENV = CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) CTEST_PARALLEL_LEVEL=$(JOBS)
ASAN_BUILD := build/asan
FORKY_ASAN_BUILD := build/forky-asan
TSAN_BUILD := build/tsan
sanitize: deps
	@echo "== ampx tests under ASan + UBSan, LibTorch 1.13 (Debian 12 host) =="
	$(SAN_ENV) scripts/sanitize.sh asan $(ASAN_BUILD)
	@scripts/check-skips.py tests/skips/host-1.13.txt tests/skips/sanitizers.txt $(ASAN_BUILD)/ctest-junit.xml

sanitize-forky: deps
	@echo "== ampx tests under ASan + UBSan, LibTorch 2.14 (Debian testing chroot) =="
	$(SAN_ENV) scripts/chroot.sh forky scripts/sanitize.sh asan $(FORKY_ASAN_BUILD)
	@scripts/check-skips.py tests/skips/forky-2.14.txt tests/skips/forky-2.14-train.txt \
	  tests/skips/sanitizers.txt $(FORKY_ASAN_BUILD)/ctest-junit.xml

tsan: deps
	@echo "== GradScaler, data-parallel and fully sharded tests under TSan, LibTorch 1.13 (Debian 12 host) =="
	$(SAN_ENV) scripts/sanitize.sh tsan $(TSAN_BUILD)

# ampx-train stopped by SIGTERM/SIGUSR1 at random steps, resumed each time,
# in every mode: the same run bit for bit (tests/train/preemption_test.cpp).
SOAK_SIGNALS ?= 100
soak: build
	AMPX_PREEMPTION_SIGNALS=$(SOAK_SIGNALS) $(HOST_BUILD)/tests/train/ampx_train_tests \
	  --gtest_filter='Modes/PreemptionModeTest.*'

# --shard full, grad and optimizer against DDP for longer than `make test`'s
# 2 ranks and 20 steps (tests/train/shard_test.cpp's O2 test, gpt and gpt-nn):
# 2 and 4 ranks, SHARD_LONG_STEPS steps.
SHARD_LONG_STEPS ?= 50
test-shard-long: build
	for ranks in 2 4; do \
	  AMPX_SHARD_TEST_RANKS=$$ranks AMPX_SHARD_TEST_STEPS=$(SHARD_LONG_STEPS) AMPX_CPU_PRODUCTS=wide \
	    $(HOST_BUILD)/tests/train/ampx_train_tests \
	    --gtest_filter='ShardTest.O2TrainsDdpsRunToTheRoundingOfTheAveragedGradients' || exit 1; \
	done

# A seeded mutation fuzzer (tests/fuzz/fuzz_driver.cpp): each target in turn,
# FUZZ_SECONDS each, over its seeds; the targets and their seed folders are
# targets.cpp's (`ampx_fuzz list`), as ctest's fuzz tests take them.
FUZZ_SECONDS ?= 60
FUZZ := $(CURDIR)/$(HOST_BUILD)/tests/fuzz/ampx_fuzz
fuzz: build
	@mkdir -p build/fuzz && cd build/fuzz && $(FUZZ) list > targets.txt && \
	while read -r t corpus; do \
	  $(FUZZ) run $$t $(CURDIR)/tests/fuzz/corpus/$$corpus $(FUZZ_SECONDS) < /dev/null || exit 1; \
	done < targets.txt

# The benchmarks' PyTorch runs load OpenBLAS through Python's torch: the
# OpenMP build goes first on LD_LIBRARY_PATH here, tested when the recipe runs
# (after `deps`), not when make parses this file.
# The attention-by-shape benchmark also runs on today's LibTorch (2.14, the
# forky chroot), where LibTorch has its own SDPA to compare against: only that
# program is built there (build/forky-bench).
FORKY_BENCH_BUILD := build/forky-bench
FORKY_BENCH_CMAKE_FLAGS := -DAMPX_BUILD_TESTS=OFF -DAMPX_BUILD_EXAMPLES=OFF -DAMPX_BUILD_TRAIN=OFF \
	-DAMPX_BUILD_BENCHMARKS=ON

# The main anchor is PyTorch's wheel (issue 39): ampx-train built against it
# (the wheel leg's build) beside its Python, eager and torch.compile'd, with the
# default and the fused AdamW (issue 67); and ampx-train on LibTorch 2.14 (the
# forky leg's build) for the 2.14 target.
bench: build data
	$(call leg_build,forky,$(FORKY_BENCH_BUILD),$(FORKY_BENCH_CMAKE_FLAGS),ampx_attention_bench)
	$(call leg_build,forky,$(FORKY_BUILD),$(FORKY_CMAKE_FLAGS),ampx-train)
	$(call wheel_build,ampx-train ampx_gemm_peak ampx_fp8_bench)
	@$(OPENMP_BLAS); \
	args="--wheel-build $(WHEEL_BUILD) --wheel-python $$(scripts/wheel-env.sh --python) $(BENCH_ARGS)"; \
	echo "LD_LIBRARY_PATH=$$LD_LIBRARY_PATH bench/run_all.py $$args"; \
	bench/run_all.py $$args

clean:
	rm -rf build
