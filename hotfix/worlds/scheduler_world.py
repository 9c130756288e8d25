"""Scheduler world: vLLM's real scheduler and MultiConnector, driven tick by tick.

What is real: `Scheduler`/`AsyncScheduler` (picked by vLLM from the
scheduler config), the KV cache manager and block pool, `MultiConnector` on
the scheduler side (built by the Scheduler through `KVConnectorFactory`) and
on the worker side (one instance per TP rank, built through the factory with
role WORKER), vLLM's `NixlPullConnectorScheduler`, and `KVOutputAggregator`.
What is emulated: the model (it samples a filler token, or a stop token when
the timeline says so) and the transfers themselves (children in
`hotfix.worlds.connectors` report when the timeline says).

One tick mirrors `EngineCore.step` / `step_with_batch_queue`: timeline events,
`schedule()`, the workers' connector calls for that batch (bind metadata,
`start_load_kv`, `get_transfer_results` or `get_finished`, ...), the
aggregated `ModelRunnerOutput`, then `update_from_output` — one batch later
under async scheduling, as with the batch queue.

Every World builds fresh vLLM objects and looks methods up on each call, so
patches applied to vLLM classes in-process (the hotfix) take effect for the
next World.
"""

import copy
import dataclasses
import inspect
import json
import linecache
import pickle
import tempfile
import time
import traceback
import types
import uuid
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from hotfix.worlds import connectors
from hotfix.worlds.timeline import (
    Abort,
    Arrive,
    Elapse,
    Event,
    LoadDone,
    LoadFailed,
    Preempt,
    SaveDone,
    Stop,
    StrayReport,
)
from hotfix.worlds.tracker import BlockTracker

CONNECTORS_MODULE = "hotfix.worlds.connectors"
FILLER_TOKEN = 7
STOP_TOKEN = 3
HEAD_SIZE = 64
NUM_KV_HEADS = 4
MAX_MODEL_LEN = 1024

_model_dir: tempfile.TemporaryDirectory | None = None


def _tiny_model_dir() -> str:
    """A config-only llama checkpoint: the scheduler never loads weights."""
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.TemporaryDirectory(prefix="hotfix-world-model-")
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": NUM_KV_HEADS * HEAD_SIZE,
            "head_dim": HEAD_SIZE,
            "intermediate_size": 512,
            "num_hidden_layers": 1,
            "num_attention_heads": NUM_KV_HEADS,
            "num_key_value_heads": NUM_KV_HEADS,
            "max_position_embeddings": MAX_MODEL_LEN,
            "vocab_size": 128,
            "rms_norm_eps": 1e-6,
            "torch_dtype": "float32",
        }
        Path(_model_dir.name, "config.json").write_text(json.dumps(config))
    return _model_dir.name


# vLLM 0.33 can start an async KV load one step late: `schedule()` parks it in
# `Scheduler.deferred_loads` and `update_from_output` starts it from
# `_drain_deferred_loads` (before that step's `_update_from_kv_xfer_finished`).
DEFERRED_LOADS_SUPPORTED = hasattr(Scheduler, "_drain_deferred_loads")


def _deferred_loads_kwargs(enabled: bool, num_blocks: int) -> dict:
    """KVCacheConfig fields that turn vLLM's own deferral of async loads on.

    vLLM 0.33 defers (`Scheduler.defer_async_loads`) only when batches overlap on a
    KV consumer (`defer_block_free`: async scheduling or PP) *and* the KV cache has
    a HiSparse host pool (`kv_cache_config.hisparse_host_num_blocks is not None`).
    In the scheduler and the KV cache manager nothing else reads that field (the
    host pool size only matters for host-resident KV tensors, of which the world
    has none), so giving it a value selects the deferral path and nothing else.
    """
    if not enabled:
        return {}
    if not DEFERRED_LOADS_SUPPORTED:
        raise ValueError(
            "defer_async_loads: this vLLM has no deferred async loads "
            "(Scheduler._drain_deferred_loads, vLLM 0.33+)"
        )
    return {"hisparse_host_num_blocks": num_blocks}


