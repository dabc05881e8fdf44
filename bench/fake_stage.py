"""A broken next stage: it opens sessions, then answers every step with a malformed reply.

    python -m bench.fake_stage --bind tcp://127.0.0.1:20200 --n-vocab 268 --n-embd 64

A head whose `--next` is this process must turn each of these replies into a `downstream`
error for its client (PROTOCOL.md, "Chaining": the next stage's replies are checked like
requests). Opens are answered with a valid `opened` every other time (so the head has
sessions to step) and a malformed one otherwise; steps, pings and closes only ever get
malformed replies, or none. The malformed kinds come in turn, so each is sent. Prints
`ready ADDRESS`; on SIGTERM it prints `counts JSON` (replies sent, by kind) and exits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq

from bench.hostile import Stop, pack

Reply = list[list[bytes]]  # the messages sent back (none, one, or more)
Maker = Callable[[dict[str, Any], int, int], Reply]


def _result(h: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A `result` header echoing the request's, with `changes`."""
    echoed = {key: h.get(key) for key in ("rid", "session", "pos", "n", "out")}
    return {"v": 1, "op": "result", **echoed, **changes}


def _right_payload(h: dict[str, Any], n_vocab: int, n_embd: int) -> bytes:
    out, n = h.get("out"), int(h.get("n") or 1)
    if out == "logits":
        return bytes(4 * n_vocab)
    if out == "hidden":
        return bytes(4 * n * n_embd)
    return np.array([0], "<i4").tobytes()


def _other_out(h: dict[str, Any]) -> str:
    return "hidden" if h.get("out") != "hidden" else "token"


def _error(h: dict[str, Any], code: Any, **keys: Any) -> bytes:
    return pack({"v": 1, "op": "error", "rid": h.get("rid"), "code": code, "message": "x", **keys})


def _nested(rid: Any, depth: int) -> bytes:
    return b"\x83" + pack("v") + pack(1) + pack("rid") + pack(rid) + pack("op") + b"\x91" * depth + pack("result")


# Malformed answers to a step: each kind is a function of (request header, n_vocab, n_embd).
STEP_REPLIES: dict[str, Maker] = {
    "random_bytes": lambda h, v, e: [[np.random.default_rng(h.get("rid")).bytes(37)]],
    "not_a_map": lambda h, v, e: [[pack([1, 2, 3])]],
    "wrong_op": lambda h, v, e: [[pack({**_result(h), "op": "opened"}), _right_payload(h, v, e)]],
    "wrong_pos": lambda h, v, e: [[pack(_result(h, pos=(h.get("pos") or 0) + 1)), _right_payload(h, v, e)]],
    "pos_as_bool": lambda h, v, e: [[pack(_result(h, pos=bool(h.get("pos")))), _right_payload(h, v, e)]],
    "wrong_n": lambda h, v, e: [[pack(_result(h, n=(h.get("n") or 0) + 1)), _right_payload(h, v, e)]],
    "wrong_out": lambda h, v, e: [[pack(_result(h, out=_other_out(h))), _right_payload(h, v, e)]],
    "no_payload": lambda h, v, e: [[pack(_result(h))]],
    "short_payload": lambda h, v, e: [[pack(_result(h)), b"\x00\x00\x00"]],
    "two_payloads": lambda h, v, e: [[pack(_result(h)), _right_payload(h, v, e), _right_payload(h, v, e)]],
    "token_out_of_vocab": lambda h, v, e: [
        [pack(_result(h)), np.array([v + 5], "<i4").tobytes()]
        if h.get("out") == "token"
        else [pack(_result(h)), bytes(4 * v - 4)]
    ],
    "error_code_not_a_string": lambda h, v, e: [[_error(h, 5)]],
    "error_unknown_code": lambda h, v, e: [[_error(h, "explode", message="x" * 4096)]],
    "error_with_payload": lambda h, v, e: [[_error(h, "busy"), b"payload"]],
    "error_bad_retry": lambda h, v, e: [[_error(h, "busy", retry_after_ms=-5)]],
    # Unreadable or unmatched: the head waits out its --downstream-timeout.
    "header_over_64k": lambda h, v, e: [[pack(_result(h, pad="x" * 70_000)), _right_payload(h, v, e)]],
    "nested_too_deep": lambda h, v, e: [[_nested(h.get("rid"), 12), _right_payload(h, v, e)]],
    "wrong_rid": lambda h, v, e: [[pack(_result(h, rid=(h.get("rid") or 0) + 10_000)), _right_payload(h, v, e)]],
    "rid_as_string": lambda h, v, e: [[pack(_result(h, rid=str(h.get("rid")))), _right_payload(h, v, e)]],
    "no_reply": lambda h, v, e: [],
}


