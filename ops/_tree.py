"""Reduction trees: the partial results of many tiles merged :data:`FAN_IN` at a time, one
kernel per group, level after level (a tree of depth ``log_FAN_IN(n)`` over n tiles). Sums,
softmax and norm statistics, the loss total and the weight-gradient partial sums all merge this
way; each op says what one merge kernel is."""

from __future__ import annotations

from typing import Callable

__all__ = ["FAN_IN", "merge_tree"]

#: tiles combined by one kernel call; a reduction over more tiles becomes a tree of depth log_F(n)
FAN_IN = 8


def merge_tree(parts: list, merge: Callable[[list, bool], object], fan_in: int = FAN_IN):
    """Merge the partial results ``parts`` (one item per tile) ``fan_in`` at a time.

    ``merge(group, final)`` records one kernel merging ``group`` and returns an item of the same
    kind as ``parts`` (``final=False``) or the finished result (``final=True``, called once,
    last). A row of ``n`` tiles costs ``ceil(n / fan_in) + ...`` kernels, a tree of depth
    ``log_fan_in(n)``.

    >>> merge_tree(list(range(20)), lambda group, final: sum(group) if final else sum(group))
    190
    >>> calls = []
    >>> _ = merge_tree(list(range(20)), lambda g, final: calls.append((len(g), final)) or 0)
    >>> calls
    [(8, False), (8, False), (4, False), (3, True)]
    """
    while len(parts) > fan_in:
        parts = [merge(parts[i:i + fan_in], False) for i in range(0, len(parts), fan_in)]
    return merge(parts, True)
