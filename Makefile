# eventline: run `make help` for the targets.
GO         ?= go
TIMEOUT    ?= 30m
KAFKA_PORT ?= 9092

# Each of the repository's Go modules builds with its own go.mod, even when
# a developer's go.work joins them.
export GOWORK := off

.DEFAULT_GOAL := help
.PHONY: help test test-kafka kafka demo bench bench-quick lint postgres

help: ## Show the targets.
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

postgres: ## Start (and on a fresh Debian machine, install) the local PostgreSQL.
	@./.ci/ensure-postgres

# The command (cmd/eventline) and the benchmark harness (cmd/eventline-bench)
# are modules of their own, so ./... from the root leaves them out: their
# tests run in their directories.
CLI_DIR   = cmd/eventline
BENCH_DIR = cmd/eventline-bench

test: postgres ## Run every test with -race against PostgreSQL and in-process Kafka (kfake).
	$(GO) test -race -count=1 -timeout $(TIMEOUT) ./...
	cd $(CLI_DIR) && $(GO) test -race -count=1 -timeout $(TIMEOUT) ./...
	cd $(BENCH_DIR) && $(GO) test -race -count=1 -timeout $(TIMEOUT) ./...

# The broker runner (a developer tool of the benchmark harness's module),
# built into the git-ignored cache and exec'd, so that Ctrl-C reaches it
# directly and stops it cleanly.
KAFKA_BROKER = (cd $(BENCH_DIR) && $(GO) build -o ../../.cache/kafka-broker ./kafka-broker) && exec .cache/kafka-broker

test-kafka: postgres ## Run the Kafka-facing tests against Apache Kafka 4.4 (Java 17+, Maven; about 8 minutes here).
	$(KAFKA_BROKER) -port 0 -- ./.ci/test-kafka

kafka: ## Run Apache Kafka 4.4 in the foreground on 127.0.0.1:9092 (KAFKA_PORT=n to change, 0 for a free port); Ctrl-C stops it.
	$(KAFKA_BROKER) -port $(KAFKA_PORT)

demo: postgres ## Run the end-to-end orders demo (in-process Kafka unless KAFKA_BROKERS is set).
	$(GO) run ./examples/orders

bench: postgres ## Run the full benchmark suite (about 11 minutes on 2 cores).
	cd $(BENCH_DIR) && $(GO) run .

bench-quick: postgres ## Run a smaller benchmark suite (about 3 minutes).
	cd $(BENCH_DIR) && $(GO) run . -quick

lint: ## gofmt, go vet, and golangci-lint when installed.
	@test -z "$$(gofmt -l .)" || (gofmt -l . && exit 1)
	$(GO) vet ./...
	cd $(CLI_DIR) && $(GO) vet ./...
	cd $(BENCH_DIR) && $(GO) vet ./...
	@if command -v golangci-lint >/dev/null 2>&1; then golangci-lint run ./... && (cd $(CLI_DIR) && golangci-lint run --config ../../.golangci.yml ./...) && cd $(BENCH_DIR) && golangci-lint run --config ../../.golangci.yml ./...; else echo "golangci-lint not installed; skipped"; fi
