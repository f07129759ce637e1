"""The examples in the docstrings run and print what they show (doctest), module by module under
their installed names (tilegraph.ops.*, tilegraph.models.*, tilegraph.io.*)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest


def _modules() -> list[str]:
    names = set()
    # ops/, models/ and io/ live beside tilegraph/ in the source tree: walk each package itself
    for pkg in ("tilegraph", "tilegraph.ops", "tilegraph.models", "tilegraph.io"):
        names.add(pkg)
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, f"{pkg}."):
            if info.name.split(".")[-1] not in ("cli", "__main__"):
                names.add(info.name)
    return sorted(names)


MODULES = _modules()


def test_the_subpackages_are_found():
    assert {"tilegraph.nn", "tilegraph.ops.matmul", "tilegraph.models.generate", "tilegraph.io.data"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {name}"
