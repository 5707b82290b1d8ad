"""An exhaustive explorer of presumed-abort two-phase commit, with crashes, driving the real rules.

Every decision is asked of `coordinator.protocol` (``plan``, ``tally``, ``branch_result``,
``outcome``, ``recovery_action``) through a `Rules` object, so the model checks the rules the
driver runs, not a copy of them; a test swaps one rule for a wrong one to prove the checks bite.
What the explorer writes itself is only the *order of steps*, mirrored from the driver:

- ``_completion``: plan; sequential prepare in sort order, stopping at the first no; tally; force
  the COMMIT record; commit the branches in order; END (not forced, and only if every branch
  answered); answer the caller. A no vote rolls back what the tally says, logging nothing.
- ``recovery``: step 1 re-commits every branch of a COMMIT without END, stopping at the first
  failure (``all()`` short-circuits), then writes END; step 2 asks ``recovery_action`` about every
  prepared branch and rolls back those it says to. A pass with a failure is retried.

Nondeterminism, each bounded so the space is finite: every vote (commit, read-only, rollback,
raise, or a timeout after the branch did prepare); set_rollback_only before commit; the three
ways a log force can end (durable, certainly not written, unknown either way); a participant
unreachable during phase two or recovery, before or after applying the call (``outages``); a
crash of the coordinator or of recovery between any two steps (``crashes``); whether an END
still in the write buffer survives a crash; and a background recovery pass, under the in-flight
guard, between any two steps of a live transaction.

With ``last=True`` the last participant is a logging last resource (`coordinator.last_resource`):
it never prepares; once the others voted commit it commits in one phase with the decision row in
its own table (``Log.row``), which is the commit point, or refuses (certainly not committed), or
loses its answer either way; alone (the others read-only) it commits in plain one phase. Recovery
looks the row up once per pass before it presumes anything, and the lookup fences: a gtrid with
no row gets an abort row, after which the last resource's commit can only fail. The lookup may
find the table unreachable, and then the pass presumes nothing.

With ``lazy=True`` the preparing participants write their phase-two commit record lazily
(`coordinator.lazy_commit`): a commit answered in phase two leaves the branch committed but
*volatile* (``State.volatile``) until a flush, which may come at any moment; a crash turns a
volatile branch back into a prepared one; END (or, with a last resource, the row's clean-up) waits
until no branch is volatile (``State.deferred_end``, the `EndLatch`), and recovery's commit of a
volatile branch flushes it. ``eager_end=True`` drops that wait, to prove the checks catch it.

With ``in_flight=k`` the last ``k`` preparing participants send their prepares first
(`coordinator.early_prepare`; the Redis branches beside PostgreSQL): each is asked in turn, its
answer taking effect at once but heard only later, so a no among them stops nothing, while a send
that fails stops phase one there; then the others are asked in sort order, stopping at the first
no; only then is anything tallied. ``guess_in_flight=True`` tallies as if every vote still in
flight were a commit, to prove the checks catch a decision made before every vote is read.

A crash is modelled as the resources see it: unprepared work dies with its session (an active
branch becomes rolled back), prepared branches and the durable log survive, the coordinator's
memory (votes, results) is gone, and the caller hears nothing more.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from coordinator import protocol
from coordinator.protocol import Action, BranchResult, Plan, Tally, Verdict
from coordinator.resource import Outcome, Vote

INVARIANTS = (
    "atomicity",
    "decision_stable",
    "no_in_doubt_residue",
    "recovery_idempotent",
    "lazy_covered",
)
#: not one of the protocol's invariants: a state that is neither finished nor able to move means
#: the model itself is wrong, and every other check would then pass vacuously.
PROGRESS = "progress"
#: a preparer phase one did not ask (``in_flight``: votes are kept by position, not by order)
UNASKED = "unasked"


class Part(enum.Enum):
    """A participant branch as its resource sees it."""

    ACTIVE = "active"
    PREPARED = "prepared"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled-back"
    READ_ONLY_DONE = "read-only-done"


class Told(enum.Enum):
    """What ``commit()`` gave the caller."""

    NOTHING = "nothing"  # still waiting, or the process died before answering
    COMMITTED = "committed"  # returned (COMMITTED, COMMIT_PENDING or READ_ONLY)
    ROLLED_BACK = "rolled-back"  # TransactionRolledBack
    UNKNOWN = "unknown"  # OutcomeUnknownError: the log could not say whether COMMIT is on disk
    HEURISTIC = "heuristic"  # a HeuristicError


class End(enum.Enum):
    """END is appended without a force: a crash may lose it while it sits in the buffer."""

    NONE = "none"
    BUFFERED = "buffered"
    DURABLE = "durable"


class Row(enum.Enum):
    """The last resource's decision-table row for the transaction (durable, in its database)."""

    NONE = "none"
    COMMIT = "commit"  # inserted and committed together with the last resource's data
    ABORT = "abort"  # recovery's fence
    #: deleted once every branch ended (the END of a transaction with a last resource): a later
    #: lookup finds no row, so it fences (ABORT)
    CLEANED = "cleaned"