def _stage(n_vocab: int, n_embd: int, **changes: Any) -> dict[str, Any]:
    stage = {
        "first": False,
        "last": True,
        "layers": [2, 4],
        "n_embd": n_embd,
        "n_vocab": n_vocab,
        "model": "fake",
        "max_step_tokens": 512,
        "eog_tokens": [2],
    }
    stage.update(changes)
    return stage


def _opened(h: dict[str, Any], stage: Any) -> list[bytes]:
    echoed = {"rid": h.get("rid"), "session": h.get("session"), "kv_reserved": h.get("max_tokens")}
    return [pack({"v": 1, "op": "opened", **echoed, "stage": stage, "lease_ms": 60_000})]


OPEN_REPLIES: dict[str, Maker] = {
    "opened_without_stage": lambda h, v, e: [_opened(h, None)],
    "opened_layers_reversed": lambda h, v, e: [_opened(h, _stage(v, e, layers=[4, 2]))],
    "opened_eog_out_of_vocab": lambda h, v, e: [_opened(h, _stage(v, e, eog_tokens=[v]))],
    "opened_last_not_bool": lambda h, v, e: [_opened(h, _stage(v, e, last="yes"))],
    "opened_with_payload": lambda h, v, e: [[*_opened(h, _stage(v, e)), b"payload"]],
}


class FakeStage:
    def __init__(self, n_vocab: int, n_embd: int) -> None:
        self.n_vocab = n_vocab
        self.n_embd = n_embd
        self.counts: Counter[str] = Counter()
        self._steps = itertools.cycle(STEP_REPLIES.items())
        self._others = itertools.cycle(STEP_REPLIES.items())  # so every step kind comes as often
        self._opens = itertools.cycle(OPEN_REPLIES.items())
        self._opened = 0

    def answer(self, frames: list[bytes]) -> Reply:
        try:
            h = msgpack.unpackb(frames[0])
        except Exception:
            h = None
        if not isinstance(h, dict):
            self.counts["unreadable_request"] += 1
            return []
        op = h.get("op")
        if op == "open":
            self._opened += 1
            if self._opened % 2:
                self.counts["open:valid_opened"] += 1
                return [_opened(h, _stage(self.n_vocab, self.n_embd))]
            kind, make = next(self._opens)
        elif op == "step":
            kind, make = next(self._steps)
        else:  # ping, close: answered as if they were steps, so never with what they expect
            kind, make = next(self._others)
        self.counts[f"{op}:{kind}"] += 1
        return make(h, self.n_vocab, self.n_embd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", required=True)
    parser.add_argument("--n-vocab", type=int, required=True)
    parser.add_argument("--n-embd", type=int, required=True)
    args = parser.parse_args()
    Stop.on_signals()
    fake = FakeStage(args.n_vocab, args.n_embd)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(args.bind)
    print(f"ready {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    try:
        while not Stop.requested:
            if not sock.poll(100):
                continue
            peer, *frames = sock.recv_multipart()
            for message in fake.answer(frames):
                sock.send_multipart([peer, *message])
    finally:
        ctx.destroy(linger=0)
    print(f"counts {json.dumps(dict(fake.counts))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
