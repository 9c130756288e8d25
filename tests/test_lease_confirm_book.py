"""lease-guard's confirmation state alone (no vLLM): P's held leases, the listener's map, D's
kept READs; each bounded and back to empty."""
from __future__ import annotations

import time

import msgspec

from hotfix.fixes._lease_confirm import (
    CANNOT_ANSWER,
    QUESTION,
    Asker,
    HeldLeases,
    HeldOrMetadata,
    PrefillConfirmations,
    ask_over_zmq,
    held_in_answer,
    question,
)

P = ("10.0.0.1", 5600)
Q = ("10.0.0.2", 5600)


def test_p_holds_a_request_from_its_finish_until_its_blocks_are_freed_and_never_past_the_cap():
    held = HeldLeases(cap=3)
    for req in ("a", "b", "c", "d"):
        held.hold(req)
    assert held.held(["a", "b", "c", "d"]) == ["b", "c", "d"]  # the oldest dropped: answered "no"
    held.release(["b", "c", "d", "never-held"])
    assert len(held) == 0


def test_the_listeners_map_answers_the_question_and_serves_metadata_as_before():
    held = HeldLeases()
    held.hold("r1")
    served = HeldOrMetadata({(0, 0): b"rank-0-metadata"}, held)
    assert served[(0, 0)] == b"rank-0-metadata"
    get_meta_msg, pp, tp = msgspec.msgpack.decode(question(b"get_meta_msg", ["r1", "r2"]))
    assert held_in_answer(served[(pp, tp)]) == ["r1"]
    try:
        served[(0, 1)]
    except KeyError:
        pass
    else:
        raise AssertionError("an unknown rank must fail as vLLM's own map does")
    assert held_in_answer(b"rank-0-metadata") is None  # a stock listener's reply is no answer


class SyncAsker(Asker):
    """The asker without its thread: answers as soon as asked (from ``holds``)."""

    def __init__(self, holds):
        super().__init__(lambda address, ids: None)
        self.holds, self.asked = holds, []

    def submit(self, address, remote_ids):
        self.asked.append((address, sorted(remote_ids)))
        self._answers.put((address, remote_ids, self.holds.get(address)))


def test_d_keeps_each_read_until_its_prefill_answered_one_question_per_prefill_and_poll():
    asker = SyncAsker({P: ["p-r1"], Q: None})  # P holds r1 only; Q does not answer
    book = PrefillConfirmations(asker, cap=8)
    book.expect("r1", P, "p-r1", [("agent-p", b"p-r1:1")])
    book.expect("r2", P, "p-r2", [("agent-p", b"p-r2:1")])
    book.expect("r3", Q, "q-r3", [("agent-q", b"q-r3:1")])
    assert book.answered() == []  # nothing asked before the READs are done
    book.ask(["r1", "r2", "r3", "not-kept"])
    book.ask(["r1"])  # asked once
    assert sorted(asker.asked) == [(P, ["p-r1", "p-r2"]), (Q, ["q-r3"])]
    verdicts = {req: (held, notifs) for req, held, notifs in book.answered()}
    assert verdicts == {"r1": (True, [("agent-p", b"p-r1:1")]), "r2": (False, [("agent-p", b"p-r2:1")]),
                        "r3": (None, [("agent-q", b"q-r3:1")])}
    assert len(book) == 0


def test_a_silent_prefill_is_asked_again_within_the_patience_and_a_late_yes_reports_the_read():
    """P's EngineCore stalled past one question's timeout: its late answer decides, not the
    silence (stalled is not released); a question that would end past the patience is not
    asked, and the silence then fails the READ."""
    now = [0.0]
    asker = SyncAsker({P: None, Q: None})
    repeated = []
    book = PrefillConfirmations(asker, patience_s=10.0, pause_s=5.0, on_asked_again=repeated.append,
                                clock=lambda: now[0])
    book.expect("r1", P, "p-r1", [("agent-p", b"p-r1:1")])
    book.expect("r2", Q, "q-r2", [("agent-q", b"q-r2:1")])
    book.ask(["r1", "r2"])
    now[0] = 5.0  # each question timed out unanswered; P is back (it still holds r1), Q not
    asker.holds[P] = ["p-r1"]
    assert book.answered() == [] and repeated == [2] and len(book) == 2
    assert asker.asked == [(P, ["p-r1"]), (Q, ["q-r2"])] * 2
    now[0] = 10.0  # a third question to Q would end at 15 s, past the patience
    verdicts = {req: held for req, held, _ in book.answered()}
    assert verdicts == {"r1": True, "r2": None}
    assert len(book) == 0 and book.answered() == [] and repeated == [2]


