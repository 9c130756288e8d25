"""The races of vllm-targets.md §0.2 as data, shared by the stock tests and
the fix tests: `SCENARIO.run()` builds a fresh World each time, so the same
scenario runs on stock vLLM or with the hotfix applied in-process, and
`dataclasses.replace(SCENARIO, tp=2, async_scheduling=True)` varies it.
"""

from dataclasses import dataclass

from hotfix.worlds.scheduler_world import (
    Child,
    RunResult,
    World,
    buggy_lmcache_mp,
    cache_loader,
    nixl_pull,
)
from hotfix.worlds.timeline import (
    Abort,
    Arrive,
    Elapse,
    Event,
    LoadDone,
    LoadFailed,
    Preempt,
    SaveDone,
    StrayReport,
)


@dataclass(frozen=True)
class Scenario:
    children: tuple[Child, ...]
    timeline: tuple[Event, ...]
    tp: int = 1
    async_scheduling: bool = False
    until: int | None = None
    grace: int = 64
    defer_async_loads: bool = False  # vLLM 0.33+ only; see World
    prefix_caching: bool = True
    pp: int = 1
    unpatched_ranks: tuple[int, ...] = ()
    sliding_window: int | None = None
    kv_load_failure_policy: str = "fail"
    max_num_inflight_kv_loads: int | None = None  # vLLM 0.34+ only; see World

    def run(self) -> RunResult:
        world = World(
            self.children,
            tp=self.tp,
            pp=self.pp,
            unpatched_ranks=self.unpatched_ranks,
            async_scheduling=self.async_scheduling,
            defer_async_loads=self.defer_async_loads,
            prefix_caching=self.prefix_caching,
            sliding_window=self.sliding_window,
            kv_load_failure_policy=self.kv_load_failure_policy,
            max_num_inflight_kv_loads=self.max_num_inflight_kv_loads,
        )
        return world.run(self.timeline, until=self.until, grace=self.grace)


# The bug report's decode node: NIXL first, then an LMCache MP that loads
# even when it is not chosen.
BUG_REPORT = (nixl_pull(), buggy_lmcache_mp())
# lmcache >= 0.5.5 (no double load) holding an async save.
NIXL_AND_SAVING_CACHE = (nixl_pull(), cache_loader(async_save=True))

# Other traffic keeps the engine stepping, as in production.
BYSTANDER = Arrive(0, "B", max_tokens=16)
# With a saving cache, B's own save finishes as soon as it starts.
BYSTANDER_SAVED = SaveDone(0, "B", "lmc")
# NIXL pulls R's whole prompt from P; the decode-side LMCache holds a
# 48-token prefix from an earlier turn.
REMOTE_R = Arrive(0, "R", remote_prefill=True, hits={"lmc": 48}, max_tokens=2)
LONG_REMOTE_R = Arrive(0, "R", remote_prefill=True, hits={"lmc": 48}, max_tokens=16)

# LMCache's load promotes R, R finishes and is freed; NIXL reports at 8.
LATE_REPORT_AFTER_FREE = Scenario(
    BUG_REPORT, (BYSTANDER, REMOTE_R, LoadDone(1, "R", "lmc"), LoadDone(8, "R", "nixl"))
)

# R, promoted by LMCache's load, is still decoding when NIXL reports at 4.
LATE_REPORT_WHILE_RUNNING = Scenario(
    BUG_REPORT, (LONG_REMOTE_R, LoadDone(1, "R", "lmc"), LoadDone(4, "R", "nixl"))
)

# D1 before any crash: R promoted at 2 while NIXL still pulls on both ranks;
# S, same prompt, arrives at 3 and takes R's blocks from the prefix cache.
EARLY_PROMOTION = Scenario(
    BUG_REPORT,
    (
        LONG_REMOTE_R,
        LoadDone(1, "R", "lmc"),
        Arrive(3, "S", same_prompt_as="R", max_tokens=4),
    ),
    tp=2,
    until=4,
)

# KVOutputAggregator counts two mixed reports (LMCache rank 0, NIXL rank 1)
# as "all ranks done"; the other two make a second report at 6.
TP_MIXED_REPORTS = Scenario(
    BUG_REPORT,
    (
        BYSTANDER,
        REMOTE_R,
        LoadDone(1, "R", "lmc", rank=0),
        LoadDone(1, "R", "nixl", rank=1),
        LoadDone(6, "R", "nixl", rank=0),
        LoadDone(6, "R", "lmc", rank=1),
    ),
    tp=2,
)