class Log(NamedTuple):
    """The decision log of the one transaction explored: its COMMIT record and its END; and the
    last resource's row, where a transaction with a last resource keeps its decision."""

    commit: tuple[str, ...] | None = None
    end: End = End.NONE
    row: Row = Row.NONE

    @property
    def pending(self) -> bool:
        """COMMIT without END: what ``DecisionLog.pending()`` lists and recovery re-drives."""
        return self.commit is not None and self.end is End.NONE


class Step(enum.Enum):
    """Where the coordinator (or recovery) stands: the program counter of the model."""

    START = "start"
    PREPARE = "prepare"
    ABORT = "abort"  # rolling back the names in ``Pc.names``
    WRITE_DECISION = "write-decision"
    COMMIT = "commit"  # phase two over ``Pc.names``
    END = "end"
    REPLY = "reply"  # _finish has run; the caller is answered next
    STALLED = "stalled"  # the log failed with durable=None: nothing moves until a restart
    REC_START = "recovery-start"
    REC_COMMIT = "recovery-commit"  # step 1 over the COMMIT record's branches
    REC_END = "recovery-end"
    REC_ABORT = "recovery-abort"  # step 2: presumed abort
    LAST_COMMIT = "last-commit"  # the last resource commits with the decision row (``names``)
    QUIESCENT = "quiescent"  # a recovery pass finished with no failure


COORDINATOR_STEPS = frozenset(
    {
        Step.START,
        Step.PREPARE,
        Step.ABORT,
        Step.WRITE_DECISION,
        Step.LAST_COMMIT,
        Step.COMMIT,
        Step.END,
        Step.REPLY,
    }
)
RECOVERY_STEPS = frozenset({Step.REC_START, Step.REC_COMMIT, Step.REC_END, Step.REC_ABORT})
#: steps at which the transaction is in the live manager's in-flight table, so a periodic recovery
#: pass may run beside it. (At REPLY ``_finish`` has removed it; a STALLED manager keeps it in the
#: guard and runs no presumed abort at all, so a pass there does nothing, whatever the rules say.)
BACKGROUND_STEPS = COORDINATOR_STEPS - {Step.REPLY}


class Pc(NamedTuple):
    step: Step
    at: int = 0  # position in ``names`` (or among the participants)
    names: tuple[str, ...] = ()
    results: tuple[BranchResult, ...] = ()
    outcome: Outcome | None = None
    failed: bool = False  # this recovery pass left something to retry
    #: the last resource's answer is unknown: its table, not a restart, settles it (REPLY)
    settles: bool = False
    #: recovery's table lookup this pass: None not yet, False unreachable, True answered
    known: bool | None = None


class State(NamedTuple):
    parts: tuple[Part, ...]
    log: Log
    told: Told
    pc: Pc
    #: the answers phase one got, in sort order (None: raised). A ghost variable: the coordinator
    #: forgets it in a crash, but the invariants need it to judge what the caller was told.
    votes: tuple[Vote | str | None, ...]
    crashes_left: int
    outages_left: int
    recovery_crashes: int  # how many crashes hit recovery itself
    #: committed branches whose (lazy) commit record is not on disk yet: a crash makes them
    #: prepared again
    volatile: frozenset[int] = frozenset()
    #: phase two is over and END waits for the volatile branches (in memory: a crash drops it)
    deferred_end: bool = False


_SITES = {
    Step.START: "before commit begins",
    Step.WRITE_DECISION: "before the decision write",
    Step.LAST_COMMIT: "before the last resource commits",
    Step.END: "before END",
    Step.REPLY: "before the caller is answered",
    Step.STALLED: "restart after an unknown log write",
    Step.REC_START: "at the start of recovery",
    Step.REC_END: "in recovery before END",
}


class RecoveryRule(Protocol):
    def __call__(
        self,
        *,
        ours: bool,
        has_decision: bool,
        maybe_in_flight: bool,
        decision_known: bool = True,
    ) -> Action: ...


@dataclass(frozen=True)
class Rules:
    """The decision rules the explorer asks; the defaults are the real ones."""

    plan: Callable[[int, bool], Plan] = protocol.plan
    tally: Callable[[Iterable[str], Mapping[str, Vote | None]], Tally] = protocol.tally
    branch_result: Callable[[Outcome | None], BranchResult] = protocol.branch_result
    outcome: Callable[[Verdict, Mapping[str, BranchResult]], Outcome] = protocol.outcome
    recovery_action: RecoveryRule = protocol.recovery_action


