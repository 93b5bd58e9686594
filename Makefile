# The two commands: `make run` (the bridge on a local broker with config/bridge.yaml) and `make test`.
# Needs only Python >= 3.11, Java >= 17 and Maven; everything else is installed here.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= config/bridge.yaml
PYTEST_ARGS ?=
# Tests run this many at a time (pytest-xdist), each worker with a broker of its own: the suite mostly waits on
# brokers, bridges and timeouts, so two workers halve its time on two cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
RUN_ARGS ?=

.PHONY: install kafka run demo test lint faults soak bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is needed")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

# Resolve the Kafka broker jars from Maven Central into ~/.cache/rdq-bridge (once).
kafka: install
	$(BIN)/python -m localkafka fetch

run: kafka
	$(BIN)/python -m localkafka dev --config $(CONFIG) $(RUN_ARGS)

# The first ten minutes: a local broker and bridge, records that succeed, retry and dead-letter, then the SRE's
# commands (stats, get, dlq tail, set-policy, redrive). Uses KAFKA_BOOTSTRAP_SERVERS' broker when it names one.
demo: kafka
	$(BIN)/python -m bridge.cli demo

test: kafka
	$(BIN)/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The fault suite: SIGKILLs, broker outage, full store, hung / lease-leaking / crashing handlers, garbage,
# huge records, bad configs, an old store. Prints a table and appends it to bench/RESULTS.md.
faults: kafka
	$(BIN)/python -m bench.faults $(FAULTS_ARGS)

# The randomized whole-system run, long (by hand; figures in bench/RESULTS.md): three seeds of 15 minutes each.
# FAULTS_SEED=N replays a seed. `make faults FAULTS_ARGS=--nemesis` (as .ci/run does) runs it short, on two seeds.
soak: kafka
	$(BIN)/python -m bench.nemesis --seconds $(or $(SOAK_SECONDS),900) --runs 3

# Benchmarks, each against a baseline measured in the same run (figures appended to bench/RESULTS.md). Every row
# also runs once at a tiny size in `make test` (tests/test_benches.py), so a bench that rots fails CI.
bench: kafka
	$(BIN)/python -m bench.bench_engine all
	$(BIN)/python -m bench.bench_kafka all
	$(BIN)/python -m bench.bench_lowrate
	$(BIN)/python -m bench.bench_changelog all
	$(BIN)/python -m bench.bench_processes all
	$(BIN)/python -m bench.bench_tracing
	$(BIN)/python -m bench.bench_admin
	$(BIN)/python -m bench.bench_console

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .rdq .pytest_cache .mypy_cache .ruff_cache
