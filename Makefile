# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: certs demo cluster-demo dashboard-shot slurm-demo test test-fast test-loaded lint typecheck pytest bench bench-refresh bench-quick bench-cluster bench-standby bench-simreal soak soak-parallel soak-relayout soak-zero soak-store soak-cluster test-long clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build that lies on this machine's disk
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# a coordinator and three agents in network namespaces (root + iproute2; else loopback)
cluster-demo: $(STAMP)
	$(BIN)/python examples/cluster_demo.py

# the README's dashboard picture: the browser test's last screenshot (needs chromium and
# chromium-driver from the distribution)
dashboard-shot: $(STAMP)
	mkdir -p docs/img
	UNICRON_DASHBOARD_PNG=docs/img/dashboard.png $(BIN)/pytest -q \
		tests/test_dashboard.py::test_the_page_shows_a_running_task_and_a_node_lost_and_back
# a real Slurm on this machine (root; apt-installs slurm-wlm and munge if missing): slurmctld,
# three slurmd in network namespaces, the sbatch example trains, loses a node, heals; a job
# requeued mid-run goes on from its checkpoint (~4 min)
slurm-demo: $(STAMP)
	$(BIN)/python examples/slurm_demo.py

SRC := unicron tests bench examples

# a test CA and the coordinator's certificate for HOST, in CERTS (docs/security.md, TLS):
# unicron coordinator --tls-cert CERTS/coordinator.pem --tls-key CERTS/coordinator.key;
# clients: --ca-file CERTS/ca.pem (or UNICRON_CA_FILE). A production CA is yours to bring.
CERTS ?= certs
HOST ?= 127.0.0.1
certs:
	@mkdir -p $(CERTS) && chmod 700 $(CERTS)
	@case "$(HOST)" in *[!0-9.]*) san="DNS:$(HOST)";; *) san="IP:$(HOST)";; esac; \
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
		-subj "/CN=unicron test CA" -keyout $(CERTS)/ca.key -out $(CERTS)/ca.pem 2>/dev/null && \
	openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$(HOST)" \
		-keyout $(CERTS)/coordinator.key -out $(CERTS)/coordinator.csr 2>/dev/null && \
	printf 'subjectAltName=%s,DNS:localhost\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid\n' "$$san" \
		> $(CERTS)/coordinator.ext && \
	openssl x509 -req -in $(CERTS)/coordinator.csr -CA $(CERTS)/ca.pem -CAkey $(CERTS)/ca.key \
		-CAcreateserial -days 365 -extfile $(CERTS)/coordinator.ext \
		-out $(CERTS)/coordinator.pem 2>/dev/null && \
	chmod 600 $(CERTS)/*.key && echo "$(CERTS)/ca.pem, $(CERTS)/coordinator.pem (.key) for $$san"

lint: $(STAMP)
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)

typecheck: $(STAMP)
	$(BIN)/mypy

# every test but the long scenarios (CI: under 10 minutes on a 2-core machine). Each test
# has pytest-timeout's bound; the whole run has one too, which also ends a run that nothing
# inside it can end (a test once SIGSTOPped pytest itself: CI waited out its 90 minutes)
SUITE_LIMIT_S ?= 1800
pytest: $(STAMP)
	timeout --kill-after=30 $(SUITE_LIMIT_S) $(BIN)/pytest -q -m "not long" --durations=15 $(PYTEST_ARGS) \
	  || { rc=$$?; [ $$rc -ne 124 ] || echo "the suite ran past $(SUITE_LIMIT_S) s: stopped"; exit $$rc; }

test: lint typecheck pytest

# the long scenarios that `make test` leaves out (variants of the ones it runs; the
# dashboard's browser test wants the distribution's chromium and chromium-driver): ~7 min
test-long: $(STAMP)
	$(BIN)/pytest -q -m long $(PYTEST_ARGS)

# the tests not marked e2e (no real processes, clusters or process groups) nor long, on
# FAST_WORKERS processes (pytest-xdist: no test shares a port, a file or a cache with
# another): under 2 minutes
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(BIN)/pytest -q -n $(FAST_WORKERS) -m "not e2e and not long" $(PYTEST_ARGS)