@dataclass
class Report:
    states: int = 0
    terminal: int = 0
    #: invariant name -> the shortest traces (BFS order) that break it, at most a few each
    violations: dict[str, list[str]] = field(default_factory=dict)
    crash_sites: set[str] = field(default_factory=set)
    max_recovery_crashes: int = 0
    #: (crashes in all, of which in recovery) seen in quiescent states
    crash_profiles: set[tuple[int, int]] = field(default_factory=set)
    told_at_end: set[Told] = field(default_factory=set)
    #: (COMMIT logged or a last resource's commit row, told)
    outcomes_at_end: set[tuple[bool, Told]] = field(default_factory=set)


class _Reply(NamedTuple):
    """One way a commit or rollback call can end."""

    label: str
    part: Part
    reached: bool  # False: the call raised (unreachable, timed out)
    reported: Outcome | None
    outages: int


# One answer to prepare: (label, vote the coordinator sees, branch state afterwards).
_PREPARE_ANSWERS: tuple[tuple[str, Vote | None, Part], ...] = (
    ("votes commit", Vote.COMMIT, Part.PREPARED),
    ("votes read-only", Vote.READ_ONLY, Part.READ_ONLY_DONE),
    ("votes rollback", Vote.ROLLBACK, Part.ROLLED_BACK),
    ("prepare raises, nothing prepared", None, Part.ACTIVE),
    ("prepare times out after preparing", None, Part.PREPARED),
)


def _commit_call(part: Part) -> tuple[Part, Outcome | None]:
    """A resource's ``commit(xid)``: idempotent, and an unknown branch 'succeeds' (the contract)."""
    if part in (Part.PREPARED, Part.COMMITTED):
        return Part.COMMITTED, None
    if part is Part.ROLLED_BACK:
        return part, Outcome.HEURISTIC_ROLLBACK
    return part, None  # active or read-only: nothing prepared under this xid


def _rollback_call(part: Part) -> tuple[Part, Outcome | None]:
    """A resource's ``rollback(xid)``: idempotent; a committed branch reports HEURISTIC_COMMIT."""
    if part is Part.COMMITTED:
        return part, Outcome.HEURISTIC_COMMIT
    if part is Part.READ_ONLY_DONE:
        return part, None
    return Part.ROLLED_BACK, None


def told_of(outcome: Outcome | None) -> Told:
    """What ``commit()`` hands the caller for the outcome ``_finish`` recorded."""
    if outcome is None:
        return Told.UNKNOWN
    if outcome in (Outcome.COMMITTED, Outcome.COMMIT_PENDING, Outcome.READ_ONLY):
        return Told.COMMITTED
    if outcome is Outcome.ROLLED_BACK:
        return Told.ROLLED_BACK
    return Told.HEURISTIC


def _set(parts: tuple[Part, ...], i: int, part: Part) -> tuple[Part, ...]:
    return (*parts[:i], part, *parts[i + 1 :])


