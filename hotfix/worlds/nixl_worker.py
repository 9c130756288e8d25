"""NIXL worker world: vLLM's real decode-side NIXL worker, in-process, over a NIXL-agent double.

What is real: ``NixlConnector`` (worker role) built by vLLM from a ``VllmConfig``, its
``NixlPullConnectorWorker`` (``register_kv_caches``, ``start_load_kv``, the background
handshake, ``_read_blocks_for_req`` splitting a READ over the remote TP ranks,
``get_finished``, ``get_block_ids_with_load_errors``), and the prefill side's real handshake
listener (``NixlBaseConnectorScheduler._nixl_handshake_listener``, a ZMQ ROUTER on loopback)
serving one payload per prefill TP rank. What is fake: only ``NixlWrapper`` (the NIXL agent,
``nixl._api.nixl_agent``), as vLLM's own NIXL unit tests do (:class:`FakeNixlAgent`).

Topology: decode TP=1 reading from a prefill with TP=2 (heterogeneous TP, P's TP > D's TP),
so every real pull is two NIXL READ handles, one per prefill rank.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Set

import msgspec
import torch

LAYER = "model.layers.0.self_attn.attn"
BLOCK_SIZE = 32  # CPU attention wants a multiple of 32
NUM_BLOCKS = 16
NUM_KV_HEADS = 4
HEAD_SIZE = 64
DECODE, PREFILL = "decode-engine", "prefill-engine"
PREFILL_TP = 2


class FakeNixlAgent:
    """Double of ``nixl._api.nixl_agent`` (vLLM's ``NixlWrapper``), at the lowest level.

    What the real agent does that this models:
    - memory registration and descriptor lists (``register_memory``, ``get_reg_descs``,
      ``get_xfer_descs``, ``prep_xfer_dlist``) return opaque handles; no bytes move here;
    - ``add_remote_agent(metadata)`` loads a peer's metadata and returns the peer's agent name
      (here: the metadata bytes are the name);
    - ``make_prepped_xfer("READ", ...)`` creates one transfer handle towards one remote agent,
      or raises (``nixlBackendError`` in the real one) when the transfer cannot be set up —
      scripted per remote agent with :meth:`fail_setup_to`;
    - ``transfer(handle)`` posts it; ``check_xfer_state(handle)`` reports ``"PROC"`` while the
      transfer runs, then ``"DONE"`` or ``"ERR"`` — scripted per handle with :meth:`finish`;
      a handle the caller released must not be checked again (the real agent would fail);
    - a READ made with ``notif_msg`` notifies the remote agent once it is done (the real one
      sends it when the transfer completes; recorded in :attr:`notified` at :meth:`finish`),
      and ``send_notif`` sends one at once (recorded the same way);
    - ``get_xfer_telemetry`` returns the transfer's counters; ``release_xfer_handle`` frees
      the handle; ``get_new_notifs`` returns the notifications received (none here);
    - a peer UCX lost (:meth:`disconnect`: a partition past UCX's peer timeout): its handles in
      flight fail in ``check_xfer_state`` and every later ``transfer`` to it fails, both with
      ``nixlRemoteDisconnectError``, until the agent is removed (``remove_remote_agent``) and
      loaded again — what NIXL 1.5.1 does (``benchmarks/nixl_post.py``).
    It does not model UCX itself, data movement, or timing.
    """

    def __init__(self, name: str, config=None) -> None:
        self.name = name
        self._ids = itertools.count(1)
        self.states: Dict[int, str] = {}  # live transfer handle -> PROC | DONE | ERR
        self.peer_of: Dict[int, str] = {}  # transfer handle -> remote agent name
        self.dlist_owner: Dict[int, str] = {}  # prepped descriptor list -> agent it targets
        self.released: List[int] = []
        self.failing_setups: Set[str] = set()
        self.disconnected: Set[str] = set()
        self.removed: List[str] = []
        self.misuse: List[str] = []  # calls the real agent would reject
        self.notif_of: Dict[int, bytes] = {}  # transfer handle -> its completion notification
        self.notified: List[tuple] = []  # (remote agent, message) in the order they were sent

    # test script ----------------------------------------------------------------
    def fail_setup_to(self, agent_name: str) -> None:
        self.failing_setups.add(agent_name)

    def disconnect(self, agent_name: str) -> None:
        self.disconnected.add(agent_name)

    def finish(self, handle: int, state: str = "DONE") -> None:
        assert self.states.get(handle) == "PROC", (handle, self.states.get(handle))
        self.states[handle] = state
        if state == "DONE" and self.notif_of.get(handle):
            self.notified.append((self.peer_of[handle], self.notif_of[handle]))

    def handles_to(self, agent_name: str) -> List[int]:
        return [h for h, peer in self.peer_of.items() if peer == agent_name]

    # nixl_agent API used by vLLM's NIXL worker ---------------------------------------
    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def get_reg_descs(self, *args, **kwargs):
        return ("reg_descs", next(self._ids))

    def register_memory(self, descs, *args, **kwargs):
        return descs

    def deregister_memory(self, *args, **kwargs) -> None:
        pass

    def get_xfer_descs(self, *args, **kwargs):
        return ("xfer_descs", next(self._ids))

    def prep_xfer_dlist(self, agent_name, descs, *args, **kwargs) -> int:
        handle = next(self._ids)
        self.dlist_owner[handle] = agent_name  # "NIXL_INIT_AGENT" for local lists
        return handle

    def release_dlist_handle(self, *args, **kwargs) -> None:
        pass

    def add_remote_agent(self, metadata: bytes) -> str:
        return metadata.decode()

    def check_remote_metadata(self, agent_name: str, *args, **kwargs) -> bool:
        return True  # loaded, disconnected or not (NIXL 1.5.1 keeps a lost peer's metadata)

    def remove_remote_agent(self, agent_name: str, *args, **kwargs) -> None:
        self.removed.append(agent_name)
        self.disconnected.discard(agent_name)  # loaded again later: a new endpoint

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, remote_ids,
                          notif_msg=None, *args, **kwargs) -> int:
        peer = self.dlist_owner.get(remote_handle, "?")
        if peer in self.failing_setups:
            raise RuntimeError(f"NIXL_ERR_BACKEND: cannot set up READ to {peer}")
        handle = next(self._ids)
        self.states[handle] = "PROC"
        self.peer_of[handle] = peer
        self.notif_of[handle] = notif_msg or b""
        return handle

    def transfer(self, handle: int, *args, **kwargs) -> str:
        if self.peer_of.get(handle) in self.disconnected:
            raise nixlRemoteDisconnectError(f"NIXL_ERR_REMOTE_DISCONNECT: {self.peer_of[handle]} was disconnected")
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        if handle not in self.states:
            self.misuse.append(f"check_xfer_state({handle}) after release")
            return "ERR"
        if self.states[handle] == "PROC" and self.peer_of.get(handle) in self.disconnected:
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
        return self.states[handle]

    def get_xfer_telemetry(self, handle: int):
        return _Telemetry()

    def release_xfer_handle(self, handle: int) -> None:
        if self.states.pop(handle, None) is None:
            self.misuse.append(f"release_xfer_handle({handle}) twice")
        self.released.append(handle)

    def send_notif(self, remote_agent_name, notif_msg=b"", *args, **kwargs) -> None:
        self.notified.append((remote_agent_name, notif_msg))

    def get_new_notifs(self) -> dict:
        return {}


class nixlRemoteDisconnectError(RuntimeError):  # noqa: N801  (the NIXL bindings' class name)
    """What NIXL's Python bindings raise for ``NIXL_ERR_REMOTE_DISCONNECT``."""


class _Telemetry:
    xferDuration = 10.0
    postDuration = 1.0
    totalBytes = 4096
    descCount = 1


_model_dir: Optional[tempfile.TemporaryDirectory] = None


def _model() -> str:
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.TemporaryDirectory(prefix="hotfix-nixl-model-")
        Path(_model_dir.name, "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": NUM_KV_HEADS * HEAD_SIZE, "head_dim": HEAD_SIZE,
            "intermediate_size": 512, "num_hidden_layers": 1,
            "num_attention_heads": NUM_KV_HEADS, "num_key_value_heads": NUM_KV_HEADS,
            "max_position_embeddings": 1024, "vocab_size": 128, "rms_norm_eps": 1e-6,
            "torch_dtype": "float32"}))
    return _model_dir.name