def test_a_question_that_fails_at_once_is_asked_again_only_after_the_pause():
    now = [0.0]
    asker = SyncAsker({P: None})
    book = PrefillConfirmations(asker, patience_s=10.0, pause_s=5.0, clock=lambda: now[0])
    book.expect("r1", P, "p-r1", [])
    book.ask(["r1"])
    now[0] = 0.1
    assert book.answered() == [] and len(asker.asked) == 1  # no question per poll
    now[0] = 5.0
    assert book.answered() == [] and len(asker.asked) == 2


def test_a_prefill_that_cannot_answer_fails_the_read_at_once_and_so_does_one_without_patience():
    gone = PrefillConfirmations(SyncAsker({P: CANNOT_ANSWER}), patience_s=120.0, pause_s=5.0)
    gone.expect("r1", P, "p-r1", [])
    gone.ask(["r1"])
    assert gone.answered() == [("r1", None, [])]  # P's process is gone: nothing to wait for
    once = PrefillConfirmations(SyncAsker({P: None}), patience_s=0.0, pause_s=5.0)
    once.expect("r1", P, "p-r1", [])
    once.ask(["r1"])
    assert once.answered() == [("r1", None, [])]


def test_a_read_that_cannot_be_asked_again_fails_instead_of_waiting_unasked():
    now = [0.0]

    class NoThreads(SyncAsker):
        def submit(self, address, remote_ids):
            if self.asked:
                raise RuntimeError("can't start new thread")
            super().submit(address, remote_ids)

    book = PrefillConfirmations(NoThreads({P: None}), patience_s=10.0, pause_s=1.0, clock=lambda: now[0])
    book.expect("r1", P, "p-r1", [("agent-p", b"1")])
    book.ask(["r1"])
    now[0] = 1.0
    assert book.answered() == [("r1", None, [("agent-p", b"1")])] and len(book) == 0


def test_an_unreachable_listener_cannot_answer_and_a_closed_port_is_told_from_a_silent_one():
    import socket

    silent = socket.socket()  # accepts connections, never answers: a starved listener
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: P's process is gone
    try:
        assert ask_over_zmq(silent.getsockname(), b"get_meta_msg", ["r1"], 0.3) is None
        assert ask_over_zmq(("127.0.0.1", closed_port), b"get_meta_msg", ["r1"], 0.3) == CANNOT_ANSWER
    finally:
        silent.close()


def test_d_keeps_at_most_cap_reads_and_a_read_that_failed_on_its_own_is_forgotten():
    book = PrefillConfirmations(SyncAsker({}), cap=2)
    book.expect("r1", P, "p-r1", [("agent-p", b"1")])
    book.expect("r2", P, "p-r2", [])
    assert not book.has_room()  # the next READ keeps its notification (stock, unconfirmed)
    assert book.forget("r1") == [("agent-p", b"1")] and book.forget("r1") == []
    assert book.has_room() and "r2" in book and "r1" not in book
    book.forget("r2")
    assert len(book) == 0


def answers_within(asker: Asker, n: int, timeout_s: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += asker.answers()
        time.sleep(0.01)
    return got


def test_the_asker_answers_none_when_asking_raises():
    def ask(address, ids):
        if address == Q:
            raise OSError("unreachable")
        return list(ids)

    asker = Asker(ask)
    asker.submit(P, ["a"])
    asker.submit(Q, ["b"])
    got = answers_within(asker, 2)
    assert sorted(got, key=lambda a: a[0]) == [(P, ["a"], ["a"]), (Q, ["b"], None)]
    assert QUESTION.startswith("hotfix_lease_held")


def test_a_prefill_that_does_not_answer_delays_only_its_own_reads_and_no_thread_outlives_the_asking():
    import threading

    q_answers = threading.Event()
    asked = []

    def ask(address, ids):
        asked.append((address, list(ids)))
        if address == Q:
            assert q_answers.wait(5)  # Q is hung: its question waits (up to the timeout, in life)
        return list(ids)

    asker = Asker(ask)
    asker.submit(Q, ["q1"])
    asker.submit(P, ["p1"])
    assert answers_within(asker, 1) == [(P, ["p1"], ["p1"])]  # P's READ is not kept behind Q's
    asker.submit(Q, ["q2"])
    asker.submit(Q, ["q3"])  # Q still asked: these wait and then go in one question
    q_answers.set()
    assert sorted(answers_within(asker, 2)) == [(Q, ["q1"], ["q1"]), (Q, ["q2", "q3"], ["q2", "q3"])]
    deadline = time.monotonic() + 5
    while asker._running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asker._running == 0 and not asker._asking and not asker._pending
    assert not [t for t in threading.enumerate() if t.name == "hotfix-lease-confirm"]