# vLLM 0.30+: a worker reports a failed async load in `failed_recving` (and, as for any
# load, in `finished_recving`); 0.27-0.29 have no such field.
FAILED_RECVS_SUPPORTED = any(
    f.name == "failed_recving" for f in dataclasses.fields(KVConnectorOutput)
)

# vLLM 0.34+ can cap the async KV loads in flight (SchedulerConfig.max_num_inflight_kv_loads).
INFLIGHT_LIMIT_SUPPORTED = any(f.name == "max_num_inflight_kv_loads" for f in dataclasses.fields(SchedulerConfig))


def _inflight_limit(limit: int | None) -> int | None:
    if limit is not None and not INFLIGHT_LIMIT_SUPPORTED:
        raise ValueError("max_num_inflight_kv_loads: this vLLM has no cap on in-flight KV loads "
                         "(SchedulerConfig.max_num_inflight_kv_loads, vLLM 0.34+)")
    return limit

# vLLM 0.27-0.33's ModelRunnerOutput carries req_id_to_index; 0.34 reads the row from req_ids.
_OUTPUT_HAS_INDEX = any(f.name == "req_id_to_index" for f in dataclasses.fields(ModelRunnerOutput))


def runner_output(req_ids=(), **fields) -> ModelRunnerOutput:
    """A worker's ModelRunnerOutput for ``req_ids`` (in batch order), on every release."""
    if _OUTPUT_HAS_INDEX:
        fields["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), **fields)


DRIVEN_CLASSES = (
    Scheduler,
    AsyncScheduler,
    MultiConnector,
    NixlBaseConnectorScheduler,
    NixlPullConnectorScheduler,
    NixlBaseConnector,
    NixlPullConnector,
    KVOutputAggregator,
)


def _kv_cache_groups(block_size: int, sliding_window: int | None) -> list[KVCacheGroupSpec]:
    shape = {"block_size": block_size, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
             "dtype": torch.float32}
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**shape))]
    if sliding_window is not None:
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                                       SlidingWindowSpec(sliding_window=sliding_window, **shape)))
    return groups


def patched_methods() -> list[str]:
    """`Class.method` of the vLLM code the world drives that something has
    wrapped in this process (the hotfix): [] on stock vLLM. Wrappers proxy
    `__class__`, hence the exact type test."""
    return [
        f"{cls.__name__}.{name}"
        for cls in DRIVEN_CLASSES
        for name, attr in vars(cls).items()
        if callable(attr)
        and not isinstance(attr, type)
        and type(attr) not in (types.FunctionType, staticmethod, classmethod)
    ]


@dataclass(frozen=True)
class Child:
    """One MultiConnector child: `kind` is a class in hotfix.worlds.connectors."""

    kind: str
    name: str
    kv_role: str = "kv_both"
    async_save: bool = False
    # more kv_connector_extra_config for this child, e.g. (("bidirectional_kv_xfer", True),)
    extra_config: tuple[tuple[str, object], ...] = ()


def nixl_pull(name: str = "nixl") -> Child:
    return Child("NixlPullLoader", name, kv_role="kv_consumer")


def buggy_lmcache_mp(name: str = "lmc", async_save: bool = False) -> Child:
    return Child("BuggyLMCacheMPLoader", name, async_save=async_save)


def cache_loader(name: str = "lmc", async_save: bool = False) -> Child:
    return Child("CacheLoader", name, async_save=async_save)


