"""The two halves of a fix agree before either acts (DESIGN.md H1).

A fix whose scheduler half lives in the EngineCore and whose worker half lives in every
worker rank must not act on one half: a pin only a worker can release leaks for good when
the workers are not patched (Ray workers need not get our ``PYTHONPATH``), and a worker that
ships one of our classes kills an EngineCore that cannot import ``hotfix`` at unpickling.

The handshake, per fix and per engine, rides on channels vLLM already has:

1. The scheduler half stamps every step's connector metadata with ``hotfix_halves_w<N>`` — a
   dict of builtins ``{fix: (state, epoch)}``, readable by any worker, patched or not. ``N``
   is the wire version (:data:`WIRE_VERSION`): a worker half answers only a stamp of its own
   version, so halves of two releases of this package (a staggered upgrade, Ray workers with
   their own copy) never ship each other a class the other may not unpickle; they degrade.
2. A worker half that finds its fix in the stamp knows the EngineCore reads our classes; it
   then (and only then) announces itself in ``kv_connector_worker_meta`` with a token of its
   own, which ``KVOutputAggregator`` merges over the ranks (:func:`merge_presence`).
3. The first worker output the scheduler processes decides (``Scheduler.update_from_output``
   of the first step): every rank the executor aggregates (``parallel_config.world_size``)
   announced → ``agreed``; otherwise → ``degraded``: one ERROR naming the missing half, the
   fix shown as degraded in this process's status, both halves stock for good. Until then
   (the first step) a scheduler half acts *provisionally* and undoes it when the first
   output degrades it, before ``update_from_output`` returns: the first step's transfers are
   protected when the workers are patched, and nothing outlives that step when they are not.
4. A worker that binds metadata without the stamp (the EngineCore is not patched) degrades
   the same way on its side and never pickles anything of ours.

``epoch`` numbers the stamps, so a worker can say which step's metadata it had bound when it
reported something (pull-pin's confirmations cover exactly the READs bound by then).
"""
from __future__ import annotations

import uuid
from typing import Dict, FrozenSet, Optional, Tuple

from hotfix import log, status

#: Bump whenever what a half ships to the other changes (a class in the worker metadata, a
#: field's meaning). 1 was the unversioned ``hotfix_halves`` stamp (up to 932d821); 2 lasted
#: until lease-guard's worker half judged leases and reported prefill clocks; 3 until
#: lease-guard's EngineCore left READs to the prefill's confirmation (``hotfix_lease_confirm``).
WIRE_VERSION = 4
STAMP_PREFIX = "hotfix_halves"
STAMP_ATTR = f"{STAMP_PREFIX}_w{WIRE_VERSION}"
WAITING, AGREED, DEGRADED = "waiting", "agreed", "degraded"


def stamp_of(metadata, fix: str) -> Optional[Tuple[str, int]]:
    """``(state, epoch)`` the scheduler half stamped on ``metadata``; None: no scheduler half."""
    stamps = getattr(metadata, STAMP_ATTR, None)
    value = stamps.get(fix) if isinstance(stamps, dict) else None
    return tuple(value) if isinstance(value, (tuple, list)) and len(value) == 2 else None


def other_wire_stamps(metadata) -> list:
    """Stamps of other wire versions on ``metadata`` (another release's EngineCore)."""
    return sorted(a for a in getattr(metadata, "__dict__", {})
                  if a.startswith(STAMP_PREFIX) and a != STAMP_ATTR)


def merge_presence(mine: Dict[str, FrozenSet[str]], other) -> Dict[str, FrozenSet[str]]:
    """Union of two ``{fix: rank tokens}`` announcements (for ``aggregate()``)."""
    merged = dict(mine)
    for fix, tokens in (getattr(other, "hotfix_present", None) or {}).items():
        merged[fix] = merged.get(fix, frozenset()) | frozenset(tokens)
    return merged


