"""neuron-tai: a node of a distributed GGUF inference pipeline."""

__version__ = "0.1.0"