@dataclass
class Crash:
    """The exception that would have killed EngineCore, and where it came from."""

    step: int
    phase: str
    exc: BaseException
    traceback: str

    @property
    def frame(self) -> traceback.FrameSummary:
        return traceback.extract_tb(self.exc.__traceback__)[-1]

    @property
    def source_line(self) -> str:
        return (self.frame.line or "").strip()

    @property
    def function(self) -> str:
        return self.frame.name

    def enclosing_loop(self) -> str:
        """The `for` header the failing line sits in (tells the recv loop of
        `_update_from_kv_xfer_finished` from its send loop on any release)."""
        frame = self.frame
        failing = linecache.getline(frame.filename, frame.lineno)
        indent = len(failing) - len(failing.lstrip())
        for lineno in range(frame.lineno - 1, 0, -1):
            text = linecache.getline(frame.filename, lineno)
            depth = len(text) - len(text.lstrip())
            if not text.strip() or depth >= indent:
                continue
            if text.lstrip().startswith("for "):
                return text.strip()
            if text.lstrip().startswith("def "):
                return ""
            indent = depth
        return ""


@dataclass
class StepRecord:
    step: int
    scheduled: dict[str, int] = field(default_factory=dict)
    processed_batch: int | None = None
    delivered_recving: frozenset[str] = frozenset()
    delivered_failed: frozenset[str] = frozenset()  # failed_recving (vLLM 0.30+)
    delivered_sending: frozenset[str] = frozenset()
    # (child, rank) -> (finished_sending, finished_recving), non-empty only
    worker_reports: dict[tuple[str, int], tuple[frozenset, frozenset]] = field(
        default_factory=dict
    )
    # rank -> finished_recving its MultiConnector handed to KVOutputAggregator, non-empty only
    forwarded: dict[int, frozenset] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    free_blocks: int = 0
    # requests whose async load is parked right after this tick's schedule() (vLLM 0.33+:
    # started later, from _drain_deferred_loads)
    deferred_loads: frozenset[str] = frozenset()
    # right after this tick's schedule(), per KV-cache group: the common-prefix block count
    # the scheduler put in its output (cascade attention), and two readings of the KV cache
    # manager's state for the scheduler's running[0]: leading blocks that every request with
    # blocks holds (by membership), and leading blocks whose ref_cnt equals the number of such
    # requests (vLLM's rule, which assumes one reference per holder)
    common_prefix: tuple[int, ...] = ()
    common_prefix_by_holders: tuple[int, ...] = ()
    common_prefix_by_ref_cnt: tuple[int, ...] = ()

    def reported(self, child: str, req_id: str, kind: str = "recv") -> list[int]:
        """Ranks on which `child` reported `req_id` this tick."""
        index = 1 if kind == "recv" else 0
        return sorted(
            rank
            for (name, rank), sets in self.worker_reports.items()
            if name == child and req_id in sets[index]
        )


@dataclass
class RunResult:
    world: "World"
    steps: list[StepRecord]
    crash: Crash | None
    tracker: BlockTracker

    @property
    def violations(self):
        return self.tracker.violations

    def first_computed(self, req_id: str) -> int | None:
        return next((s.step for s in self.steps if req_id in s.scheduled), None)

    def step(self, step: int) -> StepRecord:
        return next(s for s in self.steps if s.step == step)


class _Crashed(Exception):
    def __init__(self, crash: Crash) -> None:
        self.crash = crash


class _Unpatched:
    """A worker rank's MultiConnector as an unpatched process runs it: vLLM's own methods,
    whatever wrappers this process put on the class."""

    def __init__(self, connector) -> None:
        self._connector = connector

    def __getattr__(self, name: str):
        attr = inspect.getattr_static(type(self._connector), name)
        original = getattr(attr, "__wrapped__", attr)  # a wrapt FunctionWrapper keeps it there
        if callable(original) and not isinstance(original, (staticmethod, classmethod)):
            return original.__get__(self._connector, type(self._connector))
        return getattr(self._connector, name)


