"""A lookup's compact answer (``LookupRequest.compact``): what the reader knows already is left out.

The reader sent the group ids, so the answer does not repeat them. A stage's object key is its chunk's group id,
"/" and the stage (``kvpool.core.chunk_hash``), and a save puts a chunk's stages in order, so a member's key is
nearly always its group's id, "/" and its place in the group: such a key travels as "". Any other key travels
whole; a real key is never "" (keys are checked non-empty), so "" names the derived form and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence


def compact_keys(group_id: str, keys: Sequence[str]) -> list[str]:
    """The keys of one group's members, in order, as the compact answer carries them."""
    return ["" if key == f"{group_id}/{place}" else key for place, key in enumerate(keys)]


def full_keys(group_id: str, keys: Sequence[str]) -> list[str]:
    """The keys :func:`compact_keys` gave, whole again."""
    return [key or f"{group_id}/{place}" for place, key in enumerate(keys)]
