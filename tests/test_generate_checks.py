"""generate's and Decoder's arguments and the model's values, checked on the client before any
decoding is submitted: parameters held by another runtime or by a closed one (Dask cancelled the
decoding task, "lost dependencies", which read as a lost worker), a cache_block that only
nn.KVCache checked (on a worker: a page of Dask's worker log, then an error naming
tilegraph.nn.KVCache), a closed runtime passed as runtime=, and a temperature that greedy
decoding would ignore."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph._errors import TileError
from tilegraph._graph import ValueRef
from tilegraph._train import WorkerLostError
from tilegraph.models import Decoder, generate, next_tokens

WHERE = "tilegraph.models.generate"
PROMPT = np.array([[1, 2, 3]])


def _one_worker():
    return tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)


def _on_workers(model, rt) -> None:
    """``model``'s parameters moved onto ``rt``'s workers (as training there leaves them)."""
    rt.scatter_cells([c for p in model.parameters() for c in p.cells.flat])
    assert all(isinstance(c.value, ValueRef) for p in model.parameters() for c in p.cells.flat)


@pytest.fixture(scope="module")
def expected():
    """The greedy tokens of the debug model decoded in this process."""
    return generate(models.build("gpt2-debug", seed=0), PROMPT, 3)


def test_parameters_on_another_open_runtime(embedded_runtime, expected):
    rt1 = _one_worker()
    try:
        model = models.build("gpt2-debug", seed=0)
        _on_workers(model, rt1)
        with embedded_runtime.as_current():   # another runtime is the current one
            with pytest.raises(TileError, match=r"run it inside `with rt\.as_current\(\):`.*held by another "
                                                r"runtime") as e:
                generate(model, PROMPT, 3)
            assert e.value.where == WHERE and not isinstance(e.value, WorkerLostError)
            with pytest.raises(TileError, match="held by another runtime") as e:
                Decoder(model)
            assert e.value.where == "tilegraph.models.Decoder"
            # the runtime holding them, named, decodes as this process does
            np.testing.assert_array_equal(generate(model, PROMPT, 3, runtime=rt1), expected)
        with rt1.as_current():
            np.testing.assert_array_equal(generate(model, PROMPT, 3), expected)
    finally:
        rt1.close()


def test_parameters_on_a_closed_runtime(embedded_runtime, monkeypatch):
    rt1 = _one_worker()
    model = models.build("gpt2-debug", seed=0)
    _on_workers(model, rt1)
    rt1.close()
    with embedded_runtime.as_current():
        with pytest.raises(TileError, match="held by a closed runtime") as e:
            generate(model, PROMPT, 3)
        assert e.value.where == WHERE and not isinstance(e.value, WorkerLostError)
    # no runtime at all: the same error, named as generate's (it was tilegraph.compute's)
    monkeypatch.setattr(tg.runtime, "_CURRENT", [])
    assert tg.current_runtime() is None
    with pytest.raises(TileError, match="held by a closed runtime") as e:
        generate(model, PROMPT, 3)
    assert e.value.where == WHERE


def test_closed_runtime_given_as_runtime():
    rt = _one_worker()
    rt.close()
    model = models.build("gpt2-debug", seed=0)
    for call, where in ((lambda: generate(model, PROMPT, 3, runtime=rt), WHERE),
                        (lambda: Decoder(model, runtime=rt), "tilegraph.models.Decoder")):
        with pytest.raises(TileError, match="an open runtime: this one was closed") as e:
            call()
        assert e.value.where == where


@pytest.mark.parametrize("block", [0, -3, 2.5, True, "64", None])
def test_cache_block_checked_on_the_client(embedded_runtime, block):
    model = models.build("gpt2-debug", seed=0)
    with embedded_runtime.as_current():   # CPU workers: the loop would run as one task on a worker
        with pytest.raises(TileError, match=r"cache_block must be an int >= 1") as e:
            generate(model, PROMPT, 3, cache_block=block)
    assert e.value.where == WHERE
    assert e.value.received == f"cache_block={block!r}"
    with pytest.raises(TileError, match=r"cache_block must be an int >= 1") as e:
        Decoder(model, cache_block=block)
    assert e.value.where == "tilegraph.models.Decoder"


def test_cache_block_accepted(embedded_runtime, expected):
    model = models.build("gpt2-debug", seed=0)
    with embedded_runtime.as_current():
        np.testing.assert_array_equal(generate(model, PROMPT, 3, cache_block=np.int64(2)), expected)


@pytest.mark.parametrize("temperature", [0.5, 2, np.float32(0.7)])
def test_greedy_refuses_a_temperature(temperature):
    model = models.build("gpt2-debug", seed=0)
    msg = r"greedy decoding takes no temperature other than the default 1 .*strategy='sample', 'top_k' or 'top_p'"
    with pytest.raises(TileError, match=msg) as e:
        generate(model, PROMPT, 3, temperature=temperature)
    assert e.value.where == WHERE and e.value.received == f"temperature={temperature!r}"
    with pytest.raises(TileError, match=msg) as e:
        next_tokens(np.array([[0.0, 1.0]]), np.random.default_rng(0), temperature=temperature)
    assert e.value.where == "tilegraph.models.generate.next_tokens"
    # as top_k is refused with greedy decoding
    with pytest.raises(TileError, match="greedy decoding takes no top_k or top_p"):
        generate(model, PROMPT, 3, top_k=5)


def test_greedy_takes_the_default_temperature(expected):
    model = models.build("gpt2-debug", seed=0)
    for t in (1, 1.0, np.float64(1.0)):
        np.testing.assert_array_equal(generate(model, PROMPT, 3, temperature=t), expected)
    # a bad temperature is still named as such, not as greedy's
    with pytest.raises(TileError, match="temperature must be a positive finite number"):
        generate(model, PROMPT, 3, temperature=-1.0)
    # sampling takes one
    assert generate(model, PROMPT, 3, strategy="sample", temperature=0.5, seed=1).shape == (1, 6)