# D4: R aborted at 1 while WAITING_FOR_REMOTE_KVS; LMCache's save finishes
# first (2), NIXL's pull later (4).
ABORT_SAVE_FIRST = Scenario(
    NIXL_AND_SAVING_CACHE,
    (
        BYSTANDER,
        BYSTANDER_SAVED,
        Arrive(0, "R", remote_prefill=True),
        Abort(1, "R"),
        SaveDone(2, "R", "lmc"),
        LoadDone(4, "R", "nixl"),
    ),
)

# D4 the other way round: NIXL first (2), the save later (4).
ABORT_NIXL_FIRST = Scenario(
    NIXL_AND_SAVING_CACHE,
    (
        BYSTANDER,
        BYSTANDER_SAVED,
        Arrive(0, "R", remote_prefill=True),
        Abort(1, "R"),
        LoadDone(2, "R", "nixl"),
        SaveDone(4, "R", "lmc"),
    ),
)

# D5: only LMCache has reported R (at 1); NIXL's pull is still running.
SIBLING_REPORT_ONLY = Scenario(BUG_REPORT, (LONG_REMOTE_R, LoadDone(1, "R", "lmc")), until=1)

# Pitfall 13: the early-promoted R is preempted at 3 during NIXL's pull.
PREEMPT_EARLY_PROMOTED = Scenario(
    BUG_REPORT, (BYSTANDER, LONG_REMOTE_R, LoadDone(1, "R", "lmc"), Preempt(3, "R")), until=3
)

# Controls that stock vLLM survives.
SINGLE_LOADER = Scenario(
    BUG_REPORT,
    (BYSTANDER, Arrive(0, "R", remote_prefill=True, max_tokens=2), LoadDone(3, "R", "nixl")),
)
SAME_STEP_REPORTS = Scenario(
    BUG_REPORT,
    (BYSTANDER, REMOTE_R, LoadDone(3, "R", "lmc"), LoadDone(3, "R", "nixl")),
    tp=2,
)

# A save hold nobody releases: the end-of-run pool check must catch it.
SAVE_NEVER_REPORTS = Scenario(NIXL_AND_SAVING_CACHE, (Arrive(0, "R", max_tokens=2),), grace=8)


# The bug report's pair the other way round: NIXL's pull finishes first (2) while the
# stray LMCache load still writes; LMCache reports at 6.
NIXL_FIRST_LMCACHE_LATER = Scenario(
    BUG_REPORT, (BYSTANDER, REMOTE_R, LoadDone(2, "R", "nixl"), LoadDone(6, "R", "lmc"))
)

# The client goes away while both loads run; LMCache's report comes at 2, NIXL's at 5.
ABORT_WHILE_BOTH_LOAD = Scenario(
    BUG_REPORT,
    (BYSTANDER, REMOTE_R, Abort(1, "R"), LoadDone(2, "R", "lmc"), LoadDone(5, "R", "nixl")),
)

# After both loads are done and R is promoted, LMCache reports R once more (6).
STRAY_AFTER_PROMOTION = Scenario(
    BUG_REPORT,
    (BYSTANDER, LONG_REMOTE_R, LoadDone(1, "R", "lmc"), LoadDone(3, "R", "nixl"),
     StrayReport(6, "R", "lmc")),
)

# D4, both completions in the same step; B's save completes too so the pool is whole.
ABORT_SAME_STEP = Scenario(
    NIXL_AND_SAVING_CACHE,
    (BYSTANDER, Arrive(0, "R", remote_prefill=True), Abort(1, "R"),
     LoadDone(3, "R", "nixl"), SaveDone(3, "R", "lmc"), SaveDone(2, "B", "lmc")),
)

# The D4 pair with the bystander's own save completing, so a fixed run must end whole.
ABORT_SAVE_FIRST_ALL_SAVED = Scenario(
    NIXL_AND_SAVING_CACHE, ABORT_SAVE_FIRST.timeline + (SaveDone(3, "B", "lmc"),)
)
ABORT_NIXL_FIRST_ALL_SAVED = Scenario(
    NIXL_AND_SAVING_CACHE, ABORT_NIXL_FIRST.timeline + (SaveDone(3, "B", "lmc"),)
)

