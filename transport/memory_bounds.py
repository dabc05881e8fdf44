"""The default memory bounds of a node, in bytes (and ZeroMQ's message counts).

One light module, so the node's configuration, its transport classes and the CLI
(which must start without loading llama.cpp) share one set of numbers.
"""

MiB = 2**20

MAX_MESSAGE_BYTES = 64 * MiB  # ZMQ_MAXMSGSIZE: a longer message is dropped by ZeroMQ
# ZeroMQ's queue of messages on their way out, per connection and to the next stage. It counts
# messages: its bytes are at most this many of the largest reply.
SEND_HWM = 16
# Replies waiting in the node for one connection whose pipe is full, and for all of them.
MAX_PEER_REPLY_BYTES = 32 * MiB
MAX_REPLY_BYTES = 256 * MiB
# Bytes that requests in progress hold, per connection and in total.
MAX_PEER_REQUEST_BYTES = 128 * MiB
MAX_REQUEST_BYTES = 512 * MiB
# Requests waiting to go out to the next stage (behind SEND_HWM).
MAX_OUTBOX_BYTES = 256 * MiB
