"""peer-reconnect (D12): a READ that lost its prefill to a network fault does not leave that
prefill unreachable until a restart.

When UCX fails a READ with ``NIXL_ERR_REMOTE_DISCONNECT`` (a partition, a dead switch, a peer
timeout), NIXL 1.5 marks the remote agent disconnected and keeps it: every later READ to that
prefill fails at setup with the same error, also once the network is back, while the agent's
metadata still counts as loaded (``check_remote_metadata`` is true). vLLM's decode worker keeps
using its cached agent for that engine id, so every request routed to that prefill fails
(``fail``: an error; ``recompute``: computed locally) until the prefill or the decode is
restarted (measured: ``benchmarks/nixl_post.py``, ``benchmarks/faults.py``). 0.27-0.31 have
no re-handshake at all; 0.32+ re-handshake a failed peer only once its metadata is gone
(vLLM #55471's check), which this NIXL never does.

The fix does what a restart does, for that prefill only: a worker that failed a READ on a
remote disconnect releases that prefill's NIXL state with vLLM's own
``_cleanup_remote_engine`` (what its TTL eviction calls) when the connector next hands it a
step (``start_load_kv``), once no READ, ready request or handshake of that prefill is left; the
requests of that step then find the engine unknown and handshake again (a fresh agent, a new
endpoint). A request that fails meanwhile goes through vLLM's failure policy as on stock.

Worker only, one process (no half to wait for). State: the prefill engine ids awaiting
release, bounded by the prefills this decode talks to (cap ``MAX_PENDING``; past it the
oldest is dropped, logged). Safe fallback on an internal error: nothing released this step
(stock behaviour).
"""
from __future__ import annotations

import sys
from collections import OrderedDict

from hotfix import log, status
from hotfix.runtime import contain, state_of
from hotfix.registry import LEAVE, FixSpec, Metric, Shape, Target

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_CLS = "NixlBaseConnectorWorker"
DISCONNECTED = "NIXL_ERR_REMOTE_DISCONNECT"
MAX_PENDING = 1024

SPEC = FixSpec(
    id="peer-reconnect",
    toggle="HOTFIX_PEER_RECONNECT",
    title="a prefill a READ lost to a network fault is handshaken again, not failed until a restart",
    defects=("D12",),
    targets=(
        # Where NIXL's worker fails a request's READ: inside the `except` that caught NIXL's
        # error (a failed setup or a failed state check), right after logging it.
        Target(f"{_NIXL}.base_worker", f"{_CLS}._handle_failed_transfer", "note_disconnected_prefill",
               "worker", {"50134fb19c89ff3c": Shape("0.27.0-0.29.0"), "9560b4fb1f2c26d3": Shape("0.30.0"),
                          "73807639bc3b7812": Shape("0.31.0"), "c2634ba0a6c48177": Shape("0.32.0-0.34.0")}),
        # Where the connector hands the step to its worker, which starts the step's READs and
        # handshakes: released before them.
        Target(f"{_NIXL}.connector", "NixlPullConnector.start_load_kv",
               "reconnect_disconnected_prefills", "worker",
               {"e394bbc7b3b1b885": Shape("0.27.0-0.34.0")}),
        # vLLM's own release of a remote engine's state (TTL eviction, shutdown): called as is.
        Target(f"{_NIXL}.base_worker", f"{_CLS}._cleanup_remote_engine", "", "worker",
               {"c384f62d32484d37": Shape("0.27.0-0.29.0", LEAVE), "15a9fc931986139b": Shape("0.30.0", LEAVE),
                "c4d8315dc62e58ed": Shape("0.31.0", LEAVE), "2b0602ae18f7bdf3": Shape("0.32.0", LEAVE),
                "96ea39067b5e806f": Shape("0.33.0", LEAVE), "a93fac82cb7f4540": Shape("0.34.0", LEAVE)}),
    ),
    upstream="none yet: vLLM #55471 (0.32+) re-handshakes a failed pull peer only when NIXL has "
    "dropped its metadata, which NIXL 1.5 does not do on a remote disconnect",
    remove_when="vLLM re-handshakes a peer after NIXL_ERR_REMOTE_DISCONNECT, or the fleet's NIXL "
    "drops a disconnected agent's metadata",
    metrics=(
        Metric("vllm:hotfix_prefills_reconnected", "Prefills whose NIXL state a decode released after "
               "a READ lost them to a remote disconnect (each stayed unreachable on stock)",
               ("released", "dropped"), by_kind=True,
               alert="rate > 0: READs to a prefill failed on the network; each was that prefill lost "
               "to this decode until a restart on stock"),
    ),
)