def _sessions_closed(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    """Unprepared work cannot outlive the coordinator's session: the resource aborts it."""
    return tuple(Part.ROLLED_BACK if p is Part.ACTIVE else p for p in parts)


Successors = list[tuple[str, State]]


class Explorer:
    """Breadth-first search over every state reachable under ``rules``, checking invariants."""

    def __init__(
        self,
        rules: Rules | None = None,
        *,
        n: int = 3,
        crashes: int = 4,
        outages: int = 3,
        last: bool = False,
        lazy: bool = False,
        eager_end: bool = False,
        in_flight: int = 0,
        guess_in_flight: bool = False,
    ) -> None:
        self.rules = rules or Rules()
        self.lazy = lazy
        self.eager_end = eager_end
        self.names = tuple("abcdefgh"[:n])  # sort order: prepare, commit and recovery order
        #: the logging last resource (the last name) when ``last``; the others prepare
        self.last = self.names[-1] if last else None
        self.preparers = self.names[:-1] if last else self.names
        #: the order phase one asks the preparers in (indexes): those in flight first
        self.senders = frozenset(range(len(self.preparers) - in_flight, len(self.preparers)))
        self.ask_order = (*sorted(self.senders), *(i for i in range(len(self.preparers))
                                                   if i not in self.senders))  # fmt: skip
        self.guess_in_flight = guess_in_flight
        self.position = {name: i for i, name in enumerate(self.names)}
        self.crashes = crashes
        self.outages = outages
        self._steps: dict[Step, Callable[[State], Successors]] = {
            Step.START: self._start,
            Step.PREPARE: self._prepare,
            Step.ABORT: self._abort,
            Step.WRITE_DECISION: self._write_decision,
            Step.COMMIT: self._commit,
            Step.END: self._end,
            Step.REPLY: self._reply,
            Step.STALLED: lambda s: [],
            Step.REC_START: self._rec_start,
            Step.REC_COMMIT: self._rec_commit,
            Step.REC_END: self._rec_end,
            Step.REC_ABORT: self._rec_abort,
            Step.LAST_COMMIT: self._last_commit,
            Step.QUIESCENT: lambda s: [],
        }

    def initial(self) -> State:
        parts = (Part.ACTIVE,) * len(self.names)
        votes = (UNASKED,) * len(self.preparers) if self.senders else ()
        return State(
            parts, Log(), Told.NOTHING, Pc(Step.START), votes, self.crashes, self.outages, 0
        )

    # -- search ------------------------------------------------------------------------------

    def explore(self, *, stop_on: str | None = None, traces: int = 3) -> Report:
        """Visit every reachable state once; stop early once ``stop_on`` is violated."""
        report = Report()
        start = self.initial()
        parents: dict[State, tuple[State | None, str]] = {start: (None, "begin")}
        queue = deque([start])
        while queue and not (stop_on and stop_on in report.violations):
            state = queue.popleft()
            moves = self.successors(state)
            broken = self.check(state, report, moves)
            for name in broken:
                found = report.violations.setdefault(name, [])
                if len(found) < traces:
                    found.append(_trace(parents, state))
            for label, nxt in moves:
                if label.startswith("crash "):
                    report.crash_sites.add(self.site(state.pc))
                if nxt not in parents:
                    parents[nxt] = (state, label)
                    queue.append(nxt)
        report.states = len(parents)
        return report

    def successors(self, state: State) -> Successors:
        found = self._steps[state.pc.step](state)
        found += self._crash(state)
        found += self._background_recovery(state)
        found += self._flushes(state)
        return found

    def _flushes(self, state: State) -> Successors:
        """A store's lazy commit record reaches the disk; the last one releases a deferred END."""
        found: Successors = []
        for i in sorted(state.volatile):
            nxt = state._replace(volatile=state.volatile - {i})
            if not nxt.volatile and nxt.deferred_end:
                nxt = self._release_end(nxt)
            found.append((f"{self.names[i]}'s commit record on disk", nxt))
        return found

    def _release_end(self, state: State) -> State:
        """The deferred END (with a last resource: the row's deletion)."""
        log = (
            state.log._replace(row=Row.CLEANED)
            if self.last
            else state.log._replace(end=End.BUFFERED)
        )
        return state._replace(log=log, deferred_end=False)

    def site(self, pc: Pc) -> str:
        """Name the step boundary ``pc`` stands at, in the words of the driver's crash points."""
        step, i = pc.step, pc.at
        if step in (Step.PREPARE, Step.ABORT, Step.COMMIT, Step.REC_COMMIT):
            names = self.preparers if step is Step.PREPARE else pc.names
            if step is Step.PREPARE:
                i = self.ask_order[i]
            verb = {Step.PREPARE: "prepare", Step.ABORT: "rollback"}.get(step, "commit")
            where = "in recovery " if step is Step.REC_COMMIT else ""
            return f"{where}before {verb} {names[i]}"
        if step is Step.REC_ABORT:
            if self.last and pc.known is None and not i:
                return "in recovery before the table lookup"
            done = f"after presumed abort of {self.names[i - 1]}" if i else "before presumed abort"
            return f"in recovery {done}"
        return _SITES[step]

    # -- checks ------------------------------------------------------------------------------

    def check(self, state: State, report: Report, moves: Successors) -> list[str]:
        """Invariants of ``state``: atomicity and lazy_covered everywhere, the rest once
        recovery is quiescent."""
        broken = [] if atomic(state.parts) else ["atomicity"]
        if state.volatile and not self._decided(state.log):
            broken.append("lazy_covered")  # a crash now would presume a committed branch aborted
        if state.pc.step is not Step.QUIESCENT:
            if not moves:
                broken.append(PROGRESS)
            return broken
        report.terminal += 1
        report.max_recovery_crashes = max(report.max_recovery_crashes, state.recovery_crashes)
        used = self.crashes - state.crashes_left
        report.crash_profiles.add((used, state.recovery_crashes))
        report.told_at_end.add(state.told)
        decided = state.log.commit is not None or state.log.row in (Row.COMMIT, Row.CLEANED)
        report.outcomes_at_end.add((decided, state.told))
        if not decision_stable(state, self.last is not None):
            broken.append("decision_stable")
        if not no_in_doubt_residue(state):
            broken.append("no_in_doubt_residue")
        if not self.recovery_idempotent(state):
            broken.append("recovery_idempotent")
        return broken

    def recovery_idempotent(self, state: State) -> bool:
        """Two more recovery passes, with nothing failing, leave branches, log and caller alone."""
        once = self.settle(state)
        twice = self.settle(once)
        return all(_visible(s) == _visible(state) for s in (once, twice))

    def settle(self, state: State, limit: int = 100) -> State:
        """Run one recovery pass from ``state`` with no crash and every participant reachable."""
        current = state._replace(pc=Pc(Step.REC_START), crashes_left=0, outages_left=0)
        for _ in range(limit):
            if current.pc.step is Step.QUIESCENT:
                return current
            moves = self._steps[current.pc.step](current)
            if len(moves) != 1:
                raise AssertionError(f"recovery is not deterministic at {current.pc}: {moves}")
            current = moves[0][1]
        raise AssertionError(f"recovery did not finish in {limit} steps from {state}")

    # -- participants --------------------------------------------------------------------------

    def _calls(
        self, state: State, i: int, call: Callable[[Part], tuple[Part, Outcome | None]]
    ) -> list[_Reply]:
        """The call answers; or, if an outage is left, it raises before or after taking effect."""
        part = state.parts[i]
        done, reported = call(part)
        replies = [_Reply("answers", done, True, reported, 0)]
        if state.outages_left:
            lost = Part.ROLLED_BACK if part is Part.ACTIVE else part  # its session is gone
            replies.append(_Reply("unreachable", lost, False, None, 1))
            replies.append(_Reply("applied, reply lost", done, False, None, 1))
        return replies

    def _after_call(self, state: State, i: int, reply: _Reply, pc: Pc) -> State:
        return state._replace(
            parts=_set(state.parts, i, reply.part),
            outages_left=state.outages_left - reply.outages,
            pc=pc,
        )

    # -- the coordinator (_completion) ---------------------------------------------------------

    def _start(self, state: State) -> Successors:
        found: list[tuple[str, Pc]] = []
        for rollback_only in (False, True):
            chosen = self.rules.plan(len(self.names), rollback_only)
            if chosen is Plan.ROLLBACK:
                pc = Pc(Step.ABORT, names=self.names)
            elif chosen is Plan.TWO_PHASE:
                pc = Pc(Step.PREPARE)
            else:
                raise AssertionError(f"plan({len(self.names)}) chose {chosen}; model needs 2PC")
            found.append((f"commit (rollback_only={rollback_only}): {chosen.value}", pc))
        return [(label, state._replace(pc=pc)) for label, pc in found]

    def _prepare(self, state: State) -> Successors:
        if self.senders:
            return self._prepare_in_flight(state)
        i = state.pc.at
        found: Successors = []
        for label, vote, part in _PREPARE_ANSWERS:
            votes = (*state.votes, vote)
            last = vote in (None, Vote.ROLLBACK) or i + 1 == len(self.preparers)
            pc = self._tally(votes) if last else Pc(Step.PREPARE, i + 1)
            nxt = state._replace(parts=_set(state.parts, i, part), votes=votes, pc=pc)
            found.append((f"prepare {self.preparers[i]}: {label}", nxt))
        return found

    def _prepare_in_flight(self, state: State) -> Successors:
        """The ``at``-th ask of `ask_order`: a send (its answer heard only at the tally, so a no
        stops nothing, but a failed send stops phase one) or a plain prepare."""
        k = state.pc.at
        i = self.ask_order[k]
        sender = i in self.senders
        answers = [(label, vote, part, not sender and vote in (None, Vote.ROLLBACK))
                   for label, vote, part in _PREPARE_ANSWERS]  # fmt: skip
        if sender:
            answers.append(("the send fails, nothing prepared", None, Part.ACTIVE, True))
        found: Successors = []
        for label, vote, part, stop in answers:
            votes = (*state.votes[:i], vote, *state.votes[i + 1 :])
            pc = (
                self._tally(votes)
                if stop or k + 1 == len(self.ask_order)
                else Pc(Step.PREPARE, k + 1)
            )
            nxt = state._replace(parts=_set(state.parts, i, part), votes=votes, pc=pc)
            found.append((f"{'send' if sender else 'prepare'} {self.preparers[i]}: {label}", nxt))
        return found

    def _tally(self, votes: tuple[Vote | str | None, ...]) -> Pc:
        # A branch never asked (an earlier one said no) is missing from the map, as in the driver.
        asked = {n: v for n, v in zip(self.preparers, votes, strict=False) if v is not UNASKED}
        if self.guess_in_flight:  # the bug the driver must not have: not waiting for the reads
            asked |= {self.preparers[i]: Vote.COMMIT for i in self.senders if votes[i] != UNASKED}
        result = self.rules.tally(self.preparers, asked)
        tail = (self.last,) if self.last else ()
        if result.verdict is Verdict.ABORT:
            return Pc(Step.ABORT, names=result.rollback + tail)
        if self.last:  # the last resource commits, with the row unless it is alone
            return Pc(Step.LAST_COMMIT, names=result.commit)
        if result.verdict is Verdict.READ_ONLY:
            return Pc(Step.REPLY, outcome=Outcome.READ_ONLY)
        return Pc(Step.WRITE_DECISION, names=result.commit)

    def _abort(self, state: State) -> Successors:
        pc = state.pc
        if pc.at == len(pc.names):
            return [("rolled back", state._replace(pc=Pc(Step.REPLY, outcome=Outcome.ROLLED_BACK)))]
        name = pc.names[pc.at]
        nxt = pc._replace(at=pc.at + 1)
        if nxt.at == len(pc.names):
            nxt = Pc(Step.REPLY, outcome=Outcome.ROLLED_BACK)
        return [
            (f"rollback {name}: {r.label}", self._after_call(state, self.position[name], r, nxt))
            for r in self._calls(state, self.position[name], _rollback_call)
        ]

    def _write_decision(self, state: State) -> Successors:
        names = state.pc.names
        written = state.log._replace(commit=names)
        unknown = Pc(Step.REPLY, outcome=None)
        return [
            ("force COMMIT: durable", state._replace(log=written, pc=Pc(Step.COMMIT, names=names))),
            ("force COMMIT: not written", state._replace(pc=Pc(Step.ABORT, names=names))),
            ("force COMMIT: unknown, on disk", state._replace(log=written, pc=unknown)),
            ("force COMMIT: unknown, not on disk", state._replace(pc=unknown)),
        ]

    def _commit(self, state: State) -> Successors:
        pc = state.pc
        name = pc.names[pc.at]
        i = self.position[name]
        found: Successors = []
        for reply in self._calls(state, i, _commit_call):
            result = BranchResult.UNREACHABLE
            if reply.reached:
                result = self.rules.branch_result(reply.reported)
            results = (*pc.results, result)
            nxt = pc._replace(at=pc.at + 1, results=results)
            if nxt.at == len(pc.names):
                nxt = self._phase_two_done(pc.names, results)
            after = self._after_call(state, i, reply, nxt)
            if self.lazy and reply.part is Part.COMMITTED and state.parts[i] is Part.PREPARED:
                after = after._replace(volatile=after.volatile | {i})  # its record is lazy
            found.append((f"commit {name}: {reply.label}", after))
        return found

    def _phase_two_done(self, names: tuple[str, ...], results: tuple[BranchResult, ...]) -> Pc:
        outcome = self.rules.outcome(Verdict.COMMIT, dict(zip(names, results, strict=True)))
        if BranchResult.UNREACHABLE in results:
            return Pc(Step.REPLY, outcome=outcome)  # no END: recovery must re-drive it
        return Pc(Step.END, outcome=outcome)

    def _last_commit(self, state: State) -> Successors:
        """The last resource's one-phase commit: with the row (the commit point), or alone."""
        names, i = state.pc.names, self.position[str(self.last)]
        alone = not names  # every other branch read-only: plain one phase, no row
        log = state.log if alone else state.log._replace(row=Row.COMMIT)
        fenced = state.log.row is Row.ABORT  # the row's key refuses the commit
        done = Pc(Step.REPLY, outcome=Outcome.COMMITTED) if alone else Pc(Step.COMMIT, names=names)
        committed = state._replace(parts=_set(state.parts, i, Part.COMMITTED), log=log)
        refused = state._replace(parts=_set(state.parts, i, Part.ROLLED_BACK))
        found: Successors = []
        if not fenced:
            found.append(("last resource commits", committed._replace(pc=done)))
        found.append(
            (
                "last resource refuses",
                refused._replace(pc=Pc(Step.ABORT, names=(*names, str(self.last)))),
            )
        )
        if state.outages_left:
            lost = Pc(Step.REPLY, outcome=None, settles=True)
            less = state.outages_left - 1
            if not fenced:
                found.append(
                    (
                        "last resource commits, answer lost",
                        committed._replace(pc=lost, outages_left=less),
                    )
                )
            found.append(
                (
                    "last resource lost before committing",
                    refused._replace(pc=lost, outages_left=less),
                )
            )
        return found

    def _end(self, state: State) -> Successors:
        if state.volatile and not self.eager_end:  # the EndLatch: END once they are on disk
            deferred = state._replace(
                deferred_end=True, pc=Pc(Step.REPLY, outcome=state.pc.outcome)
            )
            return [("END deferred until the lazy records are on disk", deferred)]
        if self.last:  # no decision-log END: the row goes (lazily; here at once, the worst case)
            return [
                (
                    "row deleted",
                    state._replace(
                        log=state.log._replace(row=Row.CLEANED),
                        pc=Pc(Step.REPLY, outcome=state.pc.outcome),
                    ),
                )
            ]
        log = state.log._replace(end=End.BUFFERED)
        return [
            ("append END", state._replace(log=log, pc=Pc(Step.REPLY, outcome=state.pc.outcome)))
        ]

    def _reply(self, state: State) -> Successors:
        told = told_of(state.pc.outcome)
        # OutcomeUnknownError also stops the live manager deciding: only a restart moves it on.
        stall = told is Told.UNKNOWN and not state.pc.settles
        pc = Pc(Step.STALLED) if stall else Pc(Step.REC_START)
        nxt = state._replace(parts=_sessions_closed(state.parts), told=told, pc=pc)
        return [(f"caller told {told.value}", nxt)]

    # -- crashes and restarts ------------------------------------------------------------------

    def _crash(self, state: State) -> Successors:
        step = state.pc.step
        if step is Step.QUIESCENT:
            return []
        free = step is Step.STALLED  # the operator restart the stall asks for
        if not (free or state.crashes_left):
            return []
        label = f"crash {self.site(state.pc)}"
        parts = state.parts  # a lazy commit record not on disk is lost: prepared again
        for i in state.volatile:
            parts = _set(parts, i, Part.PREPARED)
        nxt = state._replace(
            parts=_sessions_closed(parts),
            volatile=frozenset(),
            deferred_end=False,
            pc=Pc(Step.REC_START),
            crashes_left=state.crashes_left - (not free),
            recovery_crashes=state.recovery_crashes + (step in RECOVERY_STEPS),
        )
        if state.log.end is not End.BUFFERED:
            return [(label, nxt)]
        kept, lost = (nxt.log._replace(end=end) for end in (End.DURABLE, End.NONE))
        return [
            (f"{label}, END kept", nxt._replace(log=kept)),
            (f"{label}, END lost", nxt._replace(log=lost)),
        ]

    def _background_recovery(self, state: State) -> Successors:
        """A periodic pass of the live manager while this transaction is in flight.

        Step 1 skips an in-flight decision (recovery.py asks the guard itself); step 2 asks
        ``recovery_action`` with ``maybe_in_flight=True``. With the real rule this never moves;
        the model includes it so that a rule ignoring the guard has something to break.
        """
        if state.pc.step not in BACKGROUND_STEPS:
            return []
        parts = state.parts
        for i, part in enumerate(parts):
            if part is not Part.PREPARED:
                continue
            action = self.rules.recovery_action(
                ours=True, has_decision=self._decided(state.log), maybe_in_flight=True
            )
            if action is Action.ROLLBACK:
                parts = _set(parts, i, _rollback_call(part)[0])
        if parts == state.parts:
            return []
        log = state.log
        if self.last and log.row is Row.NONE:  # a pass that presumes abort fences first
            log = log._replace(row=Row.ABORT)
        return [("background recovery", state._replace(parts=parts, log=log))]

    def _decided(self, log: Log) -> bool:
        """Has the transaction a decision where recovery looks: the log, or the row."""
        return log.pending or log.row is Row.COMMIT

    # -- recovery (recovery.py) ----------------------------------------------------------------

    def _rec_start(self, state: State) -> Successors:
        if state.log.pending and state.log.commit:
            return [
                (
                    "recovery: re-drive COMMIT",
                    state._replace(pc=Pc(Step.REC_COMMIT, names=state.log.commit)),
                )
            ]
        return [("recovery: nothing to re-drive", state._replace(pc=Pc(Step.REC_ABORT)))]

    def _rec_commit(self, state: State) -> Successors:
        pc = state.pc
        name = pc.names[pc.at]
        i = self.position[name]
        found: Successors = []
        for reply in self._calls(state, i, _commit_call):
            if not reply.reached:  # all() stops at the first failure; END is not written
                nxt = Pc(Step.REC_ABORT, failed=True)
            elif pc.at + 1 == len(pc.names):
                nxt = Pc(Step.REC_END)
            else:
                nxt = pc._replace(at=pc.at + 1)
            after = self._after_call(state, i, reply, nxt)
            if reply.part is Part.COMMITTED:  # recovery's commit returns once it is on disk
                after = after._replace(volatile=after.volatile - {i})
            found.append((f"recovery commits {name}: {reply.label}", after))
        return found

    def _rec_end(self, state: State) -> Successors:
        log = state.log._replace(end=End.BUFFERED)
        return [("recovery appends END", state._replace(log=log, pc=Pc(Step.REC_ABORT)))]

    def _rec_lookup(self, state: State) -> Successors:
        """Ask the last resource's table (once per pass); the question fences a gtrid without a
        row. Unreachable, the pass knows nothing and presumes nothing."""
        row = Row.ABORT if state.log.row in (Row.NONE, Row.CLEANED) else state.log.row
        fenced = state._replace(log=state.log._replace(row=row))
        found = [("recovery reads the row", fenced._replace(pc=state.pc._replace(known=True)))]
        if state.outages_left:
            less, unknown = state.outages_left - 1, state.pc._replace(known=False)
            found.append(
                ("recovery: table unreachable", state._replace(pc=unknown, outages_left=less))
            )
            found.append(
                ("recovery: fenced, answer lost", fenced._replace(pc=unknown, outages_left=less))
            )
        return found

    def _rec_abort(self, state: State) -> Successors:
        pc = state.pc
        if (
            self.last
            and pc.known is None
            and Part.PREPARED in state.parts
            and not state.log.pending
        ):
            return self._rec_lookup(state)
        if self.last:
            return self._rec_abort_last(state)
        for i in range(pc.at, len(self.names)):
            if state.parts[i] is not Part.PREPARED:
                continue  # resource.recover() lists prepared branches only
            action = self.rules.recovery_action(
                ours=True, has_decision=state.log.pending, maybe_in_flight=False
            )
            if action is not Action.ROLLBACK:
                continue  # recovery.py acts on ROLLBACK only; a decision is step 1's business
            return [
                (
                    f"recovery rolls back {self.names[i]}: {r.label}",
                    self._after_call(
                        state, i, r, Pc(Step.REC_ABORT, i + 1, failed=pc.failed or not r.reached)
                    ),
                )
                for r in self._calls(state, i, _rollback_call)
            ]
        return self._rec_done(state, pc.failed)

    def _rec_done(self, state: State, failed: bool) -> Successors:
        if failed:
            return [("recovery pass failed: retry", state._replace(pc=Pc(Step.REC_START)))]
        return [("recovery pass clean", state._replace(pc=Pc(Step.QUIESCENT)))]

    def _rec_abort_last(self, state: State) -> Successors:
        """Step 2 with a last resource: commit from the row, roll back without one, or (the
        table unanswered) defer."""
        pc, failed = state.pc, state.pc.failed
        for i in range(pc.at, len(self.names)):
            if state.parts[i] is not Part.PREPARED and i not in state.volatile:
                continue  # recover() lists a lazily committed branch until it is on disk
            seen = state.log.row is Row.COMMIT and pc.known is True  # unread: not seen
            action = self.rules.recovery_action(
                ours=True,
                has_decision=state.log.pending or seen,
                maybe_in_flight=False,
                decision_known=pc.known is not False,
            )
            if action is Action.LEAVE_ALONE:
                failed = True  # deferred: retried next pass
                continue
            if action is Action.COMMIT and state.log.pending:
                continue  # a logged decision is step 1's business
            verb, call = (
                ("commits", _commit_call)
                if action is Action.COMMIT
                else ("rolls back", _rollback_call)
            )
            return [
                (
                    f"recovery {verb} {self.names[i]}: {r.label}",
                    self._flushed(
                        self._after_call(
                            state, i, r, pc._replace(at=i + 1, failed=failed or not r.reached)
                        ),
                        i,
                        r,
                    ),
                )
                for r in self._calls(state, i, call)
            ]
        return self._rec_done(state, failed)

    @staticmethod
    def _flushed(state: State, i: int, reply: _Reply) -> State:
        """Recovery's call on a lazily committed branch waits for its record (or, a rollback,
        finds it committed): either way it is on disk once the call returns."""
        if reply.reached and i in state.volatile:
            return state._replace(volatile=state.volatile - {i})
        return state


# -- invariants ----------------------------------------------------------------------------------


def atomic(parts: tuple[Part, ...]) -> bool:
    """TCommit's TCConsistent: no branch committed while another is rolled back."""
    return not (Part.COMMITTED in parts and Part.ROLLED_BACK in parts)


def decision_stable(state: State, last: bool = False) -> bool:
    """Every branch ended as the log decided, and as the caller was told."""
    parts, committed = state.parts, Part.COMMITTED in state.parts
    # a last resource's row is a decision (also once deleted); so is its commit alone (the
    # others read-only)
    decided = state.log.commit is not None or state.log.row in (Row.COMMIT, Row.CLEANED)
    if decided or (last and _alone_committed(state)):
        as_logged = all(p in (Part.COMMITTED, Part.READ_ONLY_DONE) for p in parts)
    else:
        as_logged = not committed
    if state.told is Told.COMMITTED:
        as_told = all(
            p is Part.COMMITTED
            for p, v in zip(parts, state.votes, strict=False)
            if v is Vote.COMMIT
        ) and not (last and parts[-1] is not Part.COMMITTED)
    elif state.told is Told.ROLLED_BACK:
        as_told = not committed
    else:
        as_told = True
    return as_logged and as_told


def _alone_committed(state: State) -> bool:
    """A last resource committed alone: every other branch voted read-only, no row written."""
    *others, last = state.parts
    return last is Part.COMMITTED and all(p is Part.READ_ONLY_DONE for p in others)


def no_in_doubt_residue(state: State) -> bool:
    """Nothing is left prepared (or open), and no COMMIT lacks its END."""
    unresolved = Part.PREPARED in state.parts or Part.ACTIVE in state.parts
    return not unresolved and not state.log.pending


def _visible(state: State) -> tuple[tuple[Part, ...], Log, Told]:
    return state.parts, state.log, state.told


def _trace(parents: Mapping[State, tuple[State | None, str]], state: State) -> str:
    labels: list[str] = []
    current: State | None = state
    while current is not None:
        parent, label = parents[current]
        labels.append(label)
        current = parent
    labels.reverse()
    lines = [f"  {n:2}. {label}" for n, label in enumerate(labels)]
    final = ", ".join(f"{name}={p.value}" for name, p in zip("abcdefgh", state.parts, strict=False))
    return "\n".join([*lines, f"  => {final}; log={state.log}; told={state.told.value}"])
