"""Wire protocol v1 (PROTOCOL.md) and the Trio adapter over ZeroMQ sockets."""
