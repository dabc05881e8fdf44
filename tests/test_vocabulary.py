"""One vocabulary of error codes, and the import rules that keep the light modules light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protocol.errors import ErrorCode

PROTOCOL_CODES = {
    "bad_request", "unsupported_version", "unknown_session", "session_exists", "position", "too_large",
    "wrong_stage", "busy", "kv_budget", "session_limit", "downstream", "internal", "shutting_down",
}  # fmt: skip


def test_error_codes_are_exactly_the_protocols() -> None:
    assert {str(c) for c in ErrorCode} == PROTOCOL_CODES
    assert {c for c in ErrorCode if c.retryable} == {ErrorCode.BUSY, ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT}
    assert ErrorCode.parse("position") is ErrorCode.POSITION
    assert ErrorCode.parse("no_such_code") is ErrorCode.DOWNSTREAM and ErrorCode.parse(None) is ErrorCode.DOWNSTREAM


def modules_loaded_by(*imports: str) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in imports) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize(
    ("imports", "forbidden"),
    [
        (("engine.messages", "engine.scheduler"), {"llama_cpp", "engine.backend", "zmq", "transport", "trio"}),
        (("transport.wire",), {"llama_cpp", "engine", "zmq", "trio"}),
        (("protocol.errors",), {"llama_cpp", "engine", "transport", "numpy"}),
    ],
)
def test_light_modules_do_not_load_heavy_ones(imports: tuple[str, ...], forbidden: set[str]) -> None:
    loaded = modules_loaded_by(*imports)
    assert set(imports) <= loaded  # the probe really imported them
    assert not forbidden & loaded, forbidden & loaded
