"""pull-pin and cascade attention: pins are not holders in the common-prefix count.

vLLM 0.27-0.31 count, in every ``schedule()``, the leading blocks of ``running[0]`` whose
``ref_cnt`` equals the number of requests with blocks (``num_common_prefix_blocks``, used by
cascade attention). A pin is one more reference on a block: a pinned block held by all but
one request would count as common to all (that request's attention would read another's KV),
and one held by all would no longer count. While the count is computed, the pinned blocks of
that block pool carry one reference less per pin, so vLLM's own rule sees holders only;
the references are restored before the call returns (the scheduler is single-threaded).
0.32+ removed cascade attention (the method returns zeros; shape left alone).
"""
from __future__ import annotations

import weakref

from hotfix.runtime import contain

FIX = "pull-pin"
_BOOKS: "weakref.WeakSet" = weakref.WeakSet()  # live PinBooks of this process (one per NIXL scheduler)


def track(book):
    """Register a PinBook (pull-pin's ``_book`` factory); returns it."""
    _BOOKS.add(book)
    return book


def pinned_blocks(block_pool) -> list:
    """Blocks of ``block_pool`` holding pin references, one entry per reference."""
    blocks = block_pool.blocks
    out = []
    for book in list(_BOOKS):
        for pin in book.holding():
            out.extend(b for group in pin.groups for b in group
                       if b.block_id < len(blocks) and blocks[b.block_id] is b)
    return out


def count_common_prefix_without_pins(wrapped, instance, args, kwargs):
    """``KVCacheManager.get_num_common_prefix_blocks`` with the pins' references taken out."""
    try:
        pinned = pinned_blocks(instance.block_pool)
    except Exception as exc:
        contain(FIX, "KVCacheManager.get_num_common_prefix_blocks", exc,
                fallback="stock count (pins counted as holders)")
        pinned = ()
    if not pinned:
        return wrapped(*args, **kwargs)
    for block in pinned:
        block.ref_cnt -= 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        for block in pinned:
            block.ref_cnt += 1
