"""A tied parameter (one Parameter under two attribute names, torch's lm_head.weight =
wte.weight) loads from a state dict that names it under either name or both, as torch's
state_dict writes it; one that names neither is missing."""

import numpy as np
import pytest

import tilegraph as tg


class _Tied(tg.nn.Module):
    def __init__(self):
        self.emb = tg.nn.Linear(4, 6, bias=False, seed=0, dtype=np.float64)
        self.head_weight = self.emb.weight

    def forward(self, x):
        return tg.matmul(self.emb(x), self.head_weight, trans_b=True)


def test_a_tied_parameter_loads_under_any_of_its_names():
    model = _Tied()
    assert list(model.state_dict()) == ["emb.weight"]
    new = np.arange(24.0).reshape(4, 6)
    for state in ({"emb.weight": new}, {"head_weight": new}, {"emb.weight": new, "head_weight": new}):
        model = _Tied()
        model.load_state_dict(state)  # the last two were 'unexpected: head_weight' / 'missing: emb.weight'
        np.testing.assert_array_equal(model.state_dict()["emb.weight"], new)
    with pytest.raises(tg.TileError, match=r"state does not match the model; received: missing: emb\.weight; "
                                           r"unexpected: other"):
        _Tied().load_state_dict({"other": new})
