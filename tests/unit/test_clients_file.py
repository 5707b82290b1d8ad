"""The clients file (`messaging.clients`) and the per-request checks (`messaging.authz`), without
a server: what a file may say, the one-line errors for what it may not, and the glob cache.

Invariants named here: ``file_checked`` (a typo, a missing key, a name mapped to two clients is a
`ConfigurationError` naming the file and the client, never a half-loaded table) and
``grants_enforced`` (globs and node ids decide, case-sensitively; refusals are counted).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.errors import ConfigurationError
from coordinator.xid import Xid
from messaging.auth import (
    AuthError,
    SharedSecret,
    answer_hello,
    check_auth,
    check_welcome,
    new_hello,
)
from messaging.authz import Authoriser, UnauthorisedError
from messaging.clients import GLOB_CACHE_SIZE, Globs, load_clients

GOOD = """
[clients.app]
secret_file = "app.secret"
produce = ["orders.*", "topic:prices"]
consume = ["orders.created"]
nodes = ["app-1", "batch-*"]

[clients.tls-only]
certificate = ["app.internal", "spiffe://example/app"]
transfer = true
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "clients.toml"
    path.write_text(text)
    (tmp_path / "app.secret").write_bytes(b"a secret of at least 16 bytes\n")
    return path


def test_file_checked_a_good_file_loads(tmp_path: Path) -> None:
    table = load_clients(write(tmp_path, GOOD))
    app = table.clients["app"]
    assert app.secret is not None and "a secret of" not in repr(app)  # secrets never print
    assert app.produce.allows("orders.created") and app.produce.allows("topic:prices")
    assert not app.produce.allows("Orders.created")  # case-sensitive, as routes are
    assert app.nodes.allows("batch-7") and not app.nodes.allows("other")
    assert table.client_for_certificate(["nope", "app.internal"]) is table.clients["tls-only"]
    assert table.client_for_certificate(["nope"]) is None
    assert table.clients["tls-only"].secret is None and table.clients["tls-only"].transfer


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('[clients.a]\nsecret = "0123456789abcdef"\nprodcue = ["x"]\n', "unknown key 'prodcue'"),
        ("[clients.a]\nproduce = []\n", "needs a secret"),
        ('[clients.a]\nsecret = "short"\n', "at least 16 bytes"),
        ('[clients.a]\nsecret = "0123456789abcdef"\nsecret_file = "x"\n', "not both"),
        ('[clients.a]\nsecret_file = "missing"\n', "cannot read its secret_file"),
        ('[clients.a]\nsecret = "0123456789abcdef"\nnodes = "n1"\n', "'nodes' must be a list"),
        ('[clients.a]\nsecret = "0123456789abcdef"\ntransfer = "yes"\n', "true or false"),
        ('[clients.a]\ncertificate = ["x"]\n[clients.b]\ncertificate = ["x"]\n', "maps to both"),
        ("[server]\nport = 1\n", "unknown top-level key 'server'"),
        ("[clients.a\n", "clients file"),
    ],
)
def test_file_checked_mistakes_are_one_line_errors(
    tmp_path: Path, text: str, complaint: str
) -> None:
    with pytest.raises(ConfigurationError, match="clients file") as caught:
        load_clients(write(tmp_path, text))
    assert complaint in caught.value.message
    assert "\n" not in caught.value.message.strip()


def test_file_checked_json_works_too(tmp_path: Path) -> None:
    path = tmp_path / "clients.json"
    path.write_text('{"clients": {"a": {"secret": "0123456789abcdef", "nodes": ["n"]}}}')
    assert load_clients(path).clients["a"].nodes.allows("n")


def test_grants_enforced_refusals_are_counted(tmp_path: Path) -> None:
    authoriser = Authoriser(write(tmp_path, GOOD), watch_interval=0)
    app = authoriser.client("app")
    authoriser.check_produce(app, "orders.created")
    authoriser.check_node(app, Xid.branch_of("app-1:abc-1", "mlog"))
    with pytest.raises(UnauthorisedError, match=r"may not produce to 'billing\.x'"):
        authoriser.check_produce(app, "billing.x")
    with pytest.raises(UnauthorisedError, match="may not act for node 'other'"):
        authoriser.check_node(app, Xid.branch_of("other:abc-1", "mlog"))
    with pytest.raises(UnauthorisedError, match="not in the server's clients file"):
        authoriser.client("ghost")
    mine, theirs = Xid.branch_of("app-1:a-1", "mlog"), Xid.branch_of("other:a-1", "mlog")
    assert authoriser.visible(app, [mine, theirs]) == [mine]
    assert authoriser.key_for("ghost") is None
    stats = authoriser.stats
    assert (stats["denied"], stats["denied_produce"], stats["denied_node"]) == (4, 1, 1)
    assert (stats["denied_revoked"], stats["denied_unknown_client"]) == (1, 1)
    assert stats["recover_hidden"] == 1


def test_the_glob_cache_answers_the_same_and_stays_bounded() -> None:
    globs = Globs(["orders.*", "a?c"])
    for _ in range(2):
        assert globs.allows("orders.x") and globs.allows("abc") and not globs.allows("abcd")
    for n in range(GLOB_CACHE_SIZE + 10):
        globs.allows(f"d{n}")
    assert len(globs._cache) <= GLOB_CACHE_SIZE
    assert not Globs([]).allows("anything")


def test_a_changed_file_is_noticed_and_a_bad_one_keeps_the_old(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    authoriser = Authoriser(path, watch_interval=0)
    assert authoriser.reload_if_changed() is False  # unchanged: not even read
    path.write_text(GOOD.replace('"app-1"', '"app-2"') + "\n")
    assert authoriser.reload_if_changed() is True
    assert authoriser.client("app").nodes.allows("app-2")
    path.write_text("not = [toml")
    assert authoriser.reload_if_changed() is False
    assert authoriser.client("app").nodes.allows("app-2")  # the old table stays
    assert authoriser.stats["reload_failures"] == 1 and authoriser.stats["reloads"] == 1


def test_the_handshake_checks_each_client_with_its_own_key(tmp_path: Path) -> None:
    """mutual_auth per client: the pure handshake with an `Authoriser` as its keys."""
    authoriser = Authoriser(write(tmp_path, GOOD), watch_interval=0)
    own = SharedSecret(b"a secret of at least 16 bytes")
    hello = new_hello("log-1")
    _, auth = answer_hello(own, hello, "app", "producer", None)
    _, welcome = check_auth(authoriser, hello, auth, {"producer"})
    assert check_welcome(own, hello, auth, welcome).id == "log-1"  # the server proved it too
    _, wrong = answer_hello(own, hello, "tls-only", "producer", None)  # no secret of its own
    with pytest.raises(AuthError, match="has no key here"):
        check_auth(authoriser, hello, wrong, {"producer"})
    _, stranger = answer_hello(SharedSecret(b"x" * 16), hello, "app", "producer", None)
    with pytest.raises(AuthError, match="does not hold the secret"):
        check_auth(authoriser, hello, stranger, {"producer"})
    assert authoriser.stats["denied_unknown_client"] == 1
