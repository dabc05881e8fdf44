"""docs/PROTOCOL.md stays true to the code, and the README stays inside the repository.

The checks compare the document with what the code defines or does (error codes, the
operations the wire layer decodes, what unserved extensions are answered, a real node
running the document's client), never with a copy of the document's wording.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from protocol.errors import ErrorCode, Fault
from tests.nodes import NodeProcess, running
from transport import wire

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "PROTOCOL.md"
PACKAGES = ("protocol", "engine", "transport", "neuron_tai")
EXTENSION_OPS = ("generate", "cancel")


def sections(text: str) -> dict[str, str]:
    """Heading text (without #s) -> the text up to the next heading of any level."""
    parts = re.split(r"^(#{1,4} .*)$", text, flags=re.MULTILINE)
    return {parts[i].lstrip("#").strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def slug(title: str) -> str:
    """The anchor a Markdown renderer gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def section(title_part: str) -> str:
    found = [body for title, body in sections(DOC.read_text()).items() if title_part in title]
    assert len(found) == 1, f"expected one section titled like {title_part!r} in {DOC.name}"
    return found[0]


def error_table() -> dict[str, bool]:
    """The Errors table: code -> whether the doc says it carries retry_after_ms."""
    rows = re.findall(r"^\| `([a-z_]+)` \|.*\|(.*)\|\s*$", section("Errors"), flags=re.MULTILINE)
    return {code: bool(retry.strip()) for code, retry in rows}


def implementation_modules() -> list[ModuleType]:
    modules = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules.append(package)
        for info in pkgutil.iter_modules(package.__path__, f"{name}."):
            modules.append(importlib.import_module(info.name))
    return modules


def string_constants(modules: list[ModuleType]) -> set[str]:
    """Every string literal in the implementation's source (parsed, not searched as text)."""
    found: set[str] = set()
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        found |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return found


def wire_code(frames: list[bytes]) -> str | None:
    """The error code the wire layer answers for `frames`, or None when it decodes them."""
    try:
        wire.decode_request(frames, n_embd=64)
    except wire.WireError as exc:
        return exc.code
    return None


def packed(header: dict[str, Any], *payload: bytes) -> list[bytes]:
    return [msgpack.packb(header), *payload]


# -- error codes ---------------------------------------------------------------------------


def test_every_documented_error_code_exists_in_the_code() -> None:
    table = error_table()
    assert len(table) >= 10, f"the Errors table in {DOC.name} did not parse: {table}"
    unknown = set(table) - string_constants(implementation_modules())
    assert not unknown, f"{DOC.name} documents error codes the code never uses: {sorted(unknown)}"


def test_every_error_code_the_code_defines_is_documented() -> None:
    table = error_table()
    defined: dict[str, set[str]] = {}
    for module in implementation_modules():
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, enum.Enum) and obj.__module__ == module.__name__:
                values = {m.value for m in obj if isinstance(m.value, str)}
                if values & set(table):  # an enum of protocol error codes
                    defined[f"{module.__name__}.{name}"] = values
    assert defined, "no enum of error codes found in the code"
    for where, values in defined.items():
        assert values <= set(table), f"{where} defines codes missing from {DOC.name}: {sorted(values - set(table))}"


def test_wire_errors_are_documented_with_their_retry_hint() -> None:
    table = error_table()
    produced = {
        wire_code([b"\x93not msgpack"]),
        wire_code(packed({"v": 2, "op": "ping", "rid": 1})),
        wire_code(packed({"v": 1, "op": "no_such_op", "rid": 1})),
        wire_code(packed({"v": 1, "op": "open", "rid": 1, "session": "", "max_tokens": 1})),
    }
    assert None not in produced and produced <= set(table), produced
    for code, documented in table.items():
        header, _ = wire.parse_reply(wire.encode_error(1, ErrorCode(code), "m", 5))
        assert ("retry_after_ms" in header) == documented, f"{code}: retry_after_ms in the reply vs the doc"
        typed = wire.decode_reply(wire.encode_reply(wire.ErrorReply.of(Fault(ErrorCode(code), "m", 5), rid=1)))
        assert isinstance(typed, wire.ErrorReply) and (typed.retry_after_ms is not None) == documented, code


# -- operations ----------------------------------------------------------------------------


def test_every_served_op_has_its_section() -> None:
    served = [cls.__name__.lower() for cls in typing.get_args(wire.Request)]
    assert "step" in served, served
    for op in served:
        section(f"`{op}` →")


@pytest.mark.parametrize("op", EXTENSION_OPS)
def test_extension_ops_are_marked_as_the_node_answers_them(op: str) -> None:
    frames = packed({"v": 1, "op": op, "rid": 1, "session": "s", "pos": 0, "n": 1, "max_new": 4})
    if op == "generate":
        frames.append(np.array([1], "<i4").tobytes())
    code = wire_code(frames)
    text = section("`generate` and `cancel`")
    if code is not None and code == wire_code(packed({"v": 1, "op": "no_such_op", "rid": 1})):
        assert "Not yet served" in text and f"`{code}`" in text
    else:
        assert "Not yet served" not in text, f"the node now decodes {op!r}: document it as served"


def test_worked_example_requests_decode() -> None:
    block = section("message by message").split("```")[1]
    requests = replies = 0
    for line in block.splitlines():
        if not line.startswith(("→ ", "← ")):
            continue
        header_text, _, payload_text = line[2:].partition("}  int32[")
        header = json.loads(header_text + ("}" if payload_text else ""))
        payload = []
        if payload_text:
            count, ids = payload_text.split("] ", 1)
            values = json.loads(ids)
            assert len(values) == int(count)
            payload = [np.array(values, "<i4").tobytes()]
        if line.startswith("→ "):
            requests += 1
            assert wire_code(packed(header, *payload)) is None, line
        else:
            replies += 1
            assert header["rid"] == requests and header["v"] == 1, line
    assert requests == replies >= 5


# -- links ---------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", ["README.md", "docs/PROTOCOL.md"])
def test_links_stay_inside_the_repository(doc: str) -> None:
    path = REPO / doc
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        assert "://" not in target and not target.startswith(("/", "mailto:")), f"{doc} links out: {target}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        assert resolved.is_relative_to(REPO) and resolved.exists(), f"{doc}: {target} is not in the repository"
        if anchor and resolved.suffix == ".md":
            assert anchor in {slug(t) for t in sections(resolved.read_text())}, f"{doc}: no heading for {target}"
    for outside in ("../shared", "/work/", "/root/"):
        assert outside not in text, f"{doc} mentions {outside}"
    if doc == "README.md":
        assert "](docs/PROTOCOL.md)" in text


# -- the document's client against a real node ----------------------------------------------


def test_the_documented_client_runs_against_a_node(tiny_model: Path, tmp_path: Path) -> None:
    code = section("minimal client").split("```python", 1)[1].split("```", 1)[0]
    script = tmp_path / "client.py"
    script.write_text(code)
    node = NodeProcess(tiny_model, "tcp://127.0.0.1:0")
    with running(node):
        command = [sys.executable, str(script), node.address, "the and"]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        tokens = json.loads(done.stdout.rsplit("] ", 1)[0] + "]")
        assert 1 <= len(tokens) <= 8 and all(isinstance(t, int) for t in tokens)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(node.address)
        try:
            sock.send_multipart(packed({"v": 1, "op": "stats", "rid": 1}))
            assert sock.poll(30_000), "no stats reply"
            stats = msgpack.unpackb(sock.recv_multipart()[0])["stats"]
        finally:
            sock.close()
    assert stats["sessions_active"] == 0  # the client closed its session
    assert ("Not yet served" in section("Leases")) == ("lease_ms" not in stats)
    assert ("Not yet served" in section("Security")) == ("curve" not in stats)