# A connector reports a send for a request that is still decoding (case 7) ...
SEND_FOR_LIVE_REQUEST = Scenario(
    (nixl_pull(), cache_loader()),
    (BYSTANDER, Arrive(0, "R", max_tokens=12), StrayReport(4, "R", "lmc", kind="send")),
)
# ... and one for a request that is long gone (case 6).
SEND_FOR_FREED_REQUEST = Scenario(
    (nixl_pull(), cache_loader()),
    (Arrive(0, "B", max_tokens=24), Arrive(0, "R", max_tokens=2),
     StrayReport(10, "R", "lmc", kind="send")),
)
# A duplicate load report for a request that already finished and was freed (case 3).
RECV_FOR_FREED_REQUEST = Scenario(
    (nixl_pull(), cache_loader()),
    (Arrive(0, "B", max_tokens=24), Arrive(0, "R", max_tokens=2), StrayReport(10, "R", "nixl")),
)

# TP=2 without recv-barrier: LMCache promotes R at 1; NIXL's READ ends on rank 0 at 6 and on
# rank 1 only at 12, long after R finished and was freed.
NIXL_RANKS_FINISH_APART = Scenario(
    BUG_REPORT,
    (Arrive(0, "B", max_tokens=24), REMOTE_R, LoadDone(1, "R", "lmc"),
     LoadDone(6, "R", "nixl", rank=0), LoadDone(12, "R", "nixl", rank=1)),
    tp=2,
)

# vLLM 0.33 deferred async loads (vllm-targets.md §0.4 pitfall 10). With overlapping batches
# and a HiSparse KV cache the scheduler parks R's async load (R arrives at 1 while B's batch
# is in flight) and starts it — MultiConnector.update_state_after_alloc — from
# `_drain_deferred_loads` when that batch is processed, i.e. after tick 1's metadata was built.
# The client aborts R at 2, after the load started on the scheduler side but before the
# metadata carrying NIXL's READ is built: finish_requests keeps the recv hold, the READ runs.
# LMCache's save of R completes at 3, NIXL's READ at 5.
ABORT_AFTER_DEFERRED_LOAD_STARTED = Scenario(
    NIXL_AND_SAVING_CACHE,
    (BYSTANDER, BYSTANDER_SAVED, Arrive(1, "R", remote_prefill=True), Abort(2, "R"),
     SaveDone(3, "R", "lmc"), LoadDone(5, "R", "nixl")),
    async_scheduling=True,
    defer_async_loads=True,
)
# The same abort with the bug report's pair (both loaders write R's blocks).
BUG_REPORT_ABORT_AFTER_DEFERRED_LOAD_STARTED = Scenario(
    BUG_REPORT,
    (BYSTANDER, Arrive(1, "R", remote_prefill=True, hits={"lmc": 48}, max_tokens=2),
     Abort(2, "R"), LoadDone(3, "R", "lmc"), LoadDone(5, "R", "nixl")),
    async_scheduling=True,
    defer_async_loads=True,
)

# vLLM 0.30+: NIXL's READ of R fails at 2 (failed_recving, and its blocks invalid) while the
# stray LMCache load still writes R's blocks until 5 ...
NIXL_FAILS_WHILE_LMCACHE_WRITES = Scenario(
    BUG_REPORT, (BYSTANDER, REMOTE_R, LoadFailed(2, "R", "nixl"), LoadDone(5, "R", "lmc"))
)
# ... and the stray LMCache load fails at 2 while NIXL's READ runs until 5.
LMCACHE_FAILS_WHILE_NIXL_WRITES = Scenario(
    BUG_REPORT, (BYSTANDER, REMOTE_R, LoadFailed(2, "R", "lmc"), LoadDone(5, "R", "nixl"))
)

# No local prefix cache: both loads of R end at 2, R runs and is preempted at 4; its resume
# starts a second load episode under the same id, from LMCache alone (NIXL pulls once per
# request). NIXL reports R again at 6, a late report of the first episode; LMCache's second
# load ends at 9.
RESUME_LOAD_AFTER_PREEMPTION = Scenario(
    BUG_REPORT,
    (BYSTANDER, LONG_REMOTE_R, LoadDone(2, "R", "lmc"), LoadDone(2, "R", "nixl"),
     Preempt(4, "R"), StrayReport(6, "R", "nixl"), LoadDone(9, "R", "lmc")),
    prefix_caching=False,
)

