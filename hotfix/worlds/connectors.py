"""Test KV connectors, loaded by vLLM's own factory as MultiConnector children.

The scheduler world names this module in each child's
`kv_connector_module_path`; vLLM imports it and builds the children with
`(vllm_config, role, kv_cache_config)` on both sides. A child finds its world
through `kv_connector_extra_config["world"]` and asks it when to report.

* `CacheLoader`: an LMCache-MP-shaped cache (metadata `.requests` of ops with
  `.direction` "RETRIEVE"/"STORE" and `.request_id`). Loads only when the
  scheduler gives it `num_external_tokens > 0` (lmcache >= 0.5.5).
* `BuggyLMCacheMPLoader`: the same, but retrieves its own hit although
  MultiConnector passed it 0 tokens (lmcache <= 0.5.4, in-tree MP <= 0.29).

  What the real one (LMCache's own `LMCacheMPConnector`, 0.5.4/0.5.6, which the engine world
  runs against a real server: tests/test_engine_world_lmcache.py, and the P/D world:
  tests/test_pd_world_lmcache.py) does and these model: its
  metadata is `LMCacheMPConnectorMetadata.requests`, a list of `LMCacheMPRequestMetadata`
  (`request_id`, `direction` the str "RETRIEVE"/"STORE", `op` with per-group `block_ids`);
  0.5.4's `update_state_after_alloc` retrieves whenever its lookup hit exceeds vLLM's
  (`tracker.needs_retrieve()`), 0.5.6 only with `num_external_tokens > 0`. What they do not
  model: the server lookup that makes the real hit asynchronous (a request can wait a step
  for it), retrieves and stores in whole chunks (256 tokens by default), the bytes (these
  write nothing), and 0.5.6's `BYPASS_LMCACHE` after a failed load.
* `NixlPullLoader`: vLLM's real `NixlPullConnector` scheduler side (its
  `request_finished`, heartbeats and metadata are the production code); only
  the worker's UCX READ is emulated, because NIXL cannot run in-process here.

A load ends when the timeline says: `LoadDone`, or `LoadFailed` (vLLM 0.30+:
the request is also in `failed_recving`; the NIXL emulation, like NIXL
without HMA, also reports the failed READ's blocks as invalid, which on 0.27-0.29
is all a failed READ reports besides `finished_recving`).

A CacheLoader built with `async_save` holds every finished request's
blocks (`request_finished` returns True, like LMCache MP with stores in
flight); its workers read them and report `finished_sending` when the
timeline says so.
"""

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.utils.math_utils import cdiv

from hotfix.worlds.timeline import LoadFailed

_WORLDS: dict[str, Any] = {}


def attach(world_id: str, world: Any) -> None:
    _WORLDS[world_id] = world


def detach(world_id: str) -> None:
    _WORLDS.pop(world_id, None)


@dataclass(frozen=True)
class GivenOutput:
    """What the scheduler-side child saw in `update_connector_output`."""

    step: int
    finished_recving: frozenset[str]
    finished_sending: frozenset[str]


@dataclass(frozen=True)
class BlockOp:
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class CacheOp:
    request_id: str
    direction: str
    op: BlockOp


class CacheMetadata(KVConnectorMetadata):
    def __init__(self, requests: list[CacheOp]) -> None:
        super().__init__()
        self.requests = requests


