"""The node's engine: the llama.cpp stage backend, budgets, the scheduler and the batch loop."""
