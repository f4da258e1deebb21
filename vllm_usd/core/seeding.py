"""Drafting randomness as a pure function of what every tensor-parallel rank sees alike.

A draft's random draw depends on (the request's key, the position its step
starts drafting at, ``usd.seed``) and nothing else: no global RNG, no generator
state carried between steps, no ``hash()`` (salted per process).
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


class DraftUniforms:
    """The uniforms a drafting step's sampled rows draw with, on the host, from one kept generator.

    Row b's uniforms for its ``depth`` positions come from the generator seeded by (its key, the
    first position it drafts) where ``seeded[b]``, so a seeded request's drafts do not depend on
    the rest of the batch; the other rows' come from one seeding by ``salt`` and every unseeded
    row's (key, position). A pure function of what every tensor-parallel rank sees alike, on any
    device (the host draws, then one copy): every rank draws the same drafts.
    """

    def __init__(self) -> None:
        self._generator = torch.Generator()  # re-seeded per draw: no generator made per step or per row

    def draw(self, keys: list[int], positions: list[int], seeded: list[bool], salt: int, depth: int) -> torch.Tensor:
        """[B, depth] float32 uniforms in [0, 1), on the host."""
        out = torch.empty(len(keys), depth)
        g = self._generator
        shared_parts, shared_rows = [salt], []
        for b, (key, pos, own) in enumerate(zip(keys, positions, seeded)):
            if own:
                out[b] = torch.rand(depth, generator=g.manual_seed(mix_seed(key, pos)))
            else:
                shared_rows.append(b)
                shared_parts += (key, pos)
        if shared_rows:
            out[shared_rows] = torch.rand(len(shared_rows), depth, generator=g.manual_seed(mix_seed(*shared_parts)))
        return out