class World:
    """A decode engine: `World([nixl_pull(), buggy_lmcache_mp()], tp=2)`.

    `run(timeline)` plays the events once (build a new World per scenario)
    and returns a RunResult: `.crash` (None, or the exception that would
    kill EngineCore with its traceback, `.source_line`, `.function`,
    `.enclosing_loop()`), `.tracker.violations`, and one StepRecord per
    tick. `child(name)` / `child(name, rank)` give the connector instances
    vLLM built; `scheduler` is the real (Async)Scheduler.

    `defer_async_loads=True` (vLLM 0.33+, needs `async_scheduling=True`) makes
    the scheduler defer async loads that are scheduled while a batch is in
    flight, as it does with a HiSparse KV cache: the load starts from
    `_drain_deferred_loads` when that batch is processed.

    `prefix_caching=False` turns vLLM's local prefix cache off: a preempted
    request's resume is no longer served from its own cached blocks, so a
    cache child's hit starts a new async load under the same request id.

    `pp=2` runs two pipeline stages: `pp * tp` worker ranks, each with its own
    NIXL worker reading its part of R's layers, merged by `KVOutputAggregator`
    over `world_size` like the executor does.

    `sliding_window=32` builds a hybrid model's KV cache (layer 0 full attention,
    layer 1 a sliding window of that many tokens): two KV-cache groups sharing one
    block pool, as vLLM's hybrid allocator lays out Gemma-/Mistral-style models.
    NIXL then pulls per group and clips the sliding-window group to its window.

    `max_num_inflight_kv_loads=1` (vLLM 0.34+, `--max-num-inflight-kv-loads`) caps the
    async KV loads in flight, aborted ones whose transfer has not reported counted in: a
    request past the cap waits in `async_kv_waiting` (status WAITING) for a slot.

    `unpatched_ranks=(1,)` models worker ranks our hotfix did not reach (Ray
    workers without our PYTHONPATH, a worker-side revert): there the world calls
    MultiConnector's own worker methods (not our wrappers, which are on the
    class in this one process) and the rank's output carries no
    `kv_connector_worker_meta`, as stock NIXL and the world's other children
    send none. A real unpatched rank also runs NIXL's own entry point; here
    pull-pin's NIXL wrapper may still record reports on that rank, but what it
    would ship is dropped with the metadata.
    """

    def __init__(
        self,
        children: Iterable[Child],
        tp: int = 1,
        async_scheduling: bool = False,
        num_blocks: int = 64,
        block_size: int = 16,
        defer_async_loads: bool = False,
        prefix_caching: bool = True,
        pp: int = 1,
        unpatched_ranks: Iterable[int] = (),
        sliding_window: int | None = None,
        kv_load_failure_policy: str = "fail",
        max_num_inflight_kv_loads: int | None = None,
    ) -> None:
        self.children = list(children)
        self.kv_load_failure_policy = kv_load_failure_policy
        self.max_num_inflight_kv_loads = _inflight_limit(max_num_inflight_kv_loads)
        self.tp = tp
        self.pp = pp
        self.unpatched_ranks = frozenset(unpatched_ranks)
        self.prefix_caching = prefix_caching
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step = -1
        self.tracker = BlockTracker()
        self._id = f"world-{uuid.uuid4().hex[:8]}"
        self._scheduler_children: dict[str, object] = {}
        self._worker_children: dict[tuple[str, int], object] = {}
        self._hits: dict[tuple[str, str], int] = {}
        self._due: dict[tuple[str, str, str, int], list[Event]] = {}
        self._strays: dict[tuple[str, str, int], list[tuple[int, str]]] = {}
        self._stops: set[str] = set()
        self._record: StepRecord | None = None

        self.vllm_config = self._make_vllm_config(async_scheduling)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=_kv_cache_groups(block_size, sliding_window),
            **_deferred_loads_kwargs(defer_async_loads, num_blocks),
        )
        connectors.attach(self._id, self)
        try:
            scheduler_cls = self.vllm_config.scheduler_config.get_scheduler_cls()
            self.scheduler = scheduler_cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=block_size,
                hash_block_size=block_size,
            )
            self.workers = [
                KVConnectorFactory.create_connector(
                    config=self._rank_config(rank),
                    role=KVConnectorRole.WORKER,
                    kv_cache_config=self.kv_cache_config,
                )
                for rank in range(pp * tp)
            ]
            if defer_async_loads and not self.scheduler.defer_async_loads:
                raise ValueError(
                    "defer_async_loads: vLLM defers loads only with overlapping "
                    "batches; use async_scheduling=True"
                )
        except BaseException:
            connectors.detach(self._id)
            raise
        self.aggregator = KVOutputAggregator.from_connector(
            self.scheduler.connector, self.vllm_config.parallel_config.world_size)
        hash_fn = get_hash_fn_by_name(
            self.vllm_config.cache_config.prefix_caching_hash_algo
        )
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(block_size, hash_fn)
        self._batches: deque = deque()
        self._pending_aborts: list[str] = []

    # ------------------------------------------------------------------ setup
    def _child_config(self, child: Child, rank: int | None) -> dict:
        extra = {**dict(child.extra_config), "world": self._id, "name": child.name,
                 "async_save": child.async_save}
        if rank is not None:
            extra["tp_rank"] = rank
        return {
            "kv_connector": child.kind,
            "kv_role": child.kv_role,
            "kv_connector_module_path": CONNECTORS_MODULE,
            "kv_connector_extra_config": extra,
        }

    def _transfer_config(self, rank: int | None, engine_id: str | None) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_consumer",
            engine_id=engine_id,
            kv_load_failure_policy=self.kv_load_failure_policy,
            kv_connector_extra_config={
                "connectors": [self._child_config(c, rank) for c in self.children]
            },
        )

    def _make_vllm_config(self, async_scheduling: bool) -> VllmConfig:
        model_dir = _tiny_model_dir()
        config = VllmConfig(
            model_config=ModelConfig(
                model=model_dir,
                tokenizer=model_dir,
                skip_tokenizer_init=True,
                max_model_len=MAX_MODEL_LEN,
                dtype="float32",
                seed=0,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.prefix_caching
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=MAX_MODEL_LEN,
                max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp,
                                           pipeline_parallel_size=self.pp),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=self._transfer_config(None, None),
        )
        # The CPU platform turns async scheduling off; a GPU decode node runs
        # with it on, which is what this flag reproduces.
        config.scheduler_config.async_scheduling = async_scheduling
        if self.max_num_inflight_kv_loads is not None:
            config.scheduler_config.max_num_inflight_kv_loads = self.max_num_inflight_kv_loads
        config.cache_config.num_gpu_blocks = self.num_blocks
        return config

    def _rank_config(self, rank: int) -> VllmConfig:
        """What a TP worker sees: same config, children told their rank."""
        config = copy.copy(self.vllm_config)
        config.kv_transfer_config = self._transfer_config(
            rank, self.vllm_config.kv_transfer_config.engine_id
        )
        return config

    # ------------------------------------------------- called by the children
    def register_child(self, child, role: KVConnectorRole) -> None:
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler_children[child.name] = child
        else:
            self._worker_children[(child.name, child.rank)] = child

    def hit(self, req_id: str, child: str) -> int:
        return self._hits.get((req_id, child), 0)

    def take_strays(self, kind: str, child: str, rank: int) -> set[str]:
        """Requests `child` on `rank` reports as `kind` now without doing that transfer."""
        pending = self._strays.get((kind, child, rank), [])
        due = {req for step, req in pending if step <= self.step}
        pending[:] = [(step, req) for step, req in pending if step > self.step]
        return due

    def take_due(self, kind: str, req_id: str, child: str, rank: int) -> Event | None:
        """The LoadDone/LoadFailed/SaveDone that ends this transfer now, if one is due."""
        due = self._due.get((kind, req_id, child, rank))
        if not due or due[0].step > self.step:
            return None
        return due.pop(0)

    def note_worker_report(self, child, sending: set[str], recving: set[str]) -> None:
        if sending or recving:
            self._record.worker_reports[(child.name, child.rank)] = (
                frozenset(sending),
                frozenset(recving),
            )

    # ------------------------------------------------------------- inspection
    def child(self, name: str, rank: int | None = None):
        """A child instance: the scheduler side, or the worker on `rank`."""
        if rank is None:
            return self._scheduler_children[name]
        return self._worker_children[(name, rank)]

    def holdings(self) -> dict[str, list[int]]:
        manager = self.scheduler.kv_cache_manager
        null = manager.block_pool.null_block.block_id
        return {
            req_id: [b for group in manager.get_block_ids(req_id) for b in group if b != null]
            for req_id in self.scheduler.requests
        }

    def common_prefix_readings(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(by holders, by ref_cnt) for the scheduler's running[0]; see StepRecord."""
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        if not self.scheduler.running:
            return (0,) * len(managers), (0,) * len(managers)
        first = self.scheduler.running[0].request_id
        by_holders, by_ref_cnt = [], []
        for manager in managers:
            holders = [set(map(id, blocks)) for blocks in manager.req_to_blocks.values()]
            blocks = manager.req_to_blocks.get(first, [])  # a defaultdict: never insert
            by_holders.append(next((i for i, b in enumerate(blocks)
                                    if not all(id(b) in h for h in holders)), len(blocks)))
            by_ref_cnt.append(next((i for i, b in enumerate(blocks)
                                    if b.ref_cnt != len(holders)), len(blocks)))
        return tuple(by_holders), tuple(by_ref_cnt)

    def free_block_ids(self) -> list[int]:
        return [
            b.block_id
            for b in self.scheduler.kv_cache_manager.block_pool.blocks
            if b.ref_cnt == 0 and not b.is_null
        ]

    # -------------------------------------------------------------------- run
    def run(
        self, timeline: Iterable[Event], until: int | None = None, grace: int = 64
    ) -> RunResult:
        """Play `timeline` and return what happened.

        Stops at a crash, after tick `until`, or once the last event is past
        and the engine is idle — at most `grace` ticks later. Without `until`
        and without a crash, the batches still in flight are then processed
        and, if every request has finished, the pool must be whole again.
        """
        if self.step >= 0:
            raise RuntimeError("a World plays one timeline; build a new World")
        events = list(timeline)
        self._load_script(events)
        last = max((e.step for e in events), default=0)
        limit = until if until is not None else last + grace
        steps: list[StepRecord] = []
        crash = None
        try:
            for step in range(limit + 1):
                steps.append(self._begin_tick(step))
                self._tick([e for e in events if e.step == step])
                if until is None and step >= last and self._idle():
                    break
            if until is None:
                while self._batches:
                    steps.append(self._begin_tick(self.step + 1))
                    self._process_oldest_batch()
                if self.scheduler.get_num_unfinished_requests() == 0:
                    self.tracker.check_all_returned(
                        self.step,
                        self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                        self.num_blocks - 1,
                    )
        except _Crashed as crashed:
            crash = crashed.crash
            self._snapshot()
        finally:
            connectors.detach(self._id)
        return RunResult(self, steps, crash, self.tracker)

    def _begin_tick(self, step: int) -> StepRecord:
        self.step = step
        self._record = StepRecord(step)
        return self._record

    def _load_script(self, events: list[Event]) -> None:
        for event in sorted(events, key=lambda e: e.step):
            if isinstance(event, (LoadDone, LoadFailed, SaveDone)):
                if isinstance(event, LoadFailed) and not FAILED_RECVS_SUPPORTED and \
                        self._kind_of(event.child) != "NixlPullLoader":
                    raise ValueError("LoadFailed: before 0.30 (no failed_recving) only NIXL's "
                                     "READ can fail here (its blocks reported invalid)")
                kind = "save" if isinstance(event, SaveDone) else "load"
                ranks = range(self.pp * self.tp) if event.rank is None else [event.rank]
                for rank in ranks:
                    self._due.setdefault((kind, event.req, event.child, rank), []).append(
                        event
                    )
            elif isinstance(event, StrayReport):
                ranks = range(self.pp * self.tp) if event.rank is None else [event.rank]
                for rank in ranks:
                    self._strays.setdefault((event.kind, event.child, rank), []).append(
                        (event.step, event.req)
                    )

    def _kind_of(self, child_name: str) -> str:
        return next(c.kind for c in self.children if c.name == child_name)

    def _idle(self) -> bool:
        return not self._batches and not self.scheduler.has_requests()

    def _call(self, phase: str, fn, *args, **kwargs):
        """Run a vLLM call; what escapes it is what would kill EngineCore."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _Crashed(
                Crash(self.step, phase, exc, traceback.format_exc())
            ) from exc

    def _observe(self) -> None:
        self.tracker.observe(self.step, self.holdings(), self.free_block_ids())

    def _tick(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Arrive):  # hits are per arrival: an id may arrive again
                for child in self.children:
                    self._hits[(event.req, child.name)] = event.hits.get(child.name, 0)
                self._call("add_request", self.scheduler.add_request, self.make_request(event))
            elif isinstance(event, Abort) and event.during_execution:
                self._pending_aborts.append(event.req)
            elif isinstance(event, Abort):
                self._abort([event.req])
            elif isinstance(event, Preempt):
                self._preempt(event.req)
            elif isinstance(event, Stop):
                self._stops.add(event.req)
            elif isinstance(event, Elapse):
                time.sleep(event.seconds)
        self._observe()

        if self.scheduler.has_requests():
            scheduler_output = self._call("schedule", self.scheduler.schedule)
            self._observe()
            self._record.scheduled = dict(scheduler_output.num_scheduled_tokens)
            self._record.deferred_loads = frozenset(getattr(self.scheduler, "deferred_loads", ()))
            # 0.34 dropped the field (cascade attention's common prefix was gone since 0.32)
            self._record.common_prefix = tuple(getattr(scheduler_output, "num_common_prefix_blocks", None) or ())
            (self._record.common_prefix_by_holders,
             self._record.common_prefix_by_ref_cnt) = self.common_prefix_readings()
            holdings = self.holdings()
            for req_id in scheduler_output.num_scheduled_tokens:
                self.tracker.computed(self.step, req_id, holdings.get(req_id, ()))
            output = self._execute(scheduler_output)
            self._batches.appendleft((self.step, scheduler_output, output))
            depth = self.vllm_config.max_concurrent_batches
            if len(self._batches) < depth and (
                scheduler_output.total_num_scheduled_tokens > 0
                or self.scheduler.has_requests()
            ):
                self._snapshot()
                return
        elif not self._batches:
            self._snapshot()
            return
        self._process_oldest_batch()

    def _process_oldest_batch(self) -> None:
        """EngineCore's aborts queue, then `update_from_output` for the batch."""
        batch_step, scheduler_output, output = self._batches.pop()
        if self._pending_aborts:
            aborts, self._pending_aborts = self._pending_aborts, []
            self._abort(aborts)
        kv_output = output.kv_connector_output
        self._record.processed_batch = batch_step
        self._record.delivered_recving = frozenset(kv_output.finished_recving or ())
        self._record.delivered_failed = frozenset(getattr(kv_output, "failed_recving", None) or ())
        self._record.delivered_sending = frozenset(kv_output.finished_sending or ())
        engine_outputs = self._call(
            "update_from_output",
            self.scheduler.update_from_output,
            scheduler_output,
            output,
        )
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self._record.finished[out.request_id] = str(out.finish_reason)
        self._observe()
        self._snapshot()

    def _snapshot(self) -> None:
        self._record.status = {
            req_id: req.status.name for req_id, req in self.scheduler.requests.items()
        }
        self._record.free_blocks = (
            self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        )

    def make_request(self, event: Arrive) -> Request:
        """The vLLM ``Request`` an arrival adds (also for tests that drive the scheduler)."""
        seed = zlib.crc32((event.same_prompt_as or event.req).encode())
        prompt = [10 + (seed + i) % 100 for i in range(event.prompt_len)]
        extra_args = None
        if event.remote_prefill:
            extra_args = {"kv_transfer_params": self._remote_prefill_params(event)}
        params = SamplingParams(
            max_tokens=event.max_tokens,
            stop_token_ids=[STOP_TOKEN],
            extra_args=extra_args,
        )
        return Request(
            request_id=event.req,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(event.step),
            block_hasher=self._block_hasher,
        )

    def finished_prefill(self, req_id: str, computed_tokens: int = 64) -> Request:
        """A prefill node's request as its NIXL scheduler's ``request_finished`` gets it: done
        after its prefill, its KV to be READ by a decode."""
        request = self.make_request(Arrive(0, req_id))
        request.kv_transfer_params = {"do_remote_decode": True}
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        request.num_computed_tokens = computed_tokens
        return request

    def _remote_prefill_params(self, event: Arrive) -> dict:
        """What the P/D proxy hands a decode node after prefill on P."""
        num_blocks = -(-event.prompt_len // self.block_size)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(1, num_blocks + 1))],
            "remote_engine_id": "prefill-engine",
            "remote_request_id": f"prefill-{event.req}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": self.tp,
            **event.extra_params,
        }

    def _abort(self, req_ids: list[str]) -> None:
        self._call(
            "finish_requests",
            self.scheduler.finish_requests,
            req_ids,
            RequestStatus.FINISHED_ABORTED,
        )
        self._observe()

    def _preempt(self, req_id: str) -> None:
        """The eviction `schedule()` performs when allocation fails."""
        request = self.scheduler.requests[req_id]
        if request not in self.scheduler.running:
            raise ValueError(
                f"Preempt at tick {self.step}: {req_id} is {request.status.name}, "
                "only a running request can be preempted"
            )
        self.scheduler.running.remove(request)
        self._call("preempt", self.scheduler._preempt_request, request, time.monotonic())
        self._observe()

    # ---------------------------------------------------------------- workers
    def _execute(self, scheduler_output) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [self._sample(req_id) for req_id in req_ids]
        outputs = [
            runner_output(
                req_ids,
                sampled_token_ids=[list(tokens) for tokens in sampled],
                kv_connector_output=self._call(
                    f"worker[{rank}]", self._worker_connector_step,
                    _Unpatched(worker) if rank in self.unpatched_ranks else worker,
                    scheduler_output,
                ),
            )
            for rank, worker in enumerate(self.workers)
        ]
        for rank, output in enumerate(outputs):
            if output.kv_connector_output.finished_recving:
                self._record.forwarded[rank] = frozenset(output.kv_connector_output.finished_recving)
        return self._call("aggregate", self.aggregator.aggregate, outputs, output_rank=0)

    def _sample(self, req_id: str) -> list[int]:
        request = self.scheduler.requests[req_id]
        if request.is_prefill_chunk:
            return []
        if req_id in self._stops:
            self._stops.discard(req_id)
            return [STOP_TOKEN]
        return [FILLER_TOKEN]

    def _worker_connector_step(self, worker, scheduler_output) -> KVConnectorOutput:
        """The model runner's connector calls for one batch on one TP rank."""
        # Each worker gets its own copy, as across the executor's process boundary.
        metadata = pickle.loads(pickle.dumps(scheduler_output.kv_connector_metadata))
        finished_req_ids = set(scheduler_output.finished_req_ids)
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)  # the children here need no forward context
        if scheduler_output.total_num_scheduled_tokens > 0:
            worker.wait_for_save()
        output = KVConnectorOutput()
        if hasattr(worker, "get_transfer_results"):  # vLLM >= 0.30
            results = worker.get_transfer_results(finished_req_ids)
            output.finished_sending = set(results.finished_sending) or None
            output.finished_recving = set(results.finished_recving) or None
            if results.failed_recving:
                output = dataclasses.replace(
                    output, failed_recving=set(results.failed_recving)
                )
        else:
            output.finished_sending, output.finished_recving = worker.get_finished(
                finished_req_ids
            )
        output.invalid_block_ids = worker.get_block_ids_with_load_errors()
        output.kv_connector_stats = worker.get_kv_connector_stats()
        output.kv_cache_events = worker.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = worker.build_connector_worker_meta()
        if isinstance(worker, _Unpatched):
            output.kv_connector_worker_meta = None
        worker.clear_connector_metadata()
        return output