class _WorldChild:
    """Plumbing shared by the children: world lookup, transfers, reports."""

    def _join_world(self, vllm_config, role: KVConnectorRole) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.name: str = extra["name"]
        self.rank: int | None = extra.get("tp_rank")
        self.world = _WORLDS[extra["world"]]
        self.given_outputs: list[GivenOutput] = []
        self._loads: dict[str, tuple[int, ...]] = {}
        self._saves: dict[str, tuple[int, ...]] = {}
        self.world.register_child(self, role)

    @property
    def label(self) -> str:
        return f"{self.name}@rank{self.rank}"

    def _start_load(self, req_id: str, block_ids) -> None:
        """A second load under an id still loading joins the first, as NIXL appends the new
        READ's handles to the id's list and reports the id once every handle is done."""
        self._loads[req_id] = self._loads.get(req_id, ()) + tuple(block_ids)
        self.world.tracker.write_started(self.world.step, self.label, req_id, self._loads[req_id])

    def _start_save(self, req_id: str, block_ids) -> None:
        self._saves[req_id] = tuple(block_ids)
        self.world.tracker.read_started(self.world.step, self.label, req_id, block_ids)

    def _collect_reports(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving ⊆ finished_recving)."""
        step = self.world.step
        ended = {r: self.world.take_due("load", r, self.name, self.rank) for r in self._loads}
        recving = {r for r, event in ended.items() if event}
        failed = {r for r, event in ended.items() if isinstance(event, LoadFailed)}
        sending = {
            r for r in self._saves if self.world.take_due("save", r, self.name, self.rank)
        }
        for req_id in recving:
            del self._loads[req_id]
            self.world.tracker.write_ended(step, self.label, req_id)
        for req_id in sending:
            del self._saves[req_id]
            self.world.tracker.read_ended(step, self.label, req_id)
        recving |= self.world.take_strays("recv", self.name, self.rank)
        sending |= self.world.take_strays("send", self.name, self.rank)
        self.world.note_worker_report(self, sending, recving)
        return sending, recving, failed

    def _record_given(self, connector_output) -> None:
        self.given_outputs.append(
            GivenOutput(
                self.world.step,
                frozenset(connector_output.finished_recving or ()),
                frozenset(connector_output.finished_sending or ()),
            )
        )


class CacheLoader(_WorldChild, KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._join_world(vllm_config, role)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.async_save: bool = extra.get("async_save", False)
        self._block_size = vllm_config.cache_config.block_size
        self._hits: dict[str, int] = {}
        self._new_tokens: dict[str, int] = {}
        self._pending: list[CacheOp] = []

    # Scheduler side.
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        hit = self.world.hit(request.request_id, self.name)
        new_tokens = max(hit - num_computed_tokens, 0)
        self._hits[request.request_id] = hit
        self._new_tokens[request.request_id] = new_tokens
        return (new_tokens, True) if new_tokens else (0, False)

    def _retrieves(self, looked_up: int, num_external_tokens: int) -> bool:
        return num_external_tokens > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        # One retrieve per lookup, like LMCache's request tracker.
        looked_up = self._new_tokens.pop(request.request_id, 0)
        if not self._retrieves(looked_up, num_external_tokens):
            return
        covered = cdiv(self._hits[request.request_id], self._block_size)
        block_ids = tuple(
            b.block_id
            for b in blocks.blocks[0][:covered]
            if b.block_hash is None and not b.is_null
        )
        if block_ids:
            self._pending.append(
                CacheOp(request.request_id, "RETRIEVE", BlockOp(block_ids))
            )

    def build_connector_meta(self, scheduler_output) -> CacheMetadata:
        ops, self._pending = self._pending, []
        return CacheMetadata(ops)

    def request_finished_all_groups(self, request, block_ids):
        self._hits.pop(request.request_id, None)
        self._new_tokens.pop(request.request_id, None)
        if not (self.async_save and any(block_ids)):
            return False, None
        self._pending.append(
            CacheOp(request.request_id, "STORE", BlockOp(tuple(block_ids[0])))
        )
        return True, None

    def update_connector_output(self, connector_output) -> None:
        self._record_given(connector_output)

    # Worker side.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, CacheMetadata)
        for op in metadata.requests:
            if op.direction == "RETRIEVE":
                self._start_load(op.request_id, op.op.block_ids)
            else:
                self._start_save(op.request_id, op.op.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving, _ = self._collect_reports()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM 0.30+: the base class's would drop the loads that failed."""
        return _transfer_results(*self._collect_reports())


def _transfer_results(sending: set[str], recving: set[str], failed: set[str]):
    """What a child's `get_transfer_results` returns (vLLM 0.30+)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )

    return KVConnectorTransferResults(
        finished_sending=sending, finished_recving=recving, failed_recving=failed
    )


class BuggyLMCacheMPLoader(CacheLoader):
    def _retrieves(self, looked_up: int, num_external_tokens: int) -> bool:
        # The defect: its own lookup hit wins over the 0 MultiConnector passed.
        return looked_up > 0


class _EmulatedPullWorker:
    """Stands in for NixlPullConnectorWorker: a READ per real pull, reported
    when the timeline says the transfer is done. Notify-only entries (no
    local blocks) are never reported, as in 0.27–0.29 without a handshake
    failure."""

    use_host_buffer = False
    copy_blocks = None

    def __init__(self, child: "NixlPullLoader") -> None:
        self._child = child
        self._invalid_block_ids: set[int] = set()

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        for req_id, meta in metadata.reqs_to_recv.items():
            block_ids = [b for group in meta.local_block_ids for b in group]
            if block_ids:
                self._child._start_load(req_id, block_ids)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """0.27-0.29: a failed READ is reported finished, its blocks invalid."""
        sending, recving, _ = self._reports_marking_failed_reads_invalid()
        return sending, recving

    def get_transfer_results(self):
        """The worker entry point NIXL's facade calls from vLLM 0.30 on. Like NIXL without
        HMA, a failed READ also marks its local blocks invalid, in the same pass."""
        return _transfer_results(*self._reports_marking_failed_reads_invalid())

    def _reports_marking_failed_reads_invalid(self) -> tuple[set[str], set[str], set[str]]:
        reading = dict(self._child._loads)
        sending, recving, failed = self._child._collect_reports()
        self._invalid_block_ids.update(b for req_id in failed for b in reading[req_id])
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def get_kv_connector_stats(self) -> None:
        return None

    def shutdown(self) -> None:
        return


class NixlPullLoader(_WorldChild, NixlPullConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        if role == KVConnectorRole.SCHEDULER:
            NixlPullConnector.__init__(self, vllm_config, role, kv_cache_config)
        else:
            NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
            self.connector_worker = _EmulatedPullWorker(self)
        self._join_world(vllm_config, role)
        self.heartbeat_stops: list[tuple[int, str]] = []

    def heartbeating(self) -> frozenset[str]:
        """Requests whose P-side lease NIXL's scheduler still renews."""
        return frozenset(self.connector_scheduler._heartbeat_req_engine)

    def update_connector_output(self, connector_output) -> None:
        """Records what NIXL was handed, and which leases that ended (D5)."""
        self._record_given(connector_output)
        before = self.heartbeating()
        super().update_connector_output(connector_output)
        for req_id in sorted(before - self.heartbeating()):
            self.heartbeat_stops.append((self.world.step, req_id))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        assert isinstance(self._connector_metadata, NixlConnectorMetadata)
        self.connector_worker.start_load_kv(self._connector_metadata)
