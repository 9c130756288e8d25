"""Block-pool helpers shared by the fixes that hold blocks with an extra reference."""
from __future__ import annotations


def pool_of_group(manager, group: int):
    """The pool that owns a KV-cache group's blocks (0.33: a HiSparse group has a pool of
    its own); ``manager`` is the scheduler's ``KVCacheManager``."""
    managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", None)
    if managers and group < len(managers):
        return managers[group].block_pool
    return manager.block_pool
