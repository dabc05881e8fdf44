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

# ruff and mypy, as CI would want them.
lint: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{venv}}/bin/mypy

# Backend sweep on gemma-3-270m: backend vs bare llama_decode, and split exactness.
bench-backend: setup
    {{py}} -m pip install -q -e ".[bench]"
    {{py}} bench/backend_sweep.py --steps 96 --reps 7
