"""The models package reads as models and sampling: the execution plumbing that decoding needs
(lending a model's values to the workers, one task on a worker with the model pickled by
reference, futures of its own for the values a step left there) lives in the core,
``tilegraph._remote`` (STYLE.md: "Private execution internals used from models/generate.py:
give decoding a home in the core"). Before, models/generate.py imported ValueRef, Fetching,
gather, lend_cells and put_back and submitted Dask tasks itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[1] / "models"

#: what the models may import from the engine's private modules: the graph executable (what
#: tilegraph.compile returns), to_host (a tile's NumPy array), the IR's types and no_grad
ALLOWED = {
    "tilegraph._lower": {"Executable"},
    "tilegraph._graph": {"to_host"},
}
#: private modules the models import nothing from
FORBIDDEN = {"tilegraph._train", "tilegraph.exec", "tilegraph.exec.program", "tilegraph.plan"}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, {a.name for a in node.names}, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, set(), node.lineno


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.py")), ids=lambda p: p.name)
def test_models_use_no_execution_internals(path):
    bad = []
    for module, names, line in _imports(path):
        if module in FORBIDDEN or any(module.startswith(f + ".") for f in FORBIDDEN):
            bad.append(f"{path.name}:{line} imports {module}")
        elif module in ALLOWED and not names <= ALLOWED[module]:
            bad.append(f"{path.name}:{line} imports {sorted(names - ALLOWED[module])} from {module}")
    text = path.read_text()
    for word in ("client.submit", "ValueRef", "cloudpickle"):
        if word in text:
            bad.append(f"{path.name} uses {word}")
    assert not bad, bad


def test_the_remote_helpers_are_in_the_core():
    from tilegraph import _remote

    for name in _remote.__all__:
        assert getattr(_remote, name).__module__ in ("tilegraph._remote", "tilegraph._train"), name
