"""Scenario events for the scheduler world (no vLLM import).

A timeline is a list of these; `step` is the world tick the event belongs to.
Arrivals, aborts and preemptions happen before that tick's `schedule()`;
`LoadDone`/`LoadFailed`/`SaveDone` say from which tick on a child's worker on a rank
reports the request (it reports at the first worker call at or after that
tick in which it is actually loading/saving the request); `Stop` makes the
model sample a stop token for the request in that tick. A new race is a new
ordering of these lines.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arrive:
    """A request reaches the engine.

    `hits` maps a cache-style child name to the number of prompt tokens it
    holds (from token 0). `remote_prefill` gives the request P/D
    kv_transfer_params, which a NIXL-style child pulls (`extra_params` added to
    them, e.g. a prefill's lease deadline). `same_prompt_as`
    reuses another request's prompt (a local prefix-cache hit on its blocks).
    """

    step: int
    req: str
    prompt_len: int = 64
    max_tokens: int = 4
    hits: Mapping[str, int] = field(default_factory=dict)
    remote_prefill: bool = False
    same_prompt_as: str | None = None
    extra_params: Mapping[str, object] = field(default_factory=dict)  # more kv_transfer_params


@dataclass(frozen=True)
class LoadDone:
    """Child `child` on TP rank `rank` (None: every rank) finishes loading `req`."""

    step: int
    req: str
    child: str
    rank: int | None = None


@dataclass(frozen=True)
class LoadFailed:
    """Child `child` on TP rank `rank` (None: every rank) ends its load of `req` in failure
    (vLLM 0.30+: `failed_recving`, which is also in `finished_recving`)."""

    step: int
    req: str
    child: str
    rank: int | None = None


@dataclass(frozen=True)
class SaveDone:
    """Child `child` on TP rank `rank` (None: every rank) finishes saving `req`."""

    step: int
    req: str
    child: str
    rank: int | None = None


@dataclass(frozen=True)
class Stop:
    """The model samples a stop token for `req` in this tick (FINISHED_STOPPED)."""

    step: int
    req: str


@dataclass(frozen=True)
class Abort:
    """The client goes away: `finish_requests(req, FINISHED_ABORTED)`.

    `during_execution=True` delivers it the way EngineCore's aborts queue
    does: after the model ran, before `update_from_output`.
    """

    step: int
    req: str
    during_execution: bool = False


@dataclass(frozen=True)
class Preempt:
    """Memory pressure evicts running request `req` (back to the waiting queue)."""

    step: int
    req: str


@dataclass(frozen=True)
class StrayReport:
    """Child `child` on `rank` (None: every rank) reports `req` at this tick although it
    is not loading (`kind="recv"`) or saving (`kind="send"`) it: a duplicate, or a
    connector breaking its contract."""

    step: int
    req: str
    child: str
    kind: str = "recv"
    rank: int | None = None


@dataclass(frozen=True)
class Elapse:
    """Wall-clock time passes before this tick: the world sleeps `seconds` (a transfer that
    takes long, or never ends, against a bound measured in seconds)."""

    step: int
    seconds: float


Event = Arrive | LoadDone | LoadFailed | SaveDone | Stop | Abort | Preempt | StrayReport | Elapse
