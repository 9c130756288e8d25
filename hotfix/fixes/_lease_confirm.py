"""lease-guard's confirmation (D6b): a READ counts as loaded only once P said it still held the blocks.

A lease can lapse *during* a READ (D's worker stalls past the heartbeat extension, heartbeats
stop early): P frees the blocks, gives them to another request, and D's READ copies that
request's KV. Only P knows whether it still held a request's blocks, and the answer is right
only if asked after the READ ended and before P heard the READ's completion notification (that
notification is what frees the blocks in the healthy case). So:

- D's worker posts such a READ without NIXL's completion notification and keeps it
  (:class:`PrefillConfirmations`); once the READ is done it asks P, on the NIXL side channel
  vLLM already has (P's handshake listener), whether P still holds the request's blocks;
  yes: the READ is reported loaded and the kept notification sent (P frees the blocks as on
  stock, one round trip later); no: the load fails through vLLM's failed-load path. A question
  left unanswered while P's address accepts connections (P's EngineCore stalled, its listener
  starved) is asked again within the READ's patience (the load bound): a slow prefill is
  waited for, never guessed about; past the patience, or when nothing listens there, the
  load fails too.
- P's EngineCore keeps the ids whose blocks it holds for a decode (:class:`HeldLeases`: from
  ``request_finished`` until the step that frees them) and its handshake listener answers the
  question (:class:`HeldOrMetadata`), in the process that frees the blocks.

The question rides on the listener's own message, ``(GET_META_MSG, pp_rank, tp_rank)``, with
:data:`QUESTION` as pp_rank and the ids as tp_rank: vLLM's listener looks ``(pp_rank, tp_rank)``
up in its metadata map and sends back what it finds, so P's map (:class:`HeldOrMetadata`)
answers there. A listener without the hotfix would fail on that lookup, so D asks only a
prefill that said, in the request's ``kv_transfer_params``, that its listener answers.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from hotfix import forksafe

QUESTION = "hotfix_lease_held_w1"  # pp_rank of the question; also heads the answer
Address = Tuple[str, int]  # P's side channel (host, port), as the request's params name it


class HeldLeases:
    """P's EngineCore: requests whose blocks it holds for a decode's READ.

    :meth:`hold` when ``request_finished`` keeps the blocks, :meth:`release` at the step that
    frees them (the workers reported the request finished sending: read, or lease lapsed). At
    most ``cap`` ids; past it the oldest is dropped and then answered "not held" (a recompute
    on D, never garbage). Read by the listener thread, written by the scheduler's."""

    def __init__(self, cap: int = 65536) -> None:
        self.cap = cap
        self.listening = False  # this process's handshake listener answers questions
        self.lock = threading.Lock()
        forksafe.renew_in_child(self, "lock")
        self._held: "OrderedDict[str, None]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req_id: str) -> int:
        """Returns how many ids the cap pushed out."""
        with self.lock:
            self._held.pop(req_id, None)
            self._held[req_id] = None
            evicted = 0
            while len(self._held) > self.cap:
                self._held.popitem(last=False)
                evicted += 1
            return evicted

    def release(self, req_ids: Iterable[str]) -> None:
        with self.lock:
            for req_id in req_ids:
                self._held.pop(req_id, None)

    def held(self, req_ids: Iterable[str]) -> List[str]:
        with self.lock:
            return [r for r in req_ids if r in self._held]


HELD = HeldLeases()


class HeldOrMetadata:
    """The metadata map vLLM's handshake listener serves, answering :data:`QUESTION` too."""

    def __init__(self, metadata, held: HeldLeases = HELD) -> None:
        self._metadata = metadata
        self._held = held

    def __getitem__(self, key):
        if isinstance(key, tuple) and len(key) == 2 and key[0] == QUESTION:
            import msgspec

            asked = [str(r) for r in key[1]] if isinstance(key[1], (list, tuple)) else []
            return msgspec.msgpack.encode([QUESTION, self._held.held(asked)])
        return self._metadata[key]


