"""What our NIXL worker halves tell the EngineCore, in one object per step.

vLLM gives each connector one slot of ``kv_connector_worker_meta`` (stock NIXL sends None
there); pull-pin's confirmations and every NIXL fix's handshake announcement share it, so a
fix adds to the step's answer instead of replacing it. ``KVOutputAggregator`` (and
MultiConnector's per-child metadata) merge the ranks' answers with :meth:`aggregate`. It is
sent only by a worker half that saw its EngineCore's stamp, so only to an EngineCore that
imports this module to unpickle it.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Optional

from hotfix.halves import merge_presence


class NixlWorkerAnswer:
    """``confirmed``: pull-pin's terminal READ reports, ``{req_id: {rank token: stamp epoch}}``;
    ``hotfix_present``: the handshake's announcements, ``{fix: rank tokens}``;
    ``prefill_clocks``: lease-guard's offsets to prefill clocks that changed,
    ``{rank token: {engine id: seconds}}``."""

    def __init__(self, confirmed: Optional[Dict[str, Dict[str, int]]] = None,
                 present: Optional[Dict[str, FrozenSet[str]]] = None,
                 prefill_clocks: Optional[Dict[str, Dict[str, float]]] = None) -> None:
        self.confirmed = confirmed or {}
        self.hotfix_present = present or {}
        self.prefill_clocks = prefill_clocks or {}

    def aggregate(self, other) -> "NixlWorkerAnswer":
        merged = {req_id: dict(ranks) for req_id, ranks in self.confirmed.items()}
        for req_id, ranks in (getattr(other, "confirmed", None) or {}).items():
            merged.setdefault(req_id, {}).update(ranks)
        clocks = {**self.prefill_clocks, **(getattr(other, "prefill_clocks", None) or {})}
        return NixlWorkerAnswer(merged, merge_presence(self.hotfix_present, other), clocks)


def answer_with(meta, confirmed: Optional[Dict[str, Dict[str, int]]] = None,
                present: Optional[Dict[str, FrozenSet[str]]] = None,
                prefill_clocks: Optional[Dict[str, Dict[str, float]]] = None):
    """This step's NIXL worker metadata with ours added; ``meta`` unchanged when it is not
    ours to extend (something other than None or an answer: not NIXL's slot as we know it)."""
    if not confirmed and not present and not prefill_clocks:
        return meta
    if meta is None:
        return NixlWorkerAnswer(confirmed, present, prefill_clocks)
    if not isinstance(meta, NixlWorkerAnswer):
        return meta
    return meta.aggregate(NixlWorkerAnswer(confirmed, present, prefill_clocks))

