"""Connectors the P/D world's decode engine loads by ``kv_connector_module_path``.

vLLM imports this module in the decode engine's EngineCore (scheduler side) and worker
(worker side); the two sides share nothing but the metadata vLLM ships between them, and
each worker-side instance counts engine steps by its own ``start_load_kv`` calls (one per
step, forward or not).

* ``NixlConnector`` — vLLM's own class, re-exported: the prefill engine and the NIXL-only
  decode load it through this module, so that :func:`poll_nixl_progress_instead_of_spinning`
  runs in their processes too. Every engine loading this module gets that agent, which also
  holds a READ's post while a test's pause file exists (:func:`hold_the_post_while_paused`).
* ``DelayedReadNixlConnector`` — the real ``NixlConnector`` (its scheduler, metadata, READ,
  completion report and ``request_finished`` are vLLM's), except that the worker hands a
  pull to NIXL ``read_delay_steps`` steps after the metadata asked for it, and not before
  ``read_delay_s`` seconds have passed (a step count orders it against this module's cache
  double; against a real second connector, whose retrieve takes real time, only seconds do);
  at TP>1 a rank named in ``read_lag_steps_by_rank`` starts it only once rank 0's NIXL
  reported the request, and that many steps later still (a slower rank that finishes last on
  any box: the ranks meet in a file per request under ``rank_reports_dir``).
  That stands in for a GB-scale pull over TCP on a model whose KV is a few KiB: test-only,
  no vLLM file changes, and the hotfix still sees the pull at bind time (``reqs_to_recv``)
  as it would.
  It also ships, with each step's metadata, the blocks every request was allocated and
  the requests vLLM finished (``request_finished``: finish, abort) since the last step, so
  the worker logs them, READs and NIXL's reports on one step scale and one clock (``t=``,
  ``time.monotonic()``, one clock for every process on the host; a finish is stamped when
  vLLM finished the request, not when the worker heard of it).
* ``EagerRetrieveConnector`` — LMCache MP <= 0.5.4 (and vLLM's in-tree MP connector <= 0.29)
  as MultiConnector's second child: on its own cache hit it retrieves into the request's
  blocks although MultiConnector chose NIXL and gave it ``num_external_tokens=0``, and
  reports ``finished_recving`` ``retrieve_steps`` steps later. Its metadata has LMCache
  MP's shape (``.requests`` of ops with ``.request_id`` and ``.direction``). It writes no
  KV: whatever it "loads" is not what the NIXL pull is about to write. Like the in-tree
  LMCache MP connector it does not implement ``SupportsHMA``.
* ``ServerStoppingLMCacheMPConnector`` — the real LMCache MP connector (the class vLLM
  resolves ``LMCacheMPConnector`` to: lmcache's own when lmcache is on the engine's path),
  except that once a test armed it (the file named by ``$PD_WORLD_LMCACHE_STOP_ARMED``
  exists) the worker SIGSTOPs the LMCache server's process group right before it sends the
  next step's RETRIEVEs (or SIGKILLs it, when the file says "kill"): the server hangs (or is
  gone) with that retrieve in flight (vLLM #49089's ordering), deterministically, where a test's own signal would race a retrieve that takes
  milliseconds. Everything else, the retrieve included, is LMCache's. Defined on first use,
  so that engines without lmcache on their path import this module too.
"""
from __future__ import annotations

import copy
import functools
import gc
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pd_world import (CACHE_HIT_PARAM, LMCACHE_SERVER_PGID_VAR, LMCACHE_STOP_ARMED_VAR, POST_PAUSE_MAX_S,
                      POST_PAUSE_VAR, READER_BUSY_LOOP_VAR, WORKER_RECHECK_VAR)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector, NixlPullConnector
from vllm.logger import init_logger
from without_hotfix import drop_hotfix_if_asked

logger = init_logger("vllm.pd_world")

__all__ = ["NixlConnector", "DelayedReadNixlConnector", "EagerRetrieveConnector"]


NIXL_PROGRESS_POLL_US = 1000
RANK_0_REPORT_WAIT_S = 60.0  # a lagging rank's READ waits this long at most for rank 0's report


