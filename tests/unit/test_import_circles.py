"""No module of a library package imports another that imports it back, directly or around a
circle (type-checking imports included): the layering check's sibling, run with the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_layering.py"


def _tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_layering", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("package", _tool().LAYERS)
def test_no_import_circles(package: str) -> None:
    assert _tool().cycles(package) == []


def test_no_layer_reaches_up() -> None:
    assert _tool().violations() == []
