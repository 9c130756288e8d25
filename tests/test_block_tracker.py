"""BlockTracker on hand-written pool snapshots (no vLLM needed)."""

from hotfix.worlds.tracker import (
    BLOCKS_NOT_RETURNED,
    COMPUTE_WHILE_LOADING,
    READ_FROM_FREED,
    WRITE_INTO_FREED,
    WRITE_INTO_REALLOCATED,
    BlockTracker,
)


def tracker_with_r_loading(blocks=(1, 2, 3)) -> BlockTracker:
    tracker = BlockTracker()
    tracker.observe(0, {"R": list(blocks)}, free_blocks=[4, 5, 6])
    tracker.write_started(0, "nixl@rank0", "R", blocks)
    return tracker


def test_write_into_freed_block_is_flagged_once_per_block():
    """The UCX READ outliving the free is the memory-safety bug (D3)."""
    tracker = tracker_with_r_loading()
    tracker.observe(3, {}, free_blocks=[1, 2, 3, 4, 5, 6])
    tracker.observe(4, {}, free_blocks=[1, 2, 3, 4, 5, 6])

    flagged = tracker.of_kind(WRITE_INTO_FREED)
    assert [(v.step, v.req_id, v.who, v.block) for v in flagged] == [
        (3, "R", "nixl@rank0", 1),
        (3, "R", "nixl@rank0", 2),
        (3, "R", "nixl@rank0", 3),
    ]


def test_write_into_block_handed_to_another_request_is_flagged():
    """Reallocation is worse than a free: the write lands in live KV of S."""
    tracker = tracker_with_r_loading()
    tracker.observe(5, {"S": [2, 3]}, free_blocks=[1, 4, 5, 6])

    assert tracker.kinds() == {WRITE_INTO_FREED, WRITE_INTO_REALLOCATED}
    (reallocated_2, reallocated_3) = tracker.of_kind(WRITE_INTO_REALLOCATED)
    assert (reallocated_2.block, reallocated_3.block) == (2, 3)
    assert "['S']" in reallocated_2.detail


def test_block_pending_a_deferred_free_is_not_yet_a_violation():
    """Async scheduling parks freed blocks (no owner, not in the pool) until
    the in-flight step is done; nothing can reuse them yet."""
    tracker = tracker_with_r_loading()
    tracker.observe(2, {}, free_blocks=[4, 5, 6])

    assert tracker.violations == []


def test_write_that_ends_before_the_free_is_clean():
    tracker = tracker_with_r_loading()
    tracker.write_ended(2, "nixl@rank0", "R")
    tracker.observe(3, {}, free_blocks=[1, 2, 3, 4, 5, 6])

    assert tracker.violations == []
    assert tracker.active_transfers == []


def test_write_started_into_blocks_the_request_does_not_hold_is_flagged_at_start():
    tracker = BlockTracker()
    tracker.observe(0, {"S": [1]}, free_blocks=[2])
    tracker.write_started(0, "lmc@rank1", "R", [1, 2])

    assert {(v.kind, v.block) for v in tracker.violations} == {
        (WRITE_INTO_REALLOCATED, 1),
        (WRITE_INTO_FREED, 2),
    }


def test_compute_over_blocks_still_loading_is_flagged_for_owner_and_sharers():
    """Early promotion (D1): R runs on unwritten KV, and so does S, which got
    R's blocks from the prefix cache."""
    tracker = tracker_with_r_loading()
    tracker.observe(2, {"R": [1, 2, 3], "S": [1, 2]}, free_blocks=[4, 5, 6])
    tracker.computed(2, "R", [1, 2, 3])
    tracker.computed(2, "S", [1, 2])
    tracker.computed(3, "R", [1, 2, 3])

    flagged = tracker.of_kind(COMPUTE_WHILE_LOADING)
    assert [(v.req_id, v.block) for v in flagged] == [
        ("R", 1),
        ("R", 2),
        ("R", 3),
        ("S", 1),
        ("S", 2),
    ]
    assert {v.step for v in flagged} == {2}


def test_compute_after_every_writer_ended_is_clean():
    tracker = tracker_with_r_loading()
    tracker.write_started(0, "lmc@rank0", "R", [1, 2])
    tracker.write_ended(1, "lmc@rank0", "R")
    tracker.write_ended(3, "nixl@rank0", "R")
    tracker.computed(4, "R", [1, 2, 3])

    assert tracker.violations == []


def test_save_reading_freed_blocks_is_flagged_but_compute_during_a_save_is_not():
    """An async save only reads: computing alongside it is fine, freeing
    under it (D4) stores another request's KV into the cache."""
    tracker = BlockTracker()
    tracker.observe(0, {"R": [1, 2]}, free_blocks=[3])
    tracker.read_started(0, "lmc@rank0", "R", [1, 2])
    tracker.computed(0, "R", [1, 2])
    tracker.observe(1, {}, free_blocks=[1, 2, 3])

    assert [(v.kind, v.who, v.block) for v in tracker.violations] == [
        (READ_FROM_FREED, "lmc@rank0", 1),
        (READ_FROM_FREED, "lmc@rank0", 2),
    ]


def test_restarting_a_load_replaces_the_previous_episode():
    """After preemption a loader starts a new episode for the same request."""
    tracker = tracker_with_r_loading(blocks=(1, 2))
    tracker.write_ended(1, "nixl@rank0", "R")
    tracker.observe(2, {"R": [5, 6]}, free_blocks=[1, 2, 3, 4])
    tracker.write_started(2, "nixl@rank0", "R", [5, 6])
    tracker.write_started(3, "nixl@rank0", "R", [5])

    assert tracker.violations == []
    (episode,) = tracker.active_transfers
    assert (episode.blocks, episode.started) == (frozenset({5}), 3)


def test_pool_missing_blocks_at_the_end_is_a_leak():
    tracker = BlockTracker()
    tracker.observe(9, {"R": [1, 2]}, free_blocks=[3, 4])
    tracker.check_all_returned(9, num_free=2, num_usable=4)

    (leak,) = tracker.of_kind(BLOCKS_NOT_RETURNED)
    assert leak.step == 9
    assert "2 of 4 blocks" in leak.detail
    assert "1: ['R']" in leak.detail


def test_whole_pool_at_the_end_is_clean():
    tracker = BlockTracker()
    tracker.observe(9, {}, free_blocks=[1, 2, 3, 4])
    tracker.check_all_returned(9, num_free=4, num_usable=4)

    assert tracker.violations == []
