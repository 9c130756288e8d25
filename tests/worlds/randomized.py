"""Randomized timelines for the scheduler world, and the property every one of them must keep.

`timelines()` is a hypothesis strategy of `Scenario`s. A timeline is drawn as a list of
*incarnations*: one arrival of a request id with everything that happens to it afterwards
(completions of each child on each rank, an abort, a stop, preemptions). Ids come from a
small pool, so an id arriving twice is request-id reuse: `TimelineWorld` lets the second
arrival in only once the engine has let the first go: vLLM asserts on a live duplicate, and
under async scheduling a batch still in flight would hand the old request's token to the new
one (upstream's own hazard once VLLM_DISABLE_REQUEST_ID_RANDOMIZATION turns off the random
suffix that otherwise keeps scheduler ids unique; not a KV-transfer race).

Every transfer that can start gets a completion, so a clean engine always drains:
- a load by NIXL (remote prefill) and by the cache child (it holds a prefix hit; the buggy
  LMCache loads it even when NIXL is chosen), once per episode: the first scheduling and
  one more per preemption (the cache child may load again on resume);
- a save by a saving cache child for every incarnation (bystanders included);
each as one `LoadDone`/`SaveDone` for every rank or one per rank at its own tick.
A request left in the scheduler at the end is therefore the engine's fault, not the
timeline's: the property counts it (`NEVER_FINISHED`) next to the tracker's violations.

Load failures are not drawn: `failed_recving` exists from vLLM 0.30 on (0.27.1 has none)
and the timeline has no event for it yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from hotfix.worlds.scenarios import BUG_REPORT, NIXL_AND_SAVING_CACHE, Scenario
from hotfix.worlds.scheduler_world import RunResult, World, buggy_lmcache_mp, nixl_pull
from hotfix.worlds.timeline import Abort, Arrive, Event, LoadDone, Preempt, SaveDone, Stop

NIXL, CACHE = "nixl", "lmc"
REQUEST_IDS = ("R", "S", "T", "B")
BLOCK = 16
PROMPT_LENS = (32, 40, 64, 96)
MAX_DELAY = 12
MAX_SAVE_DELAY = 24

CHILD_SETS = (
    BUG_REPORT,
    NIXL_AND_SAVING_CACHE,
    # lmcache <= 0.5.4 with stores in flight: the stray load and the save hold together.
    (nixl_pull(), buggy_lmcache_mp(async_save=True)),
)

NEVER_FINISHED = "never_finished"


@dataclass(frozen=True)
class Profile:
    """What is fixed per request id across its incarnations: the world looks hits up by id."""

    prompt_len: int
    hit: int


def _ticks(base: int, max_delay: int):
    return st.integers(0, max_delay).map(lambda delay: base + delay)


@st.composite
def _completions(draw, kind, req: str, child: str, base: int, tp: int, max_delay: int):
    """One completion of ``child``'s transfer of ``req``: all ranks at once, or each rank at
    its own tick (what KVOutputAggregator has to put together)."""
    if tp > 1 and draw(st.booleans()):
        return [kind(draw(_ticks(base, max_delay)), req, child, rank=rank) for rank in range(tp)]
    return [kind(draw(_ticks(base, max_delay)), req, child)]


@st.composite
def _incarnation(draw, req: str, profile: Profile, others: tuple[str, ...], saves: bool,
                 tp: int) -> list[Event]:
    step = draw(st.integers(0, 8))
    remote = draw(st.booleans())
    arrive = Arrive(
        step,
        req,
        prompt_len=profile.prompt_len,
        max_tokens=draw(st.integers(1, 12)),
        hits={CACHE: profile.hit} if profile.hit else {},
        remote_prefill=remote,
        same_prompt_as=draw(st.none() | st.sampled_from(others)),
    )
    events: list[Event] = [arrive]
    preempts = draw(st.lists(_ticks(step + 1, MAX_DELAY), max_size=2))
    events += [Preempt(tick, req) for tick in preempts]
    abort = draw(st.none() | st.tuples(_ticks(step, MAX_DELAY), st.booleans()))
    if abort is not None:
        events.append(Abort(abort[0], req, during_execution=abort[1]))
    stop = draw(st.none() | _ticks(step + 1, MAX_DELAY))
    if stop is not None:
        events.append(Stop(stop, req))
    loaders = ([NIXL] if remote else []) + ([CACHE] if profile.hit else [])
    for child in loaders:
        for _ in range(1 + len(preempts)):
            events += draw(_completions(LoadDone, req, child, step, tp, MAX_DELAY))
    if saves:
        events += draw(_completions(SaveDone, req, CACHE, step, tp, MAX_SAVE_DELAY))
    return events


def _profiles():
    def profile(prompt_len: int):
        hits = st.sampled_from(range(0, prompt_len, BLOCK))
        return hits.map(lambda hit: Profile(prompt_len, hit))

    return st.fixed_dictionaries(
        {req: st.sampled_from(PROMPT_LENS).flatmap(profile) for req in REQUEST_IDS}
    )


@st.composite
def timelines(draw, max_arrivals: int = 5) -> Scenario:
    """A decode engine's children, TP size, scheduler kind and one timeline of arrivals
    (remote prefills, cache hits, bystanders, id reuse) and what happens to each."""
    children = draw(st.sampled_from(CHILD_SETS))
    tp = draw(st.sampled_from((1, 2)))
    async_scheduling = draw(st.booleans())
    saves = any(child.async_save for child in children)
    profiles = draw(_profiles())
    arrivals = draw(st.lists(st.sampled_from(REQUEST_IDS), min_size=1, max_size=max_arrivals))
    events: list[Event] = []
    for req in arrivals:
        others = tuple(other for other in REQUEST_IDS if other != req)
        events += draw(_incarnation(req, profiles[req], others, saves, tp))
    events.sort(key=lambda event: event.step)
    return Scenario(children, tuple(events), tp=tp, async_scheduling=async_scheduling)


class TimelineWorld(World):
    """A World for generated timelines, which cannot know the engine's state in advance:
    a Preempt of a request that is not running is skipped (the scheduler only evicts running
    requests), and an Arrive of an id the engine still knows waits until it is gone (vLLM
    asserts on a live duplicate id)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skipped: list[Preempt] = []
        self.preempted: list[Preempt] = []
        self.deferred: list[Arrive] = []
        self.reused: list[tuple[int, str]] = []
        self._seen: set[str] = set()

    def _tick(self, events: list[Event]) -> None:
        ready, waiting, arriving = [], [], set()
        for event in self.deferred + events:
            if isinstance(event, Arrive):
                if event.req in arriving or self._still_known(event.req):
                    waiting.append(event)
                    continue
                arriving.add(event.req)
                if event.req in self._seen:
                    self.reused.append((self.step, event.req))
                self._seen.add(event.req)
            ready.append(event)
        self.deferred = waiting
        super()._tick(ready)

    def _still_known(self, req_id: str) -> bool:
        """The engine has not let ``req_id`` go: it holds it, or a batch still in flight
        (async scheduling) carries it."""
        return req_id in self.scheduler.requests or any(
            req_id in output.num_scheduled_tokens for _, output, _ in self._batches
        )

    def _preempt(self, req_id: str) -> None:
        request = self.scheduler.requests.get(req_id)
        if request is None or request not in self.scheduler.running:
            self.skipped.append(Preempt(self.step, req_id))
            return
        super()._preempt(req_id)
        self.preempted.append(Preempt(self.step, req_id))

    def _idle(self) -> bool:
        return not self.deferred and super()._idle()


