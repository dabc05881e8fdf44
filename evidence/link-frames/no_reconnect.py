"""A connecting DEALER that receives a frame over its ZMQ_MAXMSGSIZE drops the connection and
never reconnects it (a protocol error); disconnect + connect brings it back."""

import time

import zmq

ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
port = router.bind_to_random_port("tcp://127.0.0.1")
address = f"tcp://127.0.0.1:{port}"
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.MAXMSGSIZE, 1000)
dealer.setsockopt(zmq.LINGER, 0)
dealer.connect(address)


def round_trip(size: int) -> str:
    """Send a request; the router answers with `size` bytes."""
    try:
        dealer.send(b"hi", zmq.NOBLOCK)
    except zmq.Again:
        return "cannot send: no connection"
    time.sleep(0.3)
    try:
        ident, _ = router.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return "the router got nothing"
    router.send_multipart([ident, b"x" * size])
    time.sleep(0.3)
    try:
        return f"answer of {len(dealer.recv(zmq.NOBLOCK))} bytes"
    except zmq.Again:
        return "no answer"


print("answer of 10 bytes:", round_trip(10))
print("answer of 2000 bytes:", round_trip(2000))
time.sleep(2)
print("2 s later, answer of 10 bytes:", round_trip(10))
dealer.disconnect(address)
dealer.connect(address)
time.sleep(0.5)
print("dialled again, answer of 10 bytes:", round_trip(10))
print("libzmq", zmq.zmq_version())
