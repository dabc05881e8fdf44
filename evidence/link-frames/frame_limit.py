"""ZMQ_MAXMSGSIZE bounds each frame of a message, not the message: 50 frames of 600 bytes pass
a 1000-byte limit, one frame of 1200 bytes does not."""

import time

import zmq

ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.MAXMSGSIZE, 1000)
port = router.bind_to_random_port("tcp://127.0.0.1")
dealer = ctx.socket(zmq.DEALER)
dealer.connect(f"tcp://127.0.0.1:{port}")
for name, frames in (("50 frames of 600 bytes", [b"x" * 600] * 50), ("1 frame of 1200 bytes", [b"x" * 1200])):
    dealer.send_multipart(frames)
    time.sleep(0.3)
    try:
        print(f"{name}: received, {len(router.recv_multipart(zmq.NOBLOCK)) - 1} frames")
    except zmq.Again:
        print(f"{name}: dropped")
print("libzmq", zmq.zmq_version())
