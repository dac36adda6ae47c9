# mok — build: `make` (in parallel; libmok.so, libmok.a, build/mok, build/mok_mp_rank), `make test`, `make sanitize`,
# `make fuzz`, `make run`.
# The CUDA backend is compiled in when nvcc is on PATH (override with CUDA=0 or CUDA=1).

# Parallel by default: one job per core. A -jN on the command line wins, and a make started by
# this one (sanitize) shares its parent's jobs instead of adding its own.
ifeq ($(MAKELEVEL)$(filter -j%,$(MAKEFLAGS)),0)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
endif

BUILD    ?= build
CC       ?= cc
NVCC     ?= nvcc
CUDA     ?= $(if $(and $(shell command -v $(NVCC) 2>/dev/null),$(wildcard src/cuda/megakernel/forward.cu)),1,0)
SAN      ?=
OPT      ?= -O2
CFLAGS   += -std=c11 $(OPT) -g -Wall -Wextra -Wno-unused-parameter -fPIC -pthread -ffp-contract=off \
            -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -Iinclude -Isrc $(SAN)
LDLIBS   += -lpthread -lm
NVFLAGS  ?= -std=c++17 -O3 -g -lineinfo -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a \
            -Iinclude -Isrc --expt-relaxed-constexpr -fmad=true -diag-suppress 177,550
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))