# the end-to-end tests beside BURNERS (default 2) processes spinning on the CPU, RUNS times
# (default 1): a slower machine than CI's, to find the races a test would lose there (a
# stop's CI run is one try). ~10-13 min a run on 2 cores; each run's tail goes to
# $(LOADED_LOG) (one line per run: when, exit code, the commit and the git tree of unicron/,
# pytest's summary; runs of one product across sessions share the tree), a failed run's test
# directories (event logs, worker logs and stack dumps) are kept under $(LOADED_LOG).tmpN,
# and the target fails if any run did.
BURNERS ?= 2
RUNS ?= 1
LOADED_LOG ?= runs/loaded.txt
LOADED_ARGS ?= -m "e2e and not long"
test-loaded: $(STAMP)
	@mkdir -p $(dir $(LOADED_LOG)); pids=""; for i in $$(seq $(BURNERS)); do \
		$(BIN)/python -c 'while True: pass' & pids="$$pids $$!"; done; \
	trap '[ -z "$$pids" ] || kill $$pids' EXIT; failed=0; for run in $$(seq $(RUNS)); do \
		start=$$(date -u +%FT%TZ); \
		rm -rf $(LOADED_LOG).tmp$$run; \
		$(BIN)/pytest -q -p no:cacheprovider --basetemp=$(LOADED_LOG).tmp$$run $(LOADED_ARGS) \
		  $(PYTEST_ARGS) > $(LOADED_LOG).run$$run 2>&1; \
		rc=$$?; [ $$rc -eq 0 ] && rm -rf $(LOADED_LOG).tmp$$run || failed=$$((failed + 1)); \
		echo "run $$run $$start rc=$$rc $$(git rev-parse --short HEAD)" \
		  "unicron=$$(git rev-parse --short HEAD:unicron) $$(tail -n 1 $(LOADED_LOG).run$$run)" \
		  | tee -a $(LOADED_LOG); \
		grep '^FAILED' $(LOADED_LOG).run$$run | tee -a $(LOADED_LOG); \
	done; echo "$(RUNS) run(s) beside $(BURNERS) burner(s): $$failed failed"; [ $$failed -eq 0 ]

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	# torchft is optional: without it the suite reports its rows as failed and goes on
	-$(BIN)/pip install -q -e '.[bench]' && touch $(BENCH_STAMP)

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m bench --quick

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench

# every benchmark once on the committed code, those not measured on it yet (hours; bench/refresh.py)
bench-refresh: $(BENCH_STAMP)
	$(BIN)/python -m bench.refresh

# the cluster: coordinator kill -9, the service under load (a 10-minute soak), node loss
# (bench/cluster; SOAK_S=60 for a shorter soak)
bench-cluster: $(BENCH_STAMP)
	$(BIN)/python -m bench.cluster $(if $(SOAK_S),--soak-s $(SOAK_S))

# a standby coordinator taking over from 10 lost leader hosts (etcd: apt-get install
# etcd-server; root and iproute2 for the namespaces; ~6 min)
bench-standby: $(BENCH_STAMP)
	$(BIN)/python -m bench.standby

# one scenario on a real cluster (planner, keep, equal placements; ~12 min) and in the
# simulator with the constants measured there (bench/simreal.py, docs/simulator.md)
bench-simreal: $(STAMP)
	$(BIN)/python -m bench.simreal

# about 100 mixed faults in one run, bit-exact against the fault-free run (bench/chaos.py)
soak: $(STAMP)
	$(BIN)/python -m bench.chaos

# the same on tensor-parallel replicas (TP=2 x DP=2: a fault takes a replica out of the step)
soak-parallel: $(STAMP)
	$(BIN)/python -m bench.chaos --tp 2

# TP=2 x PP=2 x DP=2 on 8 workers that may run at PP=1: exclusions change the layout
soak-relayout: $(STAMP)
	$(BIN)/python -m bench.chaos --tp 2 --pp 2 --pp-choices 1 --workers 8

soak-zero: $(STAMP)
	$(BIN)/python -m bench.chaos --zero

# the same with the training store's process killed among the faults (kill -9 by the driver)
soak-store: $(STAMP)
	$(BIN)/python -m bench.chaos --store

# a thousand faults on a namespace cluster: 3 tasks, 4 agents, a leader and a standby
# coordinator (etcd); agents killed, links cut, the store and the leader killed (~45 min)
soak-cluster: $(STAMP)
	$(BIN)/python -m bench.soak_cluster

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
