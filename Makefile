# `make demo`: README command #1 -- install, train the embedded default (profiled), report on the
# profile, train again from the cache.
# `make test`: README command #2 -- install, lint, the docs, the fast tier and the loaded pass.
# `make test-all`: what CI runs (.ci/run) -- `make test`, then the integration tier.
# `make wheels`: every distribution as a wheel in dist/.
PY ?= python3
VENV := .venv
SKIP := $(VENV)/bin/skip
DEMO := runs/demo

.PHONY: demo install test test-all wheels

# Everything the README's next steps name, bar the engines (vLLM, SGLang: docs/install.md): every
# skip role, the trainer and its schedules, profiling, `skip simulate`, the verl bridge's offline
# commands (`skip cache import-verl`: verl itself is not needed) and the docs site (`mkdocs serve`).
install:
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e core -e plugins/rollout -e plugins/async_rollout -e plugins/reward -e plugins/ref_log_prob -e plugins/old_log_prob -e plugins/values -e plugins/trainer -e plugins/one_step_off -e plugins/fully_async -e plugins/arithmetic -e plugins/hf -e 'plugins/profiling[analysis]' -e plugins/simulate -e plugins/verl mkdocs==1.6.1

# Both runs share the cache namespace (project and experiment names), so the second one loads
# every step's rollout the first one dumped; each has its own run directory for the comparison.
demo: install
	rm -rf $(DEMO)
	$(SKIP) run skip.rollout.enable=true skip.rollout.dump_dir=$(DEMO)/cache trainer.default_local_dir=$(DEMO)/generated \
		profiling.enable=true
	$(SKIP) profile report $(DEMO)/generated/profile
	$(SKIP) run skip.rollout.enable=true skip.rollout.dump_dir=$(DEMO)/cache trainer.default_local_dir=$(DEMO)/replayed

# Every distribution, with vLLM's and SGLang's engines on CPU (constraints.txt pins torch's CPU
# wheel; SGLang beside its CUDA-only dependencies, tests/sglang_cpu), then the lint and the docs
# (--strict: a broken link or anchor fails). The fast tier is every test not marked
# `integration`; its loaded pass runs those marked `loaded` beside two busy loops.
test:
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	$(VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mkdocs build --strict -d "$$(mktemp -d)"
	$(VENV)/bin/pytest -m "not integration and not loaded"
	$(VENV)/bin/pytest -m "not integration and loaded" --busy 2

# The runs of every schedule and algorithm, the engines' contract and commands, the bridge inside
# verl, two nodes, several ranks, resume, faults, install and a full disk; its own loaded pass.
test-all: test
	$(VENV)/bin/pytest -m "integration and not loaded"
	$(VENV)/bin/pytest -m "integration and loaded" --busy 2

# Every distribution as a wheel in dist/, for machines without the clone (no package index has them).
wheels:
	rm -rf dist && $(PY) -m pip wheel -q --no-deps -w dist ./core ./plugins/*/
