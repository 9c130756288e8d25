"""The recv-barrier's LoadBarrier on its own (no vLLM): episodes, verdicts, bounds."""
from __future__ import annotations

from hotfix.fixes.recv_barrier import (ABSORBED, DONE, DONE_FAILED, STRAY, WAIT, LoadBarrier,
                                       loads_started)

NIXL, LMC = 0, 1


def test_planned_load_is_forwarded_once_when_its_only_loader_reports():
    b = LoadBarrier()
    b.plan("R", NIXL)
    assert b.report("R", NIXL) == DONE
    assert b.report("R", NIXL) == STRAY and b.was_forwarded("R")
    assert len(b) == 0


def test_stray_loader_holds_the_request_until_both_are_done_in_either_order():
    for first, second in ((LMC, NIXL), (NIXL, LMC)):
        b = LoadBarrier()
        b.plan("R", NIXL)
        assert b.started("R", NIXL) is True
        assert b.started("R", LMC) is True  # in the set now, though not chosen
        assert b.report("R", first) == WAIT
        assert b.report("R", second) == DONE


def test_report_from_a_child_outside_the_set_never_drains_another_slot():
    b = LoadBarrier()
    b.plan("R", NIXL)
    assert b.report("R", LMC) == STRAY
    assert b.pending("R") == {NIXL}
    assert not b.was_forwarded("R")


def test_failure_is_held_until_every_loader_is_terminal_then_reported_once():
    b = LoadBarrier()
    b.plan("R", NIXL)
    b.started("R", LMC)
    assert b.report("R", LMC, failed=True) == WAIT
    assert b.report("R", NIXL) == DONE_FAILED


def test_unplanned_load_is_tracked_and_absorbed_when_drained():
    b = LoadBarrier()
    assert b.started("R", LMC) is False
    assert b.report("R", LMC) == ABSORBED
    assert len(b) == 0 and not b.was_forwarded("R")


def test_new_plan_after_a_finished_episode_starts_a_new_one():
    b = LoadBarrier()
    b.plan("R", NIXL)
    assert b.report("R", NIXL) == DONE
    assert b.plan("R", LMC) is True  # resume after preemption: a new episode
    assert not b.was_forwarded("R")
    assert b.report("R", NIXL) == STRAY
    assert b.report("R", LMC) == DONE


def test_new_plan_while_loaders_still_write_keeps_them_in_the_set():
    b = LoadBarrier()
    b.plan("R", NIXL)
    assert b.plan("R", LMC) is False
    assert b.report("R", LMC) == WAIT
    assert b.report("R", NIXL) == DONE


def test_cap_evicts_the_oldest_episode_and_says_so():
    b = LoadBarrier(cap=2)
    for req in ("A", "B", "C"):
        b.plan(req, NIXL)
    assert len(b) == 2 and b.evicted == ["A"]
    assert b.report("A", NIXL) == STRAY


def test_state_returns_to_empty_after_many_episodes():
    b = LoadBarrier(remember=16)
    for i in range(10_000):
        b.plan(f"r{i}", NIXL)
        b.started(f"r{i}", LMC)
        b.report(f"r{i}", LMC)
        b.report(f"r{i}", NIXL)
    assert len(b) == 0 and len(b._forwarded) == 16


class _Meta:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_loads_started_reads_nixl_and_lmcache_shapes():
    nixl = _Meta(reqs_to_recv={"real": _Meta(local_block_ids=([3, 4],)),
                               "notify_only": _Meta(local_block_ids=([],))})
    assert loads_started(nixl) == {"real"}
    lmc = _Meta(requests=[_Meta(request_id="r", direction="RETRIEVE"),
                          _Meta(request_id="s", direction="STORE")])
    assert loads_started(lmc) == {"r"}
    assert loads_started(_Meta()) == set()


def test_loads_started_takes_an_enum_direction_and_a_tuple_of_ops():
    import enum

    Direction = enum.Enum("Direction", ["STORE", "RETRIEVE"])
    lmc = _Meta(requests=(_Meta(request_id="r", direction=Direction.RETRIEVE),
                          _Meta(request_id="s", direction=Direction.STORE)))
    assert loads_started(lmc) == {"r"}


class LMCacheMPConnectorMetadata:  # an LMCache metadata whose fields we do not know
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_an_unreadable_metadata_shape_is_reported_once_per_class_not_taken_for_no_load(monkeypatch):
    from hotfix.fixes import recv_barrier

    said = []
    monkeypatch.setattr(recv_barrier, "_once", lambda key, level, event, **f: said.append((key, level, event, f)))
    renamed = _Meta(requests=[_Meta(req_id="r", load_spec="RETRIEVE")])  # LMCache's ops renamed
    assert loads_started(renamed) == set()
    assert loads_started(_Meta(reqs_to_recv=[("r", [1])])) == set()  # NIXL's field, another type
    assert loads_started(LMCacheMPConnectorMetadata(ops=[])) == set()  # an LMCache class, neither
    assert loads_started(_Meta(something_else=1)) == set()  # a child we do not model: silent
    assert loads_started(None) == set()
    assert [(level, event) for _, level, event, _ in said] == [("warning", "hotfix.recv.unreadable_metadata")] * 3
    assert said[2][3]["metadata"].endswith(":LMCacheMPConnectorMetadata")
    assert "not seen by the barrier" in said[0][3]["action"]
