# eventline: run `make help` for the targets.
GO      ?= go
TIMEOUT ?= 30m

.DEFAULT_GOAL := help
.PHONY: help test demo bench bench-quick lint postgres

help: ## Show the targets.
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

postgres: ## Start (and on a fresh Debian machine, install) the local PostgreSQL.
	@./.ci/ensure-postgres

test: postgres ## Run every test with -race against PostgreSQL and in-process Kafka (kfake).
	$(GO) test -race -count=1 -timeout $(TIMEOUT) ./...

demo: postgres ## Run the end-to-end orders demo (in-process Kafka unless KAFKA_BROKERS is set).
	$(GO) run ./examples/orders

bench: postgres ## Run the full benchmark suite (several minutes).
	$(GO) run ./cmd/eventline-bench

bench-quick: postgres ## Run a smaller benchmark suite (about 4 minutes).
	$(GO) run ./cmd/eventline-bench -quick

lint: ## gofmt, go vet, and golangci-lint when installed.
	@test -z "$$(gofmt -l .)" || (gofmt -l . && exit 1)
	$(GO) vet ./...
	@if command -v golangci-lint >/dev/null 2>&1; then golangci-lint run ./...; else echo "golangci-lint not installed; skipped"; fi
