"""What a PyTorch user's everyday code does with tensors, tried as such a user would (session 20's
audit): numbers out of one-element tensors, truth values, torch tensors in, bfloat16, integer
parameters, micro-batch shapes in errors, and which operand an error names."""

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")


def test_a_one_element_tensor_converts_to_numbers_and_formats():
    s = tg.from_numpy(np.arange(4.0), tiles=3).sum()
    assert float(s) == 6.0 and int(s) == 6 and f"{s:.2f}" == "6.00"
    assert f"{s}" == repr(s)  # without a format spec nothing is computed
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.__float__\] only a tensor of one element .*"
                       r"received: a tensor of shape \(3,\)"):
        float(tg.from_numpy(np.ones(3)))


def test_truth_values_and_len_of_a_scalar_are_clear_errors():
    s = tg.from_numpy(np.ones(3)).sum()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.__bool__\] a TileTensor is symbolic .*x.item\(\)"):
        if s:
            pass
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d TileTensor"):
        len(s)
    assert len(tg.from_numpy(np.ones((3, 2)))) == 3


def test_torch_tensors_are_taken_as_their_values():
    t = torch.arange(6.0, requires_grad=True).reshape(2, 3) * 2
    x = tg.from_numpy(t, tiles=(1, 2))
    assert x.dtype == np.float32 and x.chunks == ((1, 1), (2, 1))
    np.testing.assert_array_equal(x.numpy(), t.detach().numpy())
    assert tg.from_numpy(torch.arange(3)).dtype == np.int64
    with pytest.raises(tg.TileError, match=r"\[tilegraph.from_numpy\] bfloat16 is not supported .*t.float\(\)"):
        tg.from_numpy(torch.ones(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16"], ids=str)
def test_bfloat16_is_named_as_unsupported_not_as_a_device(dtype):
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.to\] bfloat16 is not supported") as info:
        tg.from_numpy(np.ones(3)).to(dtype)
    assert "device" not in str(info.value)


def test_integer_parameters_cannot_require_gradients():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Parameter\(w\)\] only floating-point parameters can "
                       r"require gradients .*received: dtype int64"):
        tg.nn.Parameter(np.arange(8), name="w")
    p = tg.nn.Parameter(np.arange(8), name="w", requires_grad=False)  # a buffer of ids: fine
    assert p.dtype == np.int64 and not p.requires_grad


def test_a_micro_batch_shape_in_an_error_says_it_is_one():
    # (a row tile of the full batch, larger than a micro-batch's rows, was the example here: it
    # is one tile of the micro-batch's rows now, tests/test_e2e37_loop.py)
    lin = tg.nn.Linear(8, 2, dtype=np.float64, seed=0)
    step = tg.TrainStep(lin, tg.optim.SGD(lin.parameters(), lr=0.1), lambda m, x, y: (m(x) - y) ** 2,
                        accum_steps=2, batch_tiles=[(16, None), (16, None)])
    with pytest.raises(tg.TileError, match=r"a micro-batch: 1/2 of the batch, accum_steps=2.*loss_fn must return a "
                       r"scalar TileTensor; received: TileTensor\(shape=\(8, 2\)"):
        step(np.zeros((16, 8)), np.zeros((16, 2)))


def test_the_left_operand_is_named_a():
    x = tg.from_numpy(np.ones(3))
    for make in (lambda: np.ones(3) + x, lambda: np.ones(3) * x):
        with pytest.raises(tg.TileError, match=r"\] a must be a TileTensor or a real number .*tg.from_numpy"):
            make()
    with pytest.raises(tg.TileError, match=r"\] b must be a TileTensor"):
        x + np.ones(3)


@pytest.mark.parametrize("mode", ["single", "even", "ragged"])
def test_matmul_with_a_vector_as_torch(mode):
    from conftest import check_against_torch

    rng = np.random.default_rng(0)
    m, v, w = rng.standard_normal((5, 7)), rng.standard_normal(7), rng.standard_normal(5)
    check_against_torch(lambda a, b: a @ b, lambda a, b: a @ b, [m, v], "ak,k", mode)
    check_against_torch(lambda a, b: a @ b, lambda a, b: a @ b, [w, m], "a,ak", mode)
    check_against_torch(lambda a, b: a @ b, lambda a, b: a @ b, [v, v], "k,k", mode)
    check_against_torch(lambda a, b: a @ b, lambda a, b: a @ b, [rng.standard_normal((2, 5, 7)), v], "bak,k", mode)


def test_modules_list_their_children_and_freeze_as_torch():
    class Net(tg.nn.Module):
        def __init__(self):
            self.body = tg.nn.Sequential(tg.nn.Linear(4, 8, seed=0), tg.nn.ReLU(), tg.nn.Linear(8, 2, seed=1))
            self.heads = [tg.nn.LayerNorm((2,)), tg.nn.RMSNorm([2])]
            self.ids = tg.nn.Parameter(np.arange(3), name="ids", requires_grad=False)

    net = Net()
    names = [n for n, _ in net.named_modules()]
    assert names == ["", "body", "body.0", "body.1", "body.2", "heads.0", "heads.1"]
    assert [type(c).__name__ for c in net.children()] == ["Sequential", "LayerNorm", "RMSNorm"]
    assert [n for n, _ in net.body.named_children()] == ["0", "1", "2"]
    text = repr(net)
    assert text.startswith("Net(ids=(3,)\n  (body): Sequential(\n    (0): Linear(weight=(4, 8), bias=(8,))") and \
        "(heads.1): RMSNorm(weight=(2,))" in text
    assert net.requires_grad_(False) is net and not any(p.requires_grad for p in net.parameters())
    net.requires_grad_()
    assert [p.requires_grad for p in net.parameters()].count(False) == 1  # the integer buffer stays frozen
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.LayerNorm\] a normalized_shape of one dim"):
        tg.nn.LayerNorm((2, 3))


def test_argmax_clone_contiguous_and_tolist_as_torch():
    a = np.random.default_rng(0).standard_normal((4, 6))
    x = tg.from_numpy(a, tiles=(3, 4))
    t = torch.tensor(a)
    for dim in (0, 1, -1):
        assert x.argmax(dim).numpy().tolist() == t.argmax(dim).tolist()
        assert x.argmin(dim, keepdim=True).numpy().tolist() == t.argmin(dim, keepdim=True).tolist()
    assert x[1].argmax().item() == int(t[1].argmax())
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.argmax\] a dim .*shape \(4, 6\), dim=None"):
        x.argmax()
    assert x.clone() is x and x.contiguous() is x
    assert x.tolist() == a.tolist() and x.sum().tolist() == pytest.approx(a.sum())
