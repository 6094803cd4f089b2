"""Layer ids: what the user asks for versus what vLLM stores.

vLLM collects the aux hidden states in ascending layer order whatever order the config
lists, and 0.30+ de-duplicates the ids and then breaks. Users think in their own order
(Eagle-3 wants low, mid, high, then N), so we keep theirs in the file and reject duplicates
early, with a message that names them, both where the vLLM command line is built and again
when the connector starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class LayerIdError(ValueError):
    pass


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """Eagle-3's usual choice: low, middle and high aux layers plus layer N for the targets.

    What the launcher passes to vLLM when no layer ids are given, and so what the sidecar
    budgets for then."""
    n = num_hidden_layers
    return [2, n // 2, n - 3, n]


def validate_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int | None = None) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise LayerIdError("no layer ids given: name the verifier layers to extract, e.g. [2, 18, 33, 36]")
    dups = sorted(i for i, c in Counter(ids).items() if c > 1)
    if dups:
        raise LayerIdError(f"duplicate layer id(s) {dups} in {ids}: each layer can be extracted once")
    if num_hidden_layers is not None:
        bad = [i for i in ids if not 0 <= i <= num_hidden_layers]
        if bad:
            raise LayerIdError(
                f"layer id(s) {bad} outside 0..{num_hidden_layers} (the verifier has {num_hidden_layers} "
                f"layers; id {num_hidden_layers} is the last layer's output before the final norm)"
            )
    return ids


def storage_permutation(user_ids: Sequence[int]) -> list[int] | None:
    """Index into vLLM's ascending storage axis that yields the user's order; None if equal."""
    ascending = sorted(user_ids)
    perm = [ascending.index(i) for i in user_ids]
    return None if perm == list(range(len(perm))) else perm
