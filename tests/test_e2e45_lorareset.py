"""LoRALinear as the other layers: a seed from the tg.nn.defaults block, and reset_parameters.

Before: ``LoRALinear(base, rank)`` inside ``tg.nn.defaults(seed=0)`` drew a fresh U every run (it
ignored the block), and an adapter could not be started again but by building a new layer."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import nn, peft
from tilegraph._errors import TileError


def _base(seed=0, tile=3):
    return nn.Linear(7, 5, tile=tile, seed=seed)


def test_a_defaults_block_seeds_the_adapter_as_it_seeds_layers():
    def build():
        with nn.defaults(seed=4):
            return nn.LoRALinear(_base(), rank=2)

    a, b = build(), build()
    np.testing.assert_array_equal(a.lora_u.numpy(), b.lora_u.numpy())
    assert a.dropout_seed == b.dropout_seed
    # the block's generator is one stream: a second adapter in the same block draws other values
    with nn.defaults(seed=4):
        first, second = nn.LoRALinear(_base(), rank=2), nn.LoRALinear(_base(), rank=2)
    assert not np.array_equal(first.lora_u.numpy(), second.lora_u.numpy())
    # outside a block, no seed: fresh draws, as an unseeded Linear's
    assert not np.array_equal(nn.LoRALinear(_base(), rank=2).lora_u.numpy(),
                              nn.LoRALinear(_base(), rank=2).lora_u.numpy())
    # a seed given wins over the block's
    with nn.defaults(seed=4):
        given = nn.LoRALinear(_base(), rank=2, seed=9)
    np.testing.assert_array_equal(given.lora_u.numpy(), nn.LoRALinear(_base(), rank=2, seed=9).lora_u.numpy())


def test_reset_parameters_starts_the_adapter_again_on_its_tiles():
    base = _base()
    layer = nn.LoRALinear(base, rank=2, alpha=4, seed=1)
    w0 = base.weight.numpy().copy()
    x = tg.from_numpy(np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32), (2, 3))
    # move it away from its base, as training would
    layer.lora_v.assign(np.ones(layer.lora_v.shape, layer.lora_v.dtype))
    layer.lora_u.assign(np.full(layer.lora_u.shape, 0.5, layer.lora_u.dtype))
    assert not np.allclose(layer(x).numpy(), base(x).numpy())
    chunks = (layer.lora_u.chunks, layer.lora_v.chunks)

    layer.reset_parameters(seed=1)
    fresh = nn.LoRALinear(_base(), rank=2, alpha=4, seed=1)
    np.testing.assert_array_equal(layer.lora_u.numpy(), fresh.lora_u.numpy())
    np.testing.assert_array_equal(layer.lora_v.numpy(), np.zeros((2, 5)))
    assert layer.dropout_seed == fresh.dropout_seed
    assert (layer.lora_u.chunks, layer.lora_v.chunks) == chunks
    assert layer.lora_u.dtype == layer.lora_v.dtype == base.weight.dtype
    np.testing.assert_allclose(layer(x).numpy(), base(x).numpy(), rtol=1e-6, atol=1e-6)  # equal to its base again
    np.testing.assert_array_equal(base.weight.numpy(), w0)  # the base is not touched
    assert not base.weight.requires_grad

    with nn.defaults(seed=5):
        layer.reset_parameters()
    with nn.defaults(seed=5):
        again = nn.LoRALinear(_base(), rank=2, alpha=4)
    np.testing.assert_array_equal(layer.lora_u.numpy(), again.lora_u.numpy())


def test_reset_parameters_reaches_every_adapter_of_a_model_through_apply():
    model = peft.apply_lora(tg.models.build("gpt2-debug", seed=0), targets=["attn.q", "attn.v"], rank=2, seed=0)
    layers = [m for m in model.modules() if isinstance(m, nn.LoRALinear)]
    assert layers
    for m in layers:
        m.lora_v.assign(np.ones(m.lora_v.shape, m.lora_v.dtype))
    model.apply(lambda m: m.reset_parameters(seed=0) if isinstance(m, nn.LoRALinear) else None)
    assert all(not np.any(m.lora_v.numpy()) for m in layers)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_a_bad_seed_is_refused_naming_the_method(seed):
    layer = nn.LoRALinear(_base(), rank=2, seed=0)
    u = layer.lora_u.numpy().copy()
    with pytest.raises(TileError) as e:
        layer.reset_parameters(seed=seed)
    assert "tilegraph.nn.LoRALinear.reset_parameters" in str(e.value) and repr(seed) in str(e.value)
    np.testing.assert_array_equal(layer.lora_u.numpy(), u)  # nothing changed
