"""A shard's fingerprint: what replicas of one layer range compare before they share sessions.

Two files with the same GGUF header (metadata and tensor table: names, shapes, types,
offsets) and the same first tensor bytes and size are the same shard for this purpose;
reading the first few MiB keeps it cheap for a 70B model's shard.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PREFIX_BYTES = 4 * 2**20


def shard_fingerprint(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=12)
    with path.open("rb") as f:
        digest.update(f.read(PREFIX_BYTES))
    digest.update(path.stat().st_size.to_bytes(8, "little"))
    return digest.hexdigest()