def question(get_meta_msg, req_ids: List[str]) -> bytes:
    import msgspec

    return msgspec.msgpack.encode((get_meta_msg, QUESTION, list(req_ids)))


def held_in_answer(reply: bytes) -> Optional[List[str]]:
    """The ids P says it holds; None when the reply is not an answer (a stock listener's)."""
    import msgspec

    try:
        head, held = msgspec.msgpack.decode(reply)
    except Exception:
        return None
    return [str(r) for r in held] if head == QUESTION and isinstance(held, list) else None


CANNOT_ANSWER = "cannot_answer"  # an answer: nothing listens at P's address, or not our listener


def ask_over_zmq(address: Address, get_meta_msg, req_ids: List[str], timeout_s: float):
    """One question to P's listener: the ids P says it holds; None on no answer within
    ``timeout_s`` while something still accepts connections there (P stalled, or the
    network: worth asking again); :data:`CANNOT_ANSWER` when nothing listens there (P's
    process is gone) or the reply is not an answer (a listener without the hotfix)."""
    import zmq

    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, max(int(timeout_s * 1000), 1))
        sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 1))
        host, port = address
        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        sock.send(question(get_meta_msg, req_ids))
        parts = sock.recv_multipart()
    except zmq.ZMQError:
        return None if _accepts_connections(address, timeout_s) else CANNOT_ANSWER
    finally:
        sock.close(0)
    held = held_in_answer(parts[0]) if parts else None
    return CANNOT_ANSWER if held is None else held


def _accepts_connections(address: Address, timeout_s: float) -> bool:
    """False only when P's host refuses the connection (no listener: the process is gone); a
    stopped or starved process's listening socket still accepts, and a timeout is the network."""
    import socket

    try:
        socket.create_connection(address, timeout=min(max(timeout_s, 0.1), 1.0)).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


class Asker:
    """Asks prefills from threads of its own and hands back their answers (D's worker).

    One thread per prefill with questions pending, at most ``max_threads`` at once: a prefill
    that does not answer delays only its own READs (each question waits at most the timeout),
    and the ids queued for a prefill meanwhile go in one question. A thread ends once nothing is
    left to ask, so an idle decode holds none."""

    def __init__(self, ask: Callable[[Address, List[str]], Optional[List[str]]], max_threads: int = 8) -> None:
        self._ask = ask
        self.max_threads = max_threads
        self.lock = threading.Lock()
        self._pending: Dict[Address, List[str]] = {}  # ids to ask each prefill, not asked yet
        self._asking: set = set()  # prefills a thread is asking now
        self._running = 0  # threads started and not ended
        for attr, fresh in (("lock", threading.Lock), ("_asking", set), ("_running", int)):
            forksafe.renew_in_child(self, attr, fresh)  # a child has none of our threads
        self._answers: "queue.Queue[Tuple[Address, List[str], Optional[List[str]]]]" = queue.Queue()

    def submit(self, address: Address, remote_ids: List[str]) -> None:
        with self.lock:
            self._pending.setdefault(address, []).extend(remote_ids)
            unclaimed = sum(1 for a in self._pending if a not in self._asking)
            if self._running >= self.max_threads or self._running - len(self._asking) >= unclaimed:
                return  # a thread that is free (or will be) takes it
            self._running += 1
        try:
            threading.Thread(target=self._run, name="hotfix-lease-confirm", daemon=True).start()
        except BaseException:
            with self.lock:
                self._running -= 1
            raise

    def answers(self) -> List[Tuple[Address, List[str], Optional[List[str]]]]:
        out = []
        while True:
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while True:
            with self.lock:
                address = next((a for a in self._pending if a not in self._asking), None)
                if address is None:
                    self._running -= 1
                    return
                remote_ids = self._pending.pop(address)
                self._asking.add(address)
            try:
                held = self._ask(address, remote_ids)
            except Exception:
                held = None
            self._answers.put((address, remote_ids, held))
            with self.lock:
                self._asking.discard(address)