@dataclass
class Outcome:
    """What one timeline did: the world's RunResult plus what the runner had to adapt."""

    scenario: Scenario
    result: RunResult
    skipped: list[Preempt]
    preempted: list[Preempt]
    reused: list[tuple[int, str]]
    never_finished: list[str] = field(default_factory=list)

    @property
    def crash(self) -> str | None:
        crash = self.result.crash
        if crash is None:
            return None
        return f"{type(crash.exc).__name__} in {crash.function}: {crash.source_line}"

    def features(self) -> set[str]:
        """What this timeline exercised, to see that a budget covers the interesting cases."""
        timeline = self.scenario.timeline
        present = {
            "tp2": self.scenario.tp > 1,
            "async_scheduling": self.scenario.async_scheduling,
            "id_reuse": bool(self.reused),
            "preemption": bool(self.preempted),
            "abort": any(isinstance(event, Abort) for event in timeline),
            "async_save": any(child.async_save for child in self.scenario.children),
            "per_rank_completion": any(
                isinstance(event, (LoadDone, SaveDone)) and event.rank is not None
                for event in timeline
            ),
        }
        return {name for name, yes in present.items() if yes}

    def problems(self) -> list[str]:
        """Kinds of failure, empty for a clean run: the crash, each violation kind, and
        requests the engine never let go although every transfer completed."""
        kinds = [f"crash: {self.crash}"] if self.crash else []
        kinds += sorted({v.kind for v in self.result.violations})
        if self.never_finished:
            kinds.append(NEVER_FINISHED)
        return kinds

    def report(self) -> str:
        lines = [f"problems: {self.problems()}"]
        if self.result.crash is not None:
            lines.append(self.result.crash.traceback.rstrip())
        lines += [f"  {v}" for v in self.result.violations]
        if self.never_finished:
            lines.append(f"  still held at the end: {self.never_finished}")
        lines.append(describe(self.scenario))
        return "\n".join(lines)


def play(scenario: Scenario) -> Outcome:
    """Run one timeline in a fresh world (stock or patched: whatever vLLM is right now)."""
    world = TimelineWorld(scenario.children, tp=scenario.tp,
                          async_scheduling=scenario.async_scheduling)
    result = world.run(scenario.timeline, grace=scenario.grace)
    outcome = Outcome(scenario, result, world.skipped, world.preempted, world.reused)
    if result.crash is None:
        outcome.never_finished = sorted(world.scheduler.requests) + [
            f"{e.req} (arrival waiting)" for e in world.deferred
        ]
    return outcome


def describe(scenario: Scenario) -> str:
    """The scenario as a short script: one line per event."""
    children = ", ".join(
        f"{c.kind}({c.name}{', async_save' if c.async_save else ''})" for c in scenario.children
    )
    lines = [f"children=[{children}] tp={scenario.tp} async_scheduling={scenario.async_scheduling}"]
    for event in scenario.timeline:
        fields = {k: v for k, v in vars(event).items() if k not in ("step", "req")}
        if isinstance(event, Arrive):
            fields = {k: v for k, v in fields.items() if v}
        elif isinstance(event, (LoadDone, SaveDone)) and fields.get("rank") is None:
            fields.pop("rank")
        elif isinstance(event, Abort) and not fields["during_execution"]:
            fields.pop("during_execution")
        args = "".join(f", {k}={v!r}" for k, v in fields.items())
        lines.append(f"  {event.step:>3} {type(event).__name__}({event.req}{args})")
    return "\n".join(lines)