# src/cuda/tuning.c is plain C, in every build: the cuda backend's tuning table and mok_workspace_tuning.
# src/cuda/ops.c, plain C too, is the cuda backend's table of entry points: only with CUDA.
LIB_C    := $(wildcard src/*.c src/core/*.c src/cpu/*.c src/ref/*.c) src/cuda/tuning.c \
            $(if $(filter 1,$(CUDA)),src/cuda/ops.c,)
LIB_CU   := $(if $(filter 1,$(CUDA)),$(wildcard src/cuda/*.cu src/cuda/*/*.cu),)
TOOL_C   := $(wildcard tools/*.c)
# tests/mp_rank.c is a program of its own (one rank of a multi-process group), not part of the suite.
MP_C     := tests/mp_rank.c
TEST_C   := $(filter-out $(MP_C),$(wildcard tests/*.c))

# NCCL_HOME: a folder with include/nccl.h and lib/libnccl.so.2 (e.g. PyTorch's nvidia/nccl); the
# device API must be compiled against the NCCL that runs. Empty: the CUDA toolkit's copy.
NCCL_HOME ?=
# NO_TRACE=1: the kernels without the trace's code (config.trace is refused), to measure what
# tracing off costs; build it into its own folder, e.g. `make CUDA=1 NO_TRACE=1 BUILD=build-notrace`.
NO_TRACE ?= 0
ifeq ($(CUDA),1)
NCCL_FLAGS := $(if $(NCCL_HOME),-I$(NCCL_HOME)/include,)
comma    := ,
NCCL_LINK  := $(if $(NCCL_HOME),-L$(NCCL_HOME)/lib -Wl$(comma)-rpath$(comma)$(NCCL_HOME)/lib -l:libnccl.so.2,-lnccl)
CFLAGS   += -DMOK_HAVE_CUDA=1 $(NCCL_FLAGS) -I$(CUDA_HOME)/include
LDLIBS   += $(NCCL_LINK) -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++ -ldl
NVFLAGS  += -DMOK_HAVE_CUDA=1 $(NCCL_FLAGS) $(if $(filter 1,$(NO_TRACE)),-DMOK_CUDA_NO_TRACE,)
endif

LIB_OBJ  := $(LIB_C:%.c=$(BUILD)/obj/%.o) $(LIB_CU:%.cu=$(BUILD)/obj/%.o)
TOOL_OBJ := $(TOOL_C:%.c=$(BUILD)/obj/%.o)
TEST_OBJ := $(TEST_C:%.c=$(BUILD)/obj/%.o)
MP_OBJ   := $(MP_C:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/tests/layer.o

.PHONY: all test sanitize fuzz run clean
all: $(BUILD)/libmok.so $(BUILD)/libmok.a $(BUILD)/mok $(BUILD)/mok_mp_rank

$(BUILD)/obj/%.o: %.c include/mok.h $(wildcard src/*.h src/core/*.h src/core/*.inc src/cuda/*.h src/cpu/*.h src/ref/*.h tools/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# ptxas's report (-v) is kept beside each object (.ptxas); a "Potential Performance Loss" in it
# (wgmma serialised: C7512-C7515) fails the build, since it slows every GEMM while the results
# stay right.
$(BUILD)/obj/%.o: %.cu include/mok.h $(wildcard src/*.h src/core/*.h src/core/*.inc src/cuda/*.h src/cuda/*.cuh src/cuda/*/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xptxas -v -c $< -o $@ 2>$@.ptxas || { cat $@.ptxas >&2; exit 1; }
	@grep -vE '^ptxas info|bytes stack frame|^$$' $@.ptxas >&2 || true
	@if grep -q 'Performance Loss' $@.ptxas; then grep 'Performance Loss' $@.ptxas >&2; rm -f $@; exit 1; fi

$(BUILD)/libmok.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libmok.so: $(LIB_OBJ)
	$(CC) -shared $(SAN) -o $@ $^ $(LDLIBS)

$(BUILD)/mok: $(TOOL_OBJ) $(BUILD)/libmok.a
	$(CC) $(SAN) -o $@ $(TOOL_OBJ) $(BUILD)/libmok.a $(LDLIBS)

$(BUILD)/mok_tests: $(TEST_OBJ) $(BUILD)/libmok.a
	$(CC) $(SAN) -o $@ $(TEST_OBJ) $(BUILD)/libmok.a $(LDLIBS)

# One rank of a multi-process group (scripts/gpu-check.sh runs EP2 under compute-sanitizer as two);
# in a build without CUDA it says so and exits 3.
$(BUILD)/mok_mp_rank: $(MP_OBJ) $(BUILD)/libmok.a
	$(CC) $(SAN) -o $@ $(MP_OBJ) $(BUILD)/libmok.a $(LDLIBS)

# The test command of the README: every C test, then the command's own checks, then the Python
# binding's tests when numpy is importable. Closing line: `N passed, N failed`.
test: all $(BUILD)/mok_tests
	./scripts/run-tests.sh $(BUILD)

# The same suite built with AddressSanitizer and UndefinedBehaviorSanitizer (no CUDA).
sanitize:
	$(MAKE) BUILD=build-san CUDA=0 OPT=-O1 SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
	    build-san/mok build-san/mok_tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 MOK_TEST_QUICK=1 ./build-san/mok_tests

# The API fuzzer (tests/fuzz/fuzz_api.c says what it tries and how it judges): libFuzzer with
# AddressSanitizer and UndefinedBehaviorSanitizer, built by clang from the library's C sources (cpu
# backend) and tests/layer.c's reference comparison. It runs FUZZ_SECONDS over a working corpus
# seeded from tests/fuzz/corpus (which it leaves as it is) and fails on any finding: a crash, a
# sanitizer report, a run past FUZZ_TIMEOUT seconds, a result that disagrees with the reference.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 120
FUZZ_TIMEOUT ?= 60
FUZZ_DIR     := $(BUILD)/fuzz
FUZZ_SRC     := $(wildcard src/*.c src/core/*.c src/cpu/*.c src/ref/*.c) tests/layer.c tests/fuzz/fuzz_api.c
# Not coverage-guided (sanitizers only, -O2): the reference, the comparison and the GEMM loops, whose
# edges say nothing about the API's paths and whose instrumentation would take most of the time.
FUZZ_PLAIN   := src/ref/ref.c tests/layer.c src/cpu/tiles.c
FUZZ_BASE    := -std=c11 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
                -ffp-contract=off -pthread -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -Iinclude -Isrc -Itests

$(FUZZ_DIR)/fuzz_api: $(FUZZ_SRC) include/mok.h $(wildcard src/*.h src/core/*.h src/cpu/*.h src/ref/*.h tests/*.h)
	@mkdir -p $(FUZZ_DIR)/plain
	for f in $(FUZZ_PLAIN); do $(FUZZ_CC) $(FUZZ_BASE) -O2 -c $$f -o $(FUZZ_DIR)/plain/$$(basename $$f .c).o || exit 1; done
	$(FUZZ_CC) $(FUZZ_BASE) -O1 -fsanitize=fuzzer $(filter-out $(FUZZ_PLAIN),$(FUZZ_SRC)) \
	    $(patsubst %.c,$(FUZZ_DIR)/plain/%.o,$(notdir $(FUZZ_PLAIN))) -o $@ -lm

fuzz: $(FUZZ_DIR)/fuzz_api
	@mkdir -p $(FUZZ_DIR)/corpus
	$(FUZZ_DIR)/fuzz_api -max_total_time=$(FUZZ_SECONDS) -timeout=$(FUZZ_TIMEOUT) -rss_limit_mb=4096 \
	    -artifact_prefix=$(FUZZ_DIR)/ -print_final_stats=1 $(FUZZ_DIR)/corpus tests/fuzz/corpus

# The README's first run: DeepSeek-V3's layer scaled by 16 (E 16 and k 8 kept, the shared expert
# too) on four ranks, checked against the reference.
run: all
	./$(BUILD)/mok run --preset deepseek-v3 --scale 16 --ranks 4 --check --backend auto

clean:
	rm -rf build build-san