# Partial rollout, pipeline stages and idle engines (hardening). The bug report's pair with
# recv-barrier off promotes R early; R finishes while NIXL still READs into its blocks.
# With nothing else arriving, the engine goes idle as soon as R is gone.
NIXL_LATE_ON_AN_IDLE_ENGINE = Scenario(
    BUG_REPORT,
    (REMOTE_R, LoadDone(1, "R", "lmc"), LoadDone(9, "R", "nixl")),
)
# Two pipeline stages, each stage's NIXL reading its own layers: stage 0 is done at 6,
# stage 1 still writes until 12 (B keeps the engine stepping).
NIXL_STAGES_FINISH_APART = Scenario(
    BUG_REPORT,
    (Arrive(0, "B", max_tokens=24), REMOTE_R, LoadDone(1, "R", "lmc"),
     LoadDone(6, "R", "nixl", rank=0), LoadDone(12, "R", "nixl", rank=1)),
    pp=2,
)
# Request-id reuse (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1, or a client that sets ids): R is
# promoted early by the cache's report and finishes under NIXL's READ; R arrives again at 6 and
# the same happens to its second READ. NIXL keeps one handle list per id and reports R once,
# at 12, when both READs are done. No prefix cache, so the second R gets blocks of its own.
READS_UNDER_ONE_REQUEST_ID = Scenario(
    BUG_REPORT,
    (Arrive(0, "B", max_tokens=30), REMOTE_R, LoadDone(1, "R", "lmc"),
     Arrive(6, "R", remote_prefill=True, hits={"lmc": 48}, max_tokens=2), LoadDone(7, "R", "lmc"),
     LoadDone(12, "R", "nixl")),
    prefix_caching=False,
)


# D8 (load-bound): loads that do not end within the bound. The tests set
# HOTFIX_LOAD_TIMEOUT_S=LOAD_BOUND_TEST_S; the world sleeps past it before tick 2, and the late
# report comes at 9 (the hung prefill resumed, the READ finally ended).
LOAD_BOUND_TEST_S = 0.5
PAST_THE_BOUND = Elapse(2, 1.5 * LOAD_BOUND_TEST_S)
REMOTE_ONLY_R = Arrive(0, "R", remote_prefill=True, max_tokens=2)
# recv-barrier's wedge: the chosen NIXL is done at 1, the stray LMCache retrieve runs until 9.
STRAY_LOAD_PAST_THE_BOUND = Scenario(
    BUG_REPORT, (BYSTANDER, REMOTE_R, LoadDone(1, "R", "nixl"), PAST_THE_BOUND, LoadDone(9, "R", "lmc"))
)
# The chosen READ hangs (a SIGSTOPped prefill) until 9.
CHOSEN_LOAD_PAST_THE_BOUND = Scenario(
    (nixl_pull(),), (BYSTANDER, REMOTE_ONLY_R, PAST_THE_BOUND, LoadDone(9, "R", "nixl"))
)
# TP=2: rank 0's READ ends at 1, rank 1's only at 9.
RANK_LOAD_PAST_THE_BOUND = Scenario(
    (nixl_pull(),),
    (BYSTANDER, REMOTE_ONLY_R, LoadDone(1, "R", "nixl", rank=0), PAST_THE_BOUND,
     LoadDone(9, "R", "nixl", rank=1)),
    tp=2,
)
# Control: both loaders end within the bound.
LOADS_WITHIN_THE_BOUND = Scenario(
    BUG_REPORT, (BYSTANDER, REMOTE_R, LoadDone(1, "R", "nixl"), LoadDone(2, "R", "lmc"))
)
# The client leaves while the READ hangs: vLLM keeps R's blocks until NIXL reports (at 9).
ABORT_WHILE_READ_PAST_THE_BOUND = Scenario(
    (nixl_pull(),), (BYSTANDER, REMOTE_ONLY_R, Abort(1, "R"), PAST_THE_BOUND, LoadDone(9, "R", "nixl"))
)

# vLLM 0.34+ with --max-num-inflight-kv-loads 1: an aborted load holds the one in-flight slot
# until it reports (`_aborted_kv_loads`), so S's async load waits for R's report...
ONE_INFLIGHT_LOAD = 1
# ... which hangs past the bound (stock: S waits for the report at 9) ...
ABORT_WHILE_READ_PAST_THE_BOUND_THEN_S = Scenario(
    (nixl_pull(),), ABORT_WHILE_READ_PAST_THE_BOUND.timeline + (
        Arrive(3, "S", remote_prefill=True, max_tokens=2), LoadDone(5, "S", "nixl")),
    max_num_inflight_kv_loads=ONE_INFLIGHT_LOAD, grace=20,
)
# ... or comes while an async save still holds R's blocks (D4: stock dies on the report).
ABORT_NIXL_FIRST_ALL_SAVED_THEN_S = Scenario(
    NIXL_AND_SAVING_CACHE, ABORT_NIXL_FIRST_ALL_SAVED.timeline + (
        Arrive(6, "S", remote_prefill=True, max_tokens=2), LoadDone(8, "S", "nixl"), SaveDone(11, "S", "lmc")),
    max_num_inflight_kv_loads=ONE_INFLIGHT_LOAD, grace=20,
)
