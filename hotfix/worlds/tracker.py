"""Block-ownership tracker for the test worlds (no vLLM import).

The scheduler world feeds it snapshots of the KV block pool (which request
holds which block, which blocks are free) and the loaders' write episodes
(a loader starts writing a request's blocks at start_load_kv and stops when
it reports the request on that rank). It flags what stock vLLM lets happen
silently:

* a write still running into a block that was freed or handed to another
  request (D1 → D3: the UCX READ lands in someone else's KV), and likewise an
  async save still reading such a block (D4: it stores someone else's KV);
* a forward pass over blocks a loader is still writing (D1: early promotion,
  and prefix-cache sharers of those blocks);
* blocks never returned to the pool once everything has finished (leaks
  from hold accounting).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

WRITE_INTO_FREED = "write_into_freed_block"
WRITE_INTO_REALLOCATED = "write_into_reallocated_block"
READ_FROM_FREED = "read_from_freed_block"
READ_FROM_REALLOCATED = "read_from_reallocated_block"
COMPUTE_WHILE_LOADING = "compute_while_loading"
BLOCKS_NOT_RETURNED = "blocks_not_returned"


@dataclass(frozen=True)
class Violation:
    kind: str
    step: int
    req_id: str | None = None
    who: str | None = None
    block: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Transfer:
    """`who` moves `req_id`'s KV: "write" = a load into the blocks, "read" =
    a save out of them."""

    who: str
    req_id: str
    mode: str
    blocks: frozenset[int]
    started: int


_ON_FREED = {"write": WRITE_INTO_FREED, "read": READ_FROM_FREED}
_ON_REALLOCATED = {"write": WRITE_INTO_REALLOCATED, "read": READ_FROM_REALLOCATED}


class BlockTracker:
    """Flags unsafe block use; one violation per (kind, request, transfer, block)."""

    def __init__(self) -> None:
        self.owners: dict[int, frozenset[str]] = {}
        self.free: frozenset[int] = frozenset()
        self.violations: list[Violation] = []
        self._transfers: dict[tuple[str, str, str], Transfer] = {}
        self._flagged: set[tuple] = set()

    @property
    def active_transfers(self) -> list[Transfer]:
        return list(self._transfers.values())

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}

    def of_kind(self, kind: str) -> list[Violation]:
        return [v for v in self.violations if v.kind == kind]

    def observe(
        self,
        step: int,
        holdings: Mapping[str, Iterable[int]],
        free_blocks: Iterable[int],
    ) -> None:
        """Take a new pool snapshot (request id -> block ids it holds) and
        re-check every running transfer against it."""
        owners: dict[int, set[str]] = {}
        for req_id, blocks in holdings.items():
            for block in blocks:
                owners.setdefault(block, set()).add(req_id)
        self.owners = {block: frozenset(reqs) for block, reqs in owners.items()}
        self.free = frozenset(free_blocks)
        for transfer in self._transfers.values():
            self._check(step, transfer)

    def write_started(
        self, step: int, who: str, req_id: str, blocks: Iterable[int]
    ) -> None:
        self._start(step, Transfer(who, req_id, "write", frozenset(blocks), step))

    def write_ended(self, step: int, who: str, req_id: str) -> None:
        self._transfers.pop((who, req_id, "write"), None)

    def read_started(
        self, step: int, who: str, req_id: str, blocks: Iterable[int]
    ) -> None:
        self._start(step, Transfer(who, req_id, "read", frozenset(blocks), step))

    def read_ended(self, step: int, who: str, req_id: str) -> None:
        self._transfers.pop((who, req_id, "read"), None)

    def computed(self, step: int, req_id: str, blocks: Iterable[int]) -> None:
        """`req_id` runs a forward pass over `blocks` this step."""
        used = set(blocks)
        for transfer in self._transfers.values():
            if transfer.mode != "write":
                continue
            for block in sorted(transfer.blocks & used):
                self._flag(
                    COMPUTE_WHILE_LOADING,
                    step,
                    req_id=req_id,
                    who=transfer.who,
                    block=block,
                    detail=f"{transfer.who} is still loading {transfer.req_id} "
                    f"into block {block}",
                )

    def check_all_returned(self, step: int, num_free: int, num_usable: int) -> None:
        """Everything has finished: the pool must be whole again."""
        if num_free == num_usable:
            return
        held = {
            block: sorted(reqs)
            for block, reqs in sorted(self.owners.items())
            if block not in self.free
        }
        self._flag(
            BLOCKS_NOT_RETURNED,
            step,
            detail=f"{num_usable - num_free} of {num_usable} blocks not returned; "
            f"last known holders: {held}",
        )

    def _start(self, step: int, transfer: Transfer) -> None:
        self._transfers[(transfer.who, transfer.req_id, transfer.mode)] = transfer
        self._check(step, transfer)

    def _check(self, step: int, transfer: Transfer) -> None:
        for block in sorted(transfer.blocks):
            holders = self.owners.get(block, frozenset())
            if block in self.free:
                kind, state = _ON_FREED[transfer.mode], "free"
            elif holders and transfer.req_id not in holders:
                kind, state = _ON_REALLOCATED[transfer.mode], f"held by {sorted(holders)}"
            else:
                continue
            self._flag(
                kind,
                step,
                req_id=transfer.req_id,
                who=transfer.who,
                block=block,
                detail=f"{transfer.who} still {transfer.mode}s {transfer.req_id}'s "
                f"block {block}, which is now {state}",
            )

    def _flag(self, kind: str, step: int, **fields) -> None:
        key = (kind, fields.get("req_id"), fields.get("who"), fields.get("block"))
        if key in self._flagged:
            return
        self._flagged.add(key)
        self.violations.append(Violation(kind, step, **fields))
