# Set-up and test entry points (see README). Works on a machine with only Python 3.11, pip and make.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned, so that on a CPU-only machine pip can take the CPU wheel instead of a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow sandbox-deps

$(STAMP): pyproject.toml wal/_stepc.c wal/_commitc.c rollout/_kvread.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,postgres]"
	@$(MAKE) -s sandbox-deps
	touch $(STAMP)

install: $(STAMP)

# bubblewrap isolates sandboxed tool calls and libseccomp compiles their syscall filter; installed where
# we can, reported clearly where we cannot.
sandbox-deps:
	@{ command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q libseccomp.so.2; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null) || echo "postrain: could not install bubblewrap/libseccomp2; sandbox isolation tests will be skipped"; \
	  else echo "postrain: bubblewrap (bwrap) or libseccomp2 not found and not root: install them (apt-get install bubblewrap libseccomp2) for sandbox isolation"; fi; }

run: $(STAMP)
	$(BIN)/postrain pipeline --name default

# The suite on every core (one pytest process per core, a test file's cases in one of them); TEST_WORKERS=0 runs
# it in one process.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow
