"""Drafting randomness as a pure function of what every tensor-parallel rank sees alike.

A draft's random draw depends on (the request's key, the absolute position
drafted, ``usd.seed``) and nothing else: no global RNG, no generator state
carried between steps, no ``hash()`` (salted per process).
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same in every process (no ``hash()``).

    Drafting randomness is a pure function of what every tensor-parallel rank
    sees alike (the request, the position, the configured seed), so all ranks
    draw the same drafts with the same q. SplitMix64 finaliser per part.
    """
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (int(part) & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def text_key(text: str) -> int:
    """A stable 64-bit key for a request id (Python's ``hash`` differs per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def position_generators(
    keys: list[int], positions: list[int], seeded: list[bool], salt: int, device: torch.device | str = "cpu",
) -> tuple[list[torch.Generator | None], torch.Generator]:
    """Generators for one draft position of a batch, from keys and positions only.

    keys[b]: a stable key per row: from the request's own seed where seeded[b],
    else from its request id. positions[b]: the absolute position being drafted.
    A seeded row gets its own generator seeded by (key, position), so its drafts
    do not depend on the rest of the batch. The other rows share one generator,
    seeded by ``salt`` and every unseeded row's (key, position). Generators live on
    ``device``, where the draws happen.
    """
    per_row: list[torch.Generator | None] = []
    shared_parts = [salt]
    for key, pos, own in zip(keys, positions, seeded):
        if own:
            per_row.append(torch.Generator(device=device).manual_seed(mix_seed(key, pos)))
        else:
            per_row.append(None)
            shared_parts += (key, pos)
    return per_row, torch.Generator(device=device).manual_seed(mix_seed(*shared_parts))
