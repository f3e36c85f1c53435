"""The README's promises, checked: its embedding example runs as written, and every
`graphidx...` / `capture...` name it quotes exists."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path
from types import ModuleType

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_MARKER = "# readme-example:"
FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# A dotted name rooted at one of the two packages, optionally quoted as a call `f(...)`.
API_NAME = re.compile(r"((?:graphidx|capture)(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?")
FROM_IMPORT = re.compile(r"^from ((?:graphidx|capture)[\w.]*) import ([\w, ]+)$", re.MULTILINE)


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _example() -> str:
    """The one python block that starts with the marker comment."""
    blocks = [
        body
        for lang, body in FENCED_BLOCK.findall(_readme())
        if lang == "python" and body.startswith(EXAMPLE_MARKER)
    ]
    assert len(blocks) == 1, f"expected one python block starting {EXAMPLE_MARKER!r}"
    return blocks[0]


def _quoted_api_names() -> list[str]:
    """Every inline-code span outside fenced blocks that is a graphidx / capture name, and
    every name a fenced python block imports from graphidx / capture."""
    text = _readme()
    names = set()
    for span in re.findall(r"`([^`\n]+)`", FENCED_BLOCK.sub("", text)):
        match = API_NAME.fullmatch(span.strip())
        if match:
            names.add(match.group(1))
    for lang, body in FENCED_BLOCK.findall(text):
        if lang != "python":
            continue
        for module, imported in FROM_IMPORT.findall(body):
            names.update(f"{module}.{name.strip()}" for name in imported.split(","))
    return sorted(names)


def _resolve(name: str) -> object:
    """Import the longest importable module prefix of `name`, then getattr the rest."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the module exists but one of its own imports is missing
            continue
        break
    else:
        raise AssertionError(f"{name}: no importable module prefix")
    for depth, attr in enumerate(parts[split:], start=split + 1):
        if not hasattr(obj, attr):
            raise AssertionError(f"{name}: {'.'.join(parts[: depth - 1])} has no {attr!r}")
        obj = getattr(obj, attr)
    return obj


def test_the_embedding_example_runs_on_the_cpu() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_example(), f"{README}:readme-example", "exec"), {"__name__": "readme"})
    lines = out.getvalue().splitlines()
    # Three decode steps of two requests x next_n 2, all replayed, two layers of top-64.
    assert lines == [f"{step} True (2, 4, 64)" for step in range(3)], lines


def test_the_readme_quotes_api_names() -> None:
    names = _quoted_api_names()
    # The parser must find the names the README is built around, or the next test is empty.
    expected_names = (
        "graphidx.runner.IndexerGraphRunner",  # a table row
        "graphidx.mxfp4.write_k_cache",  # prose
        "graphidx.integrations.sglang.SGLangIndexerHooks",  # an import in a fenced block
        "capture",
    )
    for expected in expected_names:
        assert expected in names, names


def test_a_missing_name_fails_to_resolve() -> None:
    # The README once listed this one; the function lives in graphidx.ops.schedule.
    with pytest.raises(AssertionError, match=r"graphidx\.ops has no 'build_decode_schedule'"):
        _resolve("graphidx.ops.build_decode_schedule")
    assert isinstance(_resolve("graphidx.mxfp4.layout"), ModuleType)


@pytest.mark.parametrize("name", _quoted_api_names())
def test_every_api_name_the_readme_quotes_exists(name: str) -> None:
    _resolve(name)
