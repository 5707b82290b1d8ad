"""Routes (issue 15, point 2): which cursor a log sends each destination to.

Invariant named here: ``one_cursor_per_stream`` (every stream, persistent or not, has exactly one
cursor: the first matching route's, else the default), and bad routes are clear one-line
configuration errors.
"""

from __future__ import annotations

import pytest

from coordinator.errors import ConfigurationError
from messaging.routes import Route, Router, parse_route

A, B, DEFAULT = ("10.0.0.1", 7402), ("10.0.0.2", 7402), ("127.0.0.1", 7402)


def test_a_route_parses_pattern_and_cursor() -> None:
    assert parse_route("orders.*=10.0.0.1:7402") == Route("orders.*", A)
    assert parse_route(" topic:prices = 10.0.0.2:7402 ") == Route("topic:prices", B)


@pytest.mark.parametrize(
    "text",
    ["orders.*", "=10.0.0.1:7402", "orders.*=", "orders.*=host", "orders.*=h:99999",
     "orders.*=10.0.0.1:7402,", "orders.*=10.0.0.1:7402,10.0.0.1:7402"],
)  # fmt: skip
def test_a_bad_route_is_a_configuration_error(text: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_route(text)
    assert "\n" not in str(caught.value)


def test_the_first_matching_route_wins_else_the_default() -> None:
    router = Router(DEFAULT, [Route("orders.paid", B), Route("orders.*", A)])
    assert router.cursor_for("orders.paid") == B
    assert router.cursor_for("orders.created") == A
    assert router.cursor_for("invoices") == DEFAULT
    assert router.cursor_for("Orders.created") == DEFAULT  # case-sensitive
    assert router.cursors() == [DEFAULT, B, A]


def test_a_non_persistent_stream_follows_its_destination() -> None:
    router = Router(DEFAULT, [Route("orders.*", A)])
    assert router.cursor_for("orders.created#np") == A
    assert router.cursor_for("invoices#np") == DEFAULT


def test_a_route_to_the_default_cursor_adds_no_second_transfer() -> None:
    assert Router(DEFAULT, [Route("x", DEFAULT), Route("y", A)]).cursors() == [DEFAULT, A]
