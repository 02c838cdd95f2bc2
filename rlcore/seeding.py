"""Explicit, reproducible randomness: every random draw in rlsift is seeded from a tuple of named parts.

A step's rollouts, a round's reference set and a checkpoint's RNG are each seeded from
``derive_seed(seed, step, purpose)``, so a resumed run draws exactly what an uninterrupted one would and
no two purposes share a stream.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of parts (``repr`` of the tuple, sha256, first 8 bytes, shifted right)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1