def poll_nixl_progress_instead_of_spinning() -> None:
    """Make NIXL's UCX progress thread wait in ``poll()`` (up to 1 ms) instead of spinning.

    NIXL's Python agent sets ``pthrDelay = 0``; its UCX backend's shared progress thread then
    calls ``poll(fds, 0)`` in a loop and keeps one core busy per NIXL agent, idle or not
    (measured here: 100 % of a core per engine worker). A GPU node has cores to spare; a
    2-core CI machine running seven engines does not: decode steps took 20 s, first
    handshakes missed NIXL's 5-s timeout and P's leases lapsed. With a delay the same thread
    sleeps on UCX's event fds and wakes on each event or after 1 ms, so transfers still
    progress without any call from vLLM. Only the delay changes: vLLM's and NIXL's code,
    backends and threads are the real ones.
    """
    from vllm.distributed import nixl_utils

    bindings = sys.modules[nixl_utils.NixlWrapper.__module__].nixlBind
    if getattr(bindings.nixlAgent, "pd_world_polls", False):
        return

    class PolledProgressAgent(bindings.nixlAgent):
        pd_world_polls = True

        def __init__(self, name, config):
            config.pthrDelay = max(config.pthrDelay, NIXL_PROGRESS_POLL_US)
            super().__init__(name, config)

        def postXferReq(self, *args, **kwargs):  # noqa: N802  (the bindings' name)
            hold_the_post_while_paused()
            return super().postXferReq(*args, **kwargs)

    bindings.nixlAgent = PolledProgressAgent


def hold_the_post_while_paused() -> None:
    """A test's stall of this engine's worker right where a READ is posted: while the file
    ``$PD_WORLD_POST_PAUSE_FILE`` exists (at most :data:`POST_PAUSE_MAX_S`), the worker waits
    before NIXL posts the READ, as a worker SIGSTOPped mid-READ would: no step, no heartbeat,
    no byte read until it goes on. The READ vLLM already set up (and lease-guard judged) then
    copies whatever the prefill's blocks hold by then. NIXL's post itself is the real one."""
    pause = os.environ.get(POST_PAUSE_VAR)
    if not pause or not os.path.exists(pause):
        return
    logger.info("pd_world: READ post paused while %s exists", pause)
    deadline = time.monotonic() + POST_PAUSE_MAX_S
    while os.path.exists(pause) and time.monotonic() < deadline:
        time.sleep(0.05)
    logger.info("pd_world: READ post resumed")


poll_nixl_progress_instead_of_spinning()


def recheck_the_ring_buffer_after_a_lost_wake_up() -> None:
    """With ``$PD_WORLD_WORKER_RECHECK_MS``, this process re-reads vLLM's shared-memory ring
    buffer that often while it waits on it, instead of every 5 s.

    The EngineCore wakes its workers through the ring buffer plus a ZMQ notification that the
    PUB socket may drop (vLLM PR #45224); a worker that missed one finds the step's request
    only at its next recheck, 5 s later (``SHM_READER_RECHECK_INTERVAL_MS``, no setting). In
    the faults world (eight engine processes and their NIXL and ZMQ threads on 2 cores) the
    hotfix decode's EngineCore once waited 20 s on its worker during a healthy READ, and the
    READ passed the load bound; py-spy had caught both sides waiting to read before (stop
    38). The queue alone did not lose a wake-up (``benchmarks/ring_buffer_wakeups.py``), so
    the cause is not proven; the bound on the wait is what the world needs. Only the
    interval changes: the buffer and the notification are vLLM's."""
    recheck_ms = os.environ.get(WORKER_RECHECK_VAR)
    if not recheck_ms:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        logger.warning("pd_world: this vLLM has no SHM_READER_RECHECK_INTERVAL_MS; ring buffer recheck unchanged")
        return
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(recheck_ms)
    logger.info("pd_world: ring buffer recheck after a lost wake-up: %s ms", recheck_ms)


recheck_the_ring_buffer_after_a_lost_wake_up()


