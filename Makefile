# agentmesh: set-up, code generation, checks, tests, demo.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PROTOS := $(wildcard proto/mesh/v1/*.proto)
# The suite runs in this many pytest processes (pytest-xdist), a test file to each at a time:
# most tests wait on servers, processes and timers, so two nearly halve its time on two cores.
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: go-client dashboard deploy-check help system-packages setup proto proto-check proto-baseline breaking lint test test-fast demo up bench clean

help:
	@echo "make setup        virtualenv in $(VENV) with agentmesh and its dev tools"
	@echo "make demo         set-up, then run the mesh on localhost and its demo, then shut down"
	@echo "make test         set-up, check generated code, run the whole test suite"
	@echo "make proto        regenerate mesh/v1 from proto/"
	@echo "make lint         ruff, mypy, buf lint and buf format, tsc on the Node client's types"
	@echo "make bench        latency benchmarks (benchmarks/results/)"
	@echo "make deploy-check render and validate the Kubernetes overlays in deploy/"
	@echo "make go-client    build the Go agent and client (clients/go/bin/meshgo)"
	@echo "make dashboard    rebuild the dashboard bundle (gateway/dashboard/static/app.js)"

$(BIN)/agentmesh: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	@touch $@

NODE_DEPS := clients/node/node_modules/.package-lock.json

$(NODE_DEPS): clients/node/package-lock.json
	@if command -v npm >/dev/null; then npm ci --prefix clients/node --no-audit --no-fund --silent; \
	else echo "npm not found: the Node.js client tests will be skipped"; fi

DASHBOARD_DEPS := gateway/dashboard/web/node_modules/.package-lock.json

$(DASHBOARD_DEPS): gateway/dashboard/web/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix gateway/dashboard/web --no-audit --no-fund --silent; \
	else echo "npm not found: the dashboard bundle check will be skipped"; fi

# Debian packages the tests use: redis-server (the Redis store, replicas), chromium and
# chromium-driver (the dashboard in a headless browser). Installed when missing and root.
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	command -v go >/dev/null || missing="$$missing golang-go"; \
	command -v protoc-gen-go >/dev/null || missing="$$missing protoc-gen-go"; \
	command -v protoc-gen-go-grpc >/dev/null || missing="$$missing protoc-gen-go-grpc"; \
	[ -d /usr/share/gocode/src/google.golang.org/grpc/health ] || \
		missing="$$missing golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian packages:$$missing"; \
			{ apt-get update -qq >/dev/null && apt-get install -y -qq $$missing >/dev/null; } || \
				echo "could not install$$missing: the tests that need them will be skipped"; \
		else echo "not installed:$$missing (the tests that need them will be skipped)"; fi; \
	fi

# Rebuilds the dashboard's bundle (gateway/dashboard/static/app.js) from its sources.
dashboard: $(DASHBOARD_DEPS)
	npm run build --prefix gateway/dashboard/web

# The project's own modules compiled to bytecode (pip compiles only what it installs): every
# process the tests, the bench and the demo start imports them, and where
# PYTHONDONTWRITEBYTECODE is set (CI) each would otherwise compile them again, 0.2-0.3 s a
# process. Only what changed since is compiled again.
setup: $(BIN)/agentmesh $(NODE_DEPS) $(DASHBOARD_DEPS)
	@$(PY) -m compileall -q mesh gateway agents benchmarks tests

proto: setup
	PATH="$(abspath $(BIN)):$$PATH" $(PY) -m grpc_tools.protoc -I proto \
		--python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(PROTOS)

# Fails when the committed generated code differs from what proto/ generates.
proto-check: setup
	@tmp=$$(mktemp -d) && \
	PATH="$(abspath $(BIN)):$$PATH" $(PY) -m grpc_tools.protoc -I proto \
		--python_out=$$tmp --grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTOS) && \
	for f in $$tmp/mesh/v1/*; do \
		if ! cmp -s $$f mesh/v1/$$(basename $$f); then \
			echo "mesh/v1/$$(basename $$f) is stale: run 'make proto' and commit"; rm -rf $$tmp; exit 1; \
		fi; \
	done; rm -rf $$tmp; echo "generated code is up to date"

# The contract must stay compatible with the last released one (proto/baseline).
breaking: setup
	$(BIN)/buf breaking --against proto/baseline/mesh-v1.binpb

# After a release: make the current contract the baseline that `breaking` checks against.
proto-baseline: setup
	$(BIN)/buf build -o proto/baseline/mesh-v1.binpb

lint: setup breaking
	$(BIN)/ruff check .
	$(BIN)/mypy mesh agents gateway benchmarks
	$(BIN)/buf lint
	$(BIN)/buf format --exit-code > /dev/null
	@if [ -x clients/node/node_modules/.bin/tsc ]; then \
		npm run --silent typecheck --prefix clients/node && echo "clients/node: declarations check"; fi
	@if command -v gofmt >/dev/null; then test -z "$$(gofmt -l clients/go)" && echo "clients/go: gofmt"; fi

test: setup system-packages proto-check breaking
	$(BIN)/buf lint
	$(BIN)/buf format --exit-code > /dev/null
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	$(BIN)/pytest -q -x -n $(TEST_WORKERS) --dist loadfile -m "not processes"

# The embedded default end to end: `agentmesh up` in the background (free ports), the demo
# against its gateway over gRPC, then a clean shutdown.
demo: setup
	@tmp=$$(mktemp -d); \
	$(BIN)/agentmesh up --port 0 --gateway-port 0 --metrics-port 0 --dashboard-port 0 \
		--ready-file $$tmp/ready.json \
		> $$tmp/up.log 2> $$tmp/mesh.log & pid=$$!; \
	for i in $$(seq 1 150); do [ -s $$tmp/ready.json ] && break; \
		kill -0 $$pid 2>/dev/null || break; sleep 0.2; done; \
	if [ ! -s $$tmp/ready.json ]; then cat $$tmp/up.log $$tmp/mesh.log; kill $$pid 2>/dev/null; exit 1; fi; \
	head -n 3 $$tmp/up.log; \
	gateway=$$($(PY) -c "import json,sys; print(json.load(open(sys.argv[1]))['gateway'])" $$tmp/ready.json); \
	$(BIN)/agentmesh demo --gateway $$gateway; rc=$$?; \
	kill -TERM $$pid; wait $$pid; tail -n 1 $$tmp/up.log; \
	echo "The mesh's log (JSON lines on stderr): $$(grep -c '"category":"handoff"' $$tmp/mesh.log) hand-offs," \
		"$$(grep -c '"category":"gather"' $$tmp/mesh.log) gathers, $$(grep -c '"category":"broadcast"' $$tmp/mesh.log) broadcasts," \
		"$$(grep -c '"level":"WARNING"' $$tmp/mesh.log) warnings."; \
	rm -rf $$tmp; exit $$rc

up: setup
	$(BIN)/agentmesh up

# The Go agent and client (clients/go/bin/meshgo), from Go code generated from proto/.
go-client: setup system-packages
	PYTHON=$(PY) clients/go/build.sh

# Renders every kustomize overlay and validates it strictly against the Kubernetes schemas.
deploy-check: setup
	KUBERNETES_VALIDATE=$(BIN)/kubernetes-validate deploy/check.sh

bench: setup
	@($(PY) -c "import matplotlib" 2>/dev/null && test -x $(BIN)/py-spy) || \
		$(BIN)/pip install --quiet -e ".[dev,bench]"
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
