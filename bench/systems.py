"""Names of the systems the bench measures, as they appear in bench.json, plots and tables."""

NODE = "neuron-tai single"
NODE_FAST = "neuron-tai single, prefill-share 4"  # the same node tuned for throughput over latency
CHAIN = "neuron-tai chain2"
# Sessions each server runs at once (the node's --max-sessions, llama-server's -np): as many as
# the bare loop decodes together at the highest concurrency, so every system batches the same rows.
SLOTS = 16
SERVER = f"llama-server -np {SLOTS}"
PYTHON = "Llama serial"
BARE = "bare llama_decode"
SERVED = (NODE, NODE_FAST, CHAIN, SERVER)  # systems that take concurrent requests over a socket
ALL = (NODE, NODE_FAST, CHAIN, SERVER, PYTHON, BARE)