def shorten_the_ring_buffer_readers_busy_loop() -> None:
    """With ``$PD_WORLD_READER_BUSY_LOOP_S``, this process's ring-buffer readers (the
    EngineCore reading its workers' answers, a worker reading the EngineCore's steps) spin
    that long after each read instead of vLLM's 1 s (``SpinCondition(busy_loop_s=1)``, no
    setting): each spinning reader calls ``sched_yield`` in a loop, which on a 2-core box with
    four engine processes takes the cores the computing worker needs. The queues exist before
    this module is imported (the connector is made after the executor), so the readers already
    made are changed too. Only the spin changes: past it a reader waits in vLLM's own poll."""
    raw = os.environ.get(READER_BUSY_LOOP_VAR, "").strip()
    if not raw:
        return
    try:
        busy_s = float(raw)
    except ValueError:
        logger.warning("pd_world: %s=%r is not a number of seconds; ring buffer readers' busy loop unchanged",
                       READER_BUSY_LOOP_VAR, raw)
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is None:
        logger.warning("pd_world: this vLLM has no SpinCondition; ring buffer readers' busy loop unchanged")
        return
    readers = [obj for obj in gc.get_objects() if isinstance(obj, spin) and obj.is_reader]
    for reader in readers:
        reader.busy_loop_s = busy_s
    made = spin.__init__

    @functools.wraps(made)
    def made_with_the_worlds_busy_loop(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = busy_s

    spin.__init__ = made_with_the_worlds_busy_loop
    logger.info("pd_world: ring buffer readers busy-loop %s s after a read (%d existing)", busy_s, len(readers))


shorten_the_ring_buffer_readers_busy_loop()


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _extra(vllm_config) -> dict:
    return vllm_config.kv_transfer_config.kv_connector_extra_config


class DelayedReadNixlConnector(NixlPullConnector):
    """NixlConnector whose worker starts each pull ``read_delay_steps`` engine steps late."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        drop_hotfix_if_asked(_extra(vllm_config), role == KVConnectorRole.SCHEDULER)
        self._read_delay_steps = int(_extra(vllm_config).get("read_delay_steps", 0))
        self._rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self._read_lag_steps = int((_extra(vllm_config).get("read_lag_steps_by_rank") or {}).get(str(self._rank), 0))
        self._read_delay_s = float(_extra(vllm_config).get("read_delay_s", 0.0))
        reports_dir = _extra(vllm_config).get("rank_reports_dir")
        self._rank_reports = Path(reports_dir) if reports_dir else None
        self._step = 0
        # req_id -> (step, time it is due, this rank's lag still to come, ReqMeta)
        self._held: dict[str, tuple[int, float, int, object]] = {}
        # scheduler side, since the last metadata: req_id -> blocks allocated; finished req_ids
        self._allocated: dict[str, list[int]] = {}
        self._finished: list[tuple[str, float]] = []

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._allocated[request.request_id] = [b for group in blocks.get_block_ids() for b in group]
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request, block_ids):
        self._finished.append((request.request_id, time.monotonic()))
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output):
        metadata = super().build_connector_meta(scheduler_output)
        metadata.pd_world_allocated, self._allocated = self._allocated, {}
        metadata.pd_world_finished, self._finished = self._finished, []
        return metadata

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._step += 1
        metadata = self._connector_metadata
        now = time.monotonic()
        for req_id, at in metadata.pd_world_finished:
            logger.info("pd_world: %s finished before step %d (t=%.3f)", req_id, self._step, at)
        for req_id, block_ids in metadata.pd_world_allocated.items():
            logger.info("pd_world: %s allocated blocks %s at step %d (t=%.3f)", req_id, block_ids,
                        self._step, now)
        for req_id, meta in metadata.reqs_to_recv.items():
            self._held[req_id] = (self._step + self._read_delay_steps, now + self._read_delay_s,
                                  self._read_lag_steps, meta)
            logger.info("pd_world: NIXL pull of %s asked at step %d, READ due at step %d and after %.1f s, "
                        "then %d steps after rank 0 reported it", req_id, self._step, self._step + self._read_delay_steps,
                        self._read_delay_s, self._read_lag_steps)
        due = {}
        for req_id, (step, at, lag, meta) in list(self._held.items()):
            if step <= self._step and at <= now:
                if lag:
                    if self._rank_0_reported(req_id, since=at):
                        self._held[req_id] = (self._step + lag, at, 0, meta)
                else:
                    due[req_id] = meta
        for req_id, meta in due.items():
            del self._held[req_id]
            logger.info("pd_world: NIXL READ of %s starts at step %d into blocks %s on rank %d", req_id,
                        self._step, [b for group in meta.local_block_ids for b in group], self._rank)
        delayed = copy.copy(metadata)
        delayed.reqs_to_recv = due
        self.connector_worker.start_load_kv(delayed)

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        self._log_received(recving)
        return sending, recving

    if hasattr(NixlPullConnector, "get_transfer_results"):
        def get_transfer_results(self, finished_req_ids):
            """The worker entry point from vLLM 0.30 on; NIXL's does not go through get_finished."""
            results = super().get_transfer_results(finished_req_ids)
            self._log_received(results.finished_recving)
            return results

    def _log_received(self, recving) -> None:
        for req_id in recving or ():
            logger.info("pd_world: NIXL reports %s received at step %d (t=%.3f) on rank %d", req_id,
                        self._step, time.monotonic(), self._rank)
            if self._rank_reports is not None and self._rank == 0:
                (self._rank_reports / req_id).touch()

    def _rank_0_reported(self, req_id: str, since: float) -> bool:
        """Whether a lagging rank may count its lag: rank 0 reported ``req_id`` (or has not in
        :data:`RANK_0_REPORT_WAIT_S` after the READ was due: then this rank goes on alone)."""
        if self._rank_reports is None or (self._rank_reports / req_id).exists():
            return True
        if time.monotonic() - since > RANK_0_REPORT_WAIT_S:
            logger.warning("pd_world: rank 0 did not report %s in %.0f s; rank %d READs it anyway", req_id,
                           RANK_0_REPORT_WAIT_S, self._rank)
            return True
        return False


@dataclass
class RetrieveOp:
    request_id: str
    direction: str
    block_ids: list[int]


class RetrieveMetadata(KVConnectorMetadata):
    def __init__(self, requests: list[RetrieveOp]) -> None:
        self.requests = requests


class EagerRetrieveConnector(KVConnectorBase_V1):
    """A decode-side cache that retrieves its hit whatever MultiConnector decided."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        drop_hotfix_if_asked(_extra(vllm_config), role == KVConnectorRole.SCHEDULER)
        self._retrieve_steps = int(_extra(vllm_config).get("retrieve_steps", 1))
        self._block_size = vllm_config.cache_config.block_size
        self._hits: dict[str, int] = {}  # scheduler side: req_id -> hit tokens
        self._retrieves: list[RetrieveOp] = []
        self._step = 0  # worker side
        self._loading: dict[str, int] = {}  # req_id -> step it reports in

    # Scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not (request.kv_transfer_params or {}).get(CACHE_HIT_PARAM):
            return 0, False
        full_blocks = len(request.prompt_token_ids) // self._block_size * self._block_size
        hit = full_blocks - num_computed_tokens
        if hit <= 0:
            return 0, False
        self._hits[request.request_id] = hit
        return hit, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        hit = self._hits.pop(request.request_id, 0)
        if hit:  # the modelled defect: num_external_tokens (0 here) is not consulted
            block_ids = blocks.get_block_ids()[0][: hit // self._block_size]
            self._retrieves.append(RetrieveOp(request.request_id, "RETRIEVE", list(block_ids)))

    def build_connector_meta(self, scheduler_output):
        metadata = RetrieveMetadata(self._retrieves)
        self._retrieves = []
        return metadata

    def request_finished(self, request, block_ids):
        self._hits.pop(request.request_id, None)
        return False, None

    # Worker side --------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._step += 1
        for op in self._connector_metadata.requests:
            if op.direction == "RETRIEVE":
                self._loading[op.request_id] = self._step + self._retrieve_steps
                logger.info("pd_world: cache RETRIEVE of %s starts at step %d", op.request_id, self._step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids):
        done = {req_id for req_id, at in self._loading.items() if at <= self._step}
        for req_id in done:
            del self._loading[req_id]
            logger.info("pd_world: cache reports %s received at step %d", req_id, self._step)
        return None, done or None


def __getattr__(name: str):
    if name == "ServerStoppingLMCacheMPConnector":
        return _server_stopping_lmcache()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _server_stopping_lmcache():
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import LMCacheMPConnector

    class ServerStoppingLMCacheMPConnector(LMCacheMPConnector):
        """LMCache MP whose worker stops the server before an armed step's RETRIEVEs."""

        def start_load_kv(self, forward_context, **kwargs) -> None:
            stop_server_if_armed(getattr(self._get_connector_metadata(), "requests", ()))
            return super().start_load_kv(forward_context, **kwargs)

    return ServerStoppingLMCacheMPConnector


def stop_server_if_armed(ops) -> None:
    """SIGSTOP the server (hung), or SIGKILL it when the arm file's text starts with "kill"
    (crashed: its sockets close, its pool is gone)."""
    retrieves = [op.request_id for op in ops if op.direction == "RETRIEVE"]
    armed = os.environ.get(LMCACHE_STOP_ARMED_VAR)
    if not (retrieves and armed and os.path.exists(armed)):
        return
    kill = Path(armed).read_text().startswith("kill")
    os.unlink(armed)
    os.killpg(int(os.environ[LMCACHE_SERVER_PGID_VAR]), signal.SIGKILL if kill else signal.SIGSTOP)
    logger.info("pd_world: LMCache server %s before the RETRIEVE of %s", "killed" if kill else "stopped",
                ",".join(retrieves))