class SchedulerHalf:
    """The EngineCore's view of one fix in one engine: are the workers' halves present?

    Lifecycle: ``waiting`` (stamping, stock behaviour) → ``agreed`` (act) or ``degraded``
    (stock for good), decided once by :meth:`heard`.
    """

    __slots__ = ("fix", "ranks", "state", "epoch")

    def __init__(self, fix: str, ranks: int) -> None:
        self.fix = fix
        self.ranks = max(int(ranks), 1)  # workers KVOutputAggregator merges: PP x TP x PCP
        self.state = WAITING
        self.epoch = 0

    @classmethod
    def for_engine(cls, fix: str, parallel_config) -> "SchedulerHalf":
        """The half for an engine: it hears every worker rank its executor aggregates
        (``world_size``: PP x TP x PCP), except under vLLM's ``external_launcher``, where each
        process runs its own scheduler beside one worker and nothing is aggregated."""
        backend = getattr(parallel_config, "distributed_executor_backend", None)
        return cls(fix, 1 if backend == "external_launcher" else parallel_config.world_size)

    @property
    def agreed(self) -> bool:
        return self.state == AGREED

    @property
    def may_act(self) -> bool:
        """Agreed, or still waiting for the first output (a provisional act, undone if not)."""
        return self.state != DEGRADED

    def stamp(self, metadata) -> None:
        """Put this step's stamp on the metadata the workers bind."""
        self.epoch += 1
        stamps = getattr(metadata, STAMP_ATTR, None)
        if not isinstance(stamps, dict):
            stamps = {}
            setattr(metadata, STAMP_ATTR, stamps)
        stamps[self.fix] = (self.state, self.epoch)

    def heard(self, worker_meta) -> None:
        """A worker output reached the scheduler half (None: it carried nothing for us); the
        first one decides."""
        if self.state != WAITING:
            return
        present = len((getattr(worker_meta, "hotfix_present", None) or {}).get(self.fix, ()))
        if present >= self.ranks:
            self.state = AGREED
            log.info("hotfix.halves.agreed", fix=self.fix, ranks=self.ranks)
            return
        self.state = DEGRADED
        _degraded(self.fix, "worker", f"{present} of {self.ranks} worker ranks announced "
                  f"the worker half (the others run without the hotfix, or with a release of it "
                  f"that does not speak {STAMP_ATTR})", "stock behaviour in this engine (the "
                  "scheduler half does nothing)")


    def give_up(self, reason: str) -> None:
        """This half failed internally (e.g. a stamp was lost): stock for good, like a missing
        half, so the workers stop too and nothing provisional outlives the next output."""
        if self.state != DEGRADED:
            self.state = DEGRADED
            _degraded(self.fix, "scheduler", reason, "stock behaviour in this engine")


def give_up(owner, attr: str, reason: str) -> None:
    """A fix's error fallback: degrade the scheduler half kept on ``owner`` under ``attr`` if
    it exists. Never creates one (creating it may be what failed) and never raises."""
    half = getattr(owner, "__dict__", {}).get(attr)
    if isinstance(half, SchedulerHalf):
        half.give_up(reason)


class WorkerHalf:
    """One worker rank's view of one fix: did the EngineCore announce the scheduler half?"""

    __slots__ = ("fix", "token", "state", "epoch")

    def __init__(self, fix: str) -> None:
        self.fix = fix
        self.token = uuid.uuid4().hex[:12]  # this rank, for the scheduler's count
        self.state: Optional[str] = None  # None until the first bound metadata
        self.epoch = 0

    @property
    def agreed(self) -> bool:
        return self.state == AGREED

    @property
    def may_ship(self) -> bool:
        """The EngineCore announced it reads our classes and has not given up on us."""
        return self.state in (WAITING, AGREED)

    def bound(self, metadata) -> None:
        """The worker bound this step's metadata: learn the scheduler half's state."""
        found = stamp_of(metadata, self.fix)
        if found is None:
            if self.state != DEGRADED:
                self.state = DEGRADED
                other = other_wire_stamps(metadata)
                reason = (f"the EngineCore runs another release of the hotfix (stamp {other}; this "
                          f"worker speaks {STAMP_ATTR})" if other else "the step's connector metadata "
                          "carries no stamp (the EngineCore is not patched, or the fix is off there)")
                _degraded(self.fix, "scheduler", reason,
                          "stock behaviour on this worker; nothing of ours is sent")
            return
        if found[0] == DEGRADED and self.state != DEGRADED:
            status.degrade(self.fix, "the scheduler half gave up on this engine's workers")
        self.state, self.epoch = found

    def presence(self) -> Dict[str, FrozenSet[str]]:
        """What to announce in this step's worker metadata ({} once agreed or degraded)."""
        return {self.fix: frozenset((self.token,))} if self.state == WAITING else {}


def _degraded(fix: str, missing: str, reason: str, action: str) -> None:
    status.degrade(fix, f"{missing} half missing: {reason}")
    log.once(("halves", fix, missing), "error", "hotfix.halves.degraded", fix=fix,
             missing_half=missing, reason=reason, action=action)
