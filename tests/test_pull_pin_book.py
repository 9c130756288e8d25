"""pull-pin's bookkeeping on its own (no vLLM): confirmations per rank and epoch, aggregation."""
from __future__ import annotations

from hotfix.fixes._nixl_answer import NixlWorkerAnswer
from hotfix.fixes.pull_pin import PinBook, _Pin


def test_a_pin_is_released_only_when_every_rank_confirmed():
    book = PinBook()
    book.add("R", _Pin((["b1", "b2"],), epoch=1))
    assert book.confirm("R", "rank0", epoch=3, ranks=2) == 0 and book.pinned("R")
    assert book.confirm("R", "rank0", epoch=4, ranks=2) == 0, "one rank twice is still one rank"
    assert book.confirm("R", "rank1", epoch=5, ranks=2) == 1 and not book.pinned("R")
    assert [p.groups for p in book.ready] == [(["b1", "b2"],)]


def test_a_pin_waits_for_every_pipeline_stage_not_only_the_tp_ranks():
    """PP=2 x TP=2: four workers each run a part of the READ (world_size, not TP)."""
    book = PinBook()
    book.add("R", _Pin((["b"],), epoch=1))
    for rank in ("pp0tp0", "pp0tp1", "pp1tp0"):
        assert book.confirm("R", rank, epoch=2, ranks=4) == 0
    assert book.confirm("R", "pp1tp1", epoch=2, ranks=4) == 1


def test_confirmation_for_an_unpinned_request_is_ignored():
    book = PinBook()
    assert book.confirm("notify-only", "rank0", epoch=1, ranks=1) == 0 and book.ready == []


def test_two_reads_under_one_request_id_are_each_released_by_the_report_that_covers_them():
    """An early free, then the same id again (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1)."""
    book = PinBook()
    book.add("R", _Pin((["first"],), epoch=2))
    book.add("R", _Pin((["second"],), epoch=7))
    # NIXL's report at epoch 5 covers only the READ bound at 2: the second is not yet bound.
    assert book.confirm("R", "rank0", epoch=5, ranks=1) == 1
    assert [p.groups for p in book.ready] == [(["first"],)] and book.pinned("R")
    # The next report of R (epoch 9) covers the second READ: nothing stays pinned.
    assert book.confirm("R", "rank0", epoch=9, ranks=1) == 1 and not book.pinned("R")
    assert len(book) == 2  # both wait in `ready` for a pool


def test_one_merged_report_covers_two_reads_that_overlapped():
    book = PinBook()
    book.add("R", _Pin((["first"],), epoch=2))
    book.add("R", _Pin((["second"],), epoch=3))
    assert book.confirm("R", "rank0", epoch=6, ranks=1) == 2 and not book.pinned("R")


def test_a_failed_handshake_sends_every_provisional_pin_back():
    book = PinBook()
    book.add("R", _Pin((["a"], ["host-a"]), epoch=1))
    book.add("S", _Pin((["b"], []), epoch=1))
    book.release_all()
    assert not book.pinned("R") and not book.pinned("S") and len(book.ready) == 2


def test_worker_confirmations_and_announcements_merge_over_ranks():
    rank0 = NixlWorkerAnswer({"R": {"t0": 4}, "S": {"t0": 4}}, {"pull-pin": frozenset({"t0"})})
    rank1 = NixlWorkerAnswer({"R": {"t1": 4}}, {"pull-pin": frozenset({"t1"})})
    merged = rank0.aggregate(rank1)
    assert merged.confirmed == {"R": {"t0": 4, "t1": 4}, "S": {"t0": 4}}
    assert merged.hotfix_present == {"pull-pin": frozenset({"t0", "t1"})}
    assert rank0.confirmed == {"R": {"t0": 4}, "S": {"t0": 4}}, "aggregate must not mutate"


def test_each_groups_blocks_go_back_to_the_pool_that_owns_the_group():
    """0.33 HiSparse (and hybrid models): block ids are unique only within a KV-cache group;
    a host group's blocks must not land on the device pool's free queue."""
    from types import SimpleNamespace

    from hotfix.fixes import pull_pin

    class Pool:
        def __init__(self) -> None:
            self.freed = []

        def free_blocks(self, blocks) -> None:
            self.freed.extend(blocks)

    device, host = Pool(), Pool()
    manager = SimpleNamespace(block_pool=device, coordinator=SimpleNamespace(
        single_type_managers=(SimpleNamespace(block_pool=device), SimpleNamespace(block_pool=host))))
    book = PinBook()
    book.add("R", _Pin((["d5", "d6"], ["h5"]), epoch=1))  # id 5 exists in both groups
    book.confirm("R", "rank0", epoch=1, ranks=1)
    token = pull_pin._KV_CACHE_MANAGER.set(manager)
    try:
        pull_pin._release_ready(book)
    finally:
        pull_pin._KV_CACHE_MANAGER.reset(token)
    assert device.freed == ["d5", "d6"] and host.freed == ["h5"] and len(book) == 0


def test_nixl_block_ids_are_matched_per_group():
    from hotfix.fixes.pull_pin import _targets_per_group

    assert _targets_per_group(([1, 2], [1]), 2) == [{1, 2}, {1}]
    assert _targets_per_group([3, 4], 1) == [{3, 4}]  # a flat list: one group
    assert _targets_per_group((), 2) == [set(), set()]