FIX = SPEC.id


class DisconnectedPrefills:
    """Prefill engine ids whose READ failed with a remote disconnect, awaiting release, in the
    order they failed. Bounded: past ``cap`` the oldest is dropped (returned, for the caller
    to log)."""

    def __init__(self, cap: int = MAX_PENDING) -> None:
        self.cap = cap
        self._pending: OrderedDict = OrderedDict()

    def note(self, engine_id) -> object | None:
        """Remember ``engine_id``; returns the engine id dropped to stay under the cap."""
        self._pending[engine_id] = None
        self._pending.move_to_end(engine_id)
        if len(self._pending) > self.cap:
            return self._pending.popitem(last=False)[0]
        return None

    def releasable(self, busy: set) -> list:
        """The pending engine ids not in ``busy`` (READs, ready requests or a handshake of
        theirs still under way); they leave the book."""
        ready = [engine_id for engine_id in self._pending if engine_id not in busy]
        for engine_id in ready:
            del self._pending[engine_id]
        return ready

    def __len__(self) -> int:
        return len(self._pending)


def note_disconnected_prefill(wrapped, instance, args, kwargs):
    """Remember the prefill of a READ the network lost, then fail the request as vLLM does.
    NIXL's error is the exception being handled: vLLM calls this from the ``except`` that
    caught it."""
    try:
        error = sys.exc_info()[1]
        if _is_remote_disconnect(error):
            meta = instance._recving_metadata.get(args[0] if args else kwargs.get("req_id"))
            if meta is not None and meta.remote is not None:
                book = state_of(instance, "_hotfix_disconnected", DisconnectedPrefills)
                dropped = book.note(meta.remote.engine_id)
                if dropped is not None:
                    _count("dropped")
                    log.error("hotfix.nixl.reconnect_dropped", fix=FIX, engine_id=dropped,
                              reason=f"more than {MAX_PENDING} prefills awaiting release; the oldest is left as stock")
    except Exception as exc:
        contain(FIX, f"{_CLS}._handle_failed_transfer", exc, fallback="this failure's prefill left as stock")
    return wrapped(*args, **kwargs)


def _is_remote_disconnect(error) -> bool:
    """NIXL's ``nixlRemoteDisconnectError`` (Python bindings), or its status in a message."""
    return error is not None and (type(error).__name__ == "nixlRemoteDisconnectError"
                                  or DISCONNECTED in str(error))


def reconnect_disconnected_prefills(wrapped, instance, args, kwargs):
    """Release each disconnected prefill nothing uses any more, then start the step's loads:
    its requests handshake that prefill again."""
    worker = getattr(instance, "connector_worker", None)
    book = worker.__dict__.get("_hotfix_disconnected") if worker is not None else None
    if book:
        try:
            for engine_id in book.releasable(_prefills_in_use(worker)):
                if engine_id in worker._remote_agents:
                    worker._cleanup_remote_engine(engine_id, log_eviction=False)
                    _count("released")
                    log.warning("hotfix.nixl.prefill_reconnect", fix=FIX, engine_id=engine_id,
                                reason="a READ lost this prefill to a remote disconnect; its next "
                                "request handshakes again")
        except Exception as exc:
            contain(FIX, "NixlPullConnector.start_load_kv", exc, fallback="nothing released this step")
    return wrapped(*args, **kwargs)


def _prefills_in_use(worker) -> set:
    """Prefills a READ handle, a request whose handshake is done, or a handshake still needs."""
    with worker._handshake_lock:  # (a handshake's callback drops its future from its thread)
        in_use = set(worker._handshake_futures)
    for req_id, handles in list(worker._recving_transfers.items()):
        meta = worker._recving_metadata.get(req_id)
        if handles and meta is not None and meta.remote is not None:
            in_use.add(meta.remote.engine_id)
    for _req_id, meta in list(worker._ready_requests.queue):
        if meta.remote is not None:
            in_use.add(meta.remote.engine_id)
    return in_use


def _count(kind: str) -> None:
    status.count(FIX, kind)