class _Read:
    __slots__ = ("address", "remote_id", "notifs", "first_asked", "last_asked", "in_flight")

    def __init__(self, address: Address, remote_id: str, notifs: list) -> None:
        self.address, self.remote_id, self.notifs = address, remote_id, notifs
        self.first_asked: Optional[float] = None  # when P was first asked (None: not yet)
        self.last_asked = 0.0
        self.in_flight = False  # a question about it is out


class PrefillConfirmations:
    """D's worker: READs whose completion notification it keeps until P confirmed.

    Lifecycle: :meth:`expect` when the READ is posted (its notifications kept) → :meth:`ask`
    once NIXL reports it done (one question per prefill and poll) → :meth:`answered` yields
    it with P's verdict: True (held), False (released), None (no answer) — or :meth:`forget`
    when the READ failed on its own (vLLM reports it). A question left unanswered while P's
    address still accepts connections is asked again, at most once per ``pause_s``, as long
    as the next one would end within ``patience_s`` of the first (``on_asked_again`` counts
    the questions); past that, or when nothing listens there, the verdict is None. At most
    ``cap`` READs: past it a READ keeps its notification (stock, unconfirmed)."""

    def __init__(self, asker: Asker, cap: int = 4096, patience_s: float = 0.0, pause_s: float = 0.0,
                 on_asked_again: Callable[[int], None] = lambda n: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.asker = asker
        self.cap = cap
        self.patience_s = patience_s
        self.pause_s = pause_s
        self._on_asked_again = on_asked_again
        self._clock = clock
        self._reads: Dict[str, _Read] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reads

    def has_room(self) -> bool:
        return len(self._reads) < self.cap

    def expect(self, req_id: str, address: Address, remote_id: str, notifs: list) -> None:
        self._reads[req_id] = _Read(address, remote_id, list(notifs))

    def forget(self, req_id: str) -> list:
        """Drop R; its kept notifications (the caller decides whether to send them)."""
        read = self._reads.pop(req_id, None)
        return read.notifs if read else []

    def ask(self, req_ids: Iterable[str]) -> None:
        now = self._clock()
        first = [self._reads[r] for r in req_ids if r in self._reads and self._reads[r].first_asked is None]
        for read in first:
            read.first_asked = now
        self._submit(first, now)

    def answered(self) -> List[Tuple[str, Optional[bool], list]]:
        now, out = self._clock(), []
        for address, remote_ids, held in self.asker.answers():
            asked = set(remote_ids)
            for req_id, read in list(self._reads.items()):
                if not read.in_flight or read.address != address or read.remote_id not in asked:
                    continue
                read.in_flight = False
                if held is None and self._may_ask_again(read, now):
                    continue  # P is there but silent: asked again below, once due
                del self._reads[req_id]
                out.append((req_id, read.remote_id in held if isinstance(held, list) else None, read.notifs))
        due = [r for r in self._reads.values()
               if r.first_asked is not None and not r.in_flight and now >= r.last_asked + self.pause_s]
        try:
            questions = self._submit(due, now)
        except Exception:  # no thread to ask with: those READs fail, never wait unasked
            questions = 0
            for req_id, read in list(self._reads.items()):
                if read in due and not read.in_flight:
                    del self._reads[req_id]
                    out.append((req_id, None, read.notifs))
        if questions:
            self._on_asked_again(questions)
        return out

    def _may_ask_again(self, read: _Read, now: float) -> bool:
        next_ends = max(now, read.last_asked + self.pause_s) + self.pause_s
        return next_ends - read.first_asked <= self.patience_s

    def _submit(self, reads: List[_Read], now: float) -> int:
        by_prefill: Dict[Address, List[str]] = {}
        for read in reads:
            by_prefill.setdefault(read.address, []).append(read.remote_id)
        for address, remote_ids in by_prefill.items():
            self.asker.submit(address, remote_ids)
            for read in reads:
                if read.address == address:
                    read.in_flight, read.last_asked = True, now
        return len(by_prefill)
