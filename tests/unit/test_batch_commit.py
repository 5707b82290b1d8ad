"""Phase two through `coordinator.batch_commit`: branches sharing a batch key are committed by
one ``commit_batch`` call, in commit order, and every way a batch can fail ends as individual
commits failing would: what is not confirmed stays prepared for recovery, never guessed."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from coordinator import CompletionPending, HeuristicMixed, Outcome
from coordinator.batch_commit import Answer
from coordinator.resource import Resource
from coordinator.xid import Xid
from tests.support.file_resource import COMMITTED, PREPARED, FileResource, read_state
from tests.support.managers import make_manager
from tests.support.trace import traced


class Batching(FileResource):
    """A file resource whose commits travel in batches through ``answer`` (default: each
    resource's own commit)."""

    calls: list[list[str]] = []  # shared by the test's resources
    answer: Callable[[Sequence[tuple[Resource, Xid]]], list[Answer]] | None = None

    @property
    def batch_key(self) -> str:
        return "pool"

    def commit_batch(self, branches: Sequence[tuple[Resource, Xid]]) -> list[Answer]:
        Batching.calls.append([r.name for r, _ in branches])
        if Batching.answer is not None:
            return Batching.answer(branches)
        return [r.commit(x) for r, x in branches]


@pytest.fixture
def resources(tmp_path: Path) -> Iterator[tuple[Batching, FileResource, Batching]]:
    Batching.calls, Batching.answer = [], None
    yield (
        Batching("a", tmp_path / "a"),
        FileResource("b", tmp_path / "b"),
        Batching("c", tmp_path / "c"),
    )
    Batching.answer = None


def states(tmp_path: Path, gtrid: str) -> list[str]:
    return [read_state(tmp_path / n).outcome(gtrid) for n in "abc"]


def transfer(tm: object, resources: Sequence[FileResource]) -> tuple[str, Outcome]:
    tx = tm.begin()  # type: ignore[attr-defined]
    for r in resources:
        tx.join(r).set("k", 1)
    return tx.gtrid, tx.commit()


def test_branches_sharing_a_key_commit_in_one_batch_in_commit_order(
    resources: tuple[Batching, FileResource, Batching], tmp_path: Path, managers: list
) -> None:
    tm = make_manager(managers, list(resources))
    with traced() as seen:
        gtrid, outcome = transfer(tm, resources)
    assert outcome == Outcome.COMMITTED
    assert Batching.calls == [["a", "c"]]
    assert states(tmp_path, gtrid) == [COMMITTED] * 3
    after = seen[seen.index("tm.after_decision_fsync") :]
    assert [p for p in after if "after_commit" in p or "after_apply" in p] == [
        "fileres.a.after_apply",  # a's batch, which carries c: applied when a's turn comes
        "fileres.c.after_apply",
        "tm.after_commit.1",
        "fileres.b.after_apply",
        "tm.after_commit.2",
        "tm.after_commit.3",
    ]
    assert not tm.log.pending()


def test_a_lone_batch_committer_commits_alone(tmp_path: Path, managers: list) -> None:
    Batching.calls = []
    a, b = Batching("a", tmp_path / "a"), FileResource("b", tmp_path / "b")
    tm = make_manager(managers, [a, b], parallel=True)
    assert transfer(tm, [a, b])[1] == Outcome.COMMITTED
    assert Batching.calls == []


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda branches: 1 / 0, id="raises"),
        pytest.param(lambda branches: [None], id="too-few-answers"),
        pytest.param(lambda branches: [None, TimeoutError("lost")], id="one-lost"),
    ],
)
@pytest.mark.parametrize("parallel", [False, True])
def test_what_a_batch_does_not_confirm_is_left_to_recovery(
    resources: tuple[Batching, FileResource, Batching],
    tmp_path: Path,
    managers: list,
    answer: Callable[[Sequence[tuple[Resource, Xid]]], list[Answer]],
    parallel: bool,
) -> None:
    def partly(branches: Sequence[tuple[Resource, Xid]]) -> list[Answer]:
        got = answer(branches)  # may raise
        return [
            r.commit(x) if a is None else a for (r, x), a in zip(branches, got, strict=False)
        ] + got[2:]

    Batching.answer = partly
    tm = make_manager(managers, list(resources), parallel=parallel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gtrid, outcome = transfer(tm, resources)
    assert outcome == Outcome.COMMIT_PENDING
    assert any(issubclass(w.category, CompletionPending) for w in caught)
    left = states(tmp_path, gtrid)
    assert left[1] == COMMITTED and PREPARED in (left[0], left[2])
    assert [d.gtrid for d in tm.log.pending()] == [gtrid]
    report = tm.recover(force=True)
    assert report.committed == [gtrid] and not report.heuristics
    assert states(tmp_path, gtrid) == [COMMITTED] * 3


def test_a_heuristic_answer_is_that_branchs_outcome(
    resources: tuple[Batching, FileResource, Batching], managers: list
) -> None:
    def c_was_rolled_back(branches: Sequence[tuple[Resource, Xid]]) -> list[Answer]:
        (a, xa), (c, xc) = branches
        c.rollback(xc)
        return [a.commit(xa), Outcome.HEURISTIC_ROLLBACK]

    Batching.answer = c_was_rolled_back
    tm = make_manager(managers, list(resources))
    with pytest.raises(HeuristicMixed):
        transfer(tm, resources)
    [record] = tm.heuristics()
    assert (record.branch, record.outcome) == ("c", Outcome.HEURISTIC_ROLLBACK.value)