def _kv_cache_tensor(cls, page: int):
    """One layer-outermost tensor, in the fields of the installed release (0.30 renamed them)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    if "shared_by" in fields:
        return cls(size=page * NUM_BLOCKS, shared_by=[LAYER])
    return cls(size=page * NUM_BLOCKS, layers=[LAYER], layer_stride=page * NUM_BLOCKS, block_stride=page)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DecodeWorld:
    """One decode worker (real NIXL worker, fake agent) and a prefill handshake listener."""

    def __init__(self, monkeypatch, bad_handshake_ranks=(), stamp=None) -> None:
        """``stamp(metadata)``: what a patched EngineCore adds to every step's NIXL metadata
        (a fix's halves stamp), applied to each metadata this world binds."""
        self.stamp = stamp
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                                 SchedulerConfig, VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                                KVCacheGroupSpec, KVCacheTensor)

        self.port = _free_port()
        model = _model()
        config = VllmConfig(
            model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True,
                                     max_model_len=1024, dtype="float32", seed=0),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                             max_model_len=1024, is_encoder_decoder=False),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                                kv_role="kv_consumer", engine_id=DECODE,
                                                kv_buffer_device="cpu"),
        )
        if getattr(config.cache_config, "kv_cache_layout", "") is None:
            # 0.30+: the engine core resolves one layout for all workers; the CPU backend's
            config.cache_config.kv_cache_layout = "HND"
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                                 head_size=HEAD_SIZE, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[_kv_cache_tensor(KVCacheTensor, spec.page_size_bytes)],
            kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])

        agents: List[FakeNixlAgent] = []

        def make_agent(name, cfg=None):
            agent = FakeNixlAgent(name, cfg)
            agents.append(agent)
            return agent

        monkeypatch.setattr(base_worker, "NixlWrapper", make_agent)
        # A single-rank decode: what the TP group would say (no process group needed).
        monkeypatch.setattr(base_worker, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(base_worker, "get_tensor_model_parallel_world_size", lambda: 1)
        affinity = os.sched_getaffinity(0)  # the CPU worker pins itself to one core per NUMA node
        try:
            self.connector = NixlConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        finally:
            os.sched_setaffinity(0, affinity)
        self.worker = self.connector.connector_worker
        (self.agent,) = agents
        backend = self.worker.attn_backends[0]
        shape = (backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
                 if hasattr(backend, "get_kv_cache_shape")  # 0.30+ allocates from the spec:
                 else (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE))  # 0.27's CPU shape
        self.connector.register_kv_caches({LAYER: torch.zeros(shape)})
        self._serve_prefill(set(bad_handshake_ranks))

    def _serve_prefill(self, bad_ranks: set) -> None:
        """The prefill engine's real handshake listener, one payload per prefill TP rank
        (decoded from the decode worker's own payload: same model, half the heads per rank)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
            NixlBaseConnectorScheduler)
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata, NixlHandshakePayload)

        own = self.worker.xfer_handshake_metadata
        mine = msgspec.msgpack.decode(own.agent_metadata_bytes, type=NixlAgentMetadata)
        encoded = {}
        for rank in range(PREFILL_TP):
            meta = dataclasses.replace(
                mine, engine_id=PREFILL, agent_metadata=self.prefill_agent(rank).encode(),
                kv_caches_base_addr=[0x10000000 * (rank + 1) for _ in mine.kv_caches_base_addr],
                block_lens=[n // PREFILL_TP for n in mine.block_lens])
            payload = NixlHandshakePayload(
                compatibility_hash="mismatch" if rank in bad_ranks else own.compatibility_hash,
                agent_metadata_bytes=msgspec.msgpack.encode(meta))
            encoded[(0, rank)] = msgspec.msgpack.encode(payload)
        self._stop = threading.Event()
        ready = threading.Event()
        self._listener = threading.Thread(
            target=NixlBaseConnectorScheduler._nixl_handshake_listener,
            args=(encoded, ready, self._stop, "127.0.0.1", self.port), daemon=True)
        self._listener.start()
        ready.wait(10)

    @staticmethod
    def prefill_agent(rank: int) -> str:
        return f"prefill-agent-rank{rank}"

    def close(self) -> None:
        self._stop.set()
        try:
            self.connector.shutdown()
        except Exception:
            pass
        self._listener.join(timeout=3)

    # a step --------------------------------------------------------------------------
    def load(self, req_id: str, local_blocks: List[int], remote_blocks: List[int],
             **req_meta_attrs) -> None:
        """The scheduler's metadata for one real pull of R, bound and started (forward pass);
        ``req_meta_attrs`` are set on R's ``ReqMeta`` as a patched scheduler would."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata)

        meta = NixlConnectorMetadata()
        meta.add_new_req_to_recv(req_id, [list(local_blocks)], {
            "remote_block_ids": [list(remote_blocks)], "remote_engine_id": PREFILL,
            "remote_request_id": f"prefill-{req_id}", "remote_host": "127.0.0.1",
            "remote_port": self.port, "tp_size": PREFILL_TP})
        for name, value in req_meta_attrs.items():
            setattr(meta.reqs_to_recv[req_id], name, value)
        meta.reqs_in_batch.add(req_id)
        self.start(meta)

    def start(self, meta=None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata)

        meta = meta or NixlConnectorMetadata()
        if self.stamp is not None:
            self.stamp(meta)
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()

    def wait_for_handshake(self, req_id: str, timeout: float = 10.0) -> None:
        """Until the background handshake for R finished (ready to read, or failed)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if PREFILL in self.worker._remote_agents or not self.worker._failed_recv_reqs.empty():
                if not self.worker._handshake_futures:
                    return
            time.sleep(0.01)
        raise TimeoutError(f"handshake for {req_id} did not finish")

    def finished(self):
        """One worker step's report: (finished_recving, invalid block ids)."""
        _sending, recving = self.connector.get_finished(set())
        return set(recving or ()), self.connector.get_block_ids_with_load_errors()
