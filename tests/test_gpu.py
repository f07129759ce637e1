"""CuPy kernels on a real GPU worker (marked gpu: skipped on machines without CUDA and CuPy), and
the GPU versions of the kernels on GPU workers emulated with NumPy (everywhere)."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph._errors import TileError
from tilegraph._graph import check_on_device, emit1, kernel, topo_order

pytestmark = pytest.mark.distributed


def _model_graph(rng):
    x = tg.from_numpy(rng.standard_normal((4, 64, 96)).astype(np.float32), (2, 32, 48))
    w = tg.from_numpy((rng.standard_normal((96, 96)) / 10).astype(np.float32), (48, 48))
    b = tg.from_numpy(np.zeros(96, np.float32), (48,))
    g = tg.from_numpy(np.ones(96, np.float32), (48,))
    h = tg.layer_norm(tg.gelu(tg.matmul(x, w, bias=b), approximate="tanh"), (96,), g, b)
    q = tg.transpose(tg.reshape(h, (4, 64, 8, 12)), 1, 2)
    a = tg.scaled_dot_product_attention(q, q, q, is_causal=True)
    loss = (a * a).mean() + tg.softmax(h, -1).sum() * 1e-3
    return loss, tg.grad(loss, [x, w, b])


@pytest.mark.gpu
def test_cupy_kernels_match_numpy_on_a_gpu_worker():
    rng = np.random.default_rng(0)
    loss, grads = _model_graph(rng)
    want = tg.compute(loss, *grads)  # NumPy on the local scheduler
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True) as rt:
        exe = tg.compile([loss, *grads], placement="gpu")
        assert {c.device for c in exe.clusters} == {"gpu"}
        got = tg.compute(loss, *grads, placement="gpu")
        assert rt.processors()["gpu"] == 1
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


def _gpt2_steps(steps, runtime=None, placement=None):
    """GPT-2 debug trained a few steps with AdamW and clipping; losses, grad norms and weights."""
    from tilegraph import models

    cfg = models.GPT2Config.flavor("debug")
    model = models.build(cfg, models.ModelTiling(batch=2, seq=16, feature=None, vocab=48), seed=0)
    # eps 1e-6: an update of a gradient near float noise stays far below the tolerance below
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-6, clip_grad_norm=0.5)
    step = tg.TrainStep(model, opt, lambda m, ids, t: tg.cross_entropy(m(ids), t), batch_tiles=[(2, 16), (2, 16)],
                        runtime=runtime, **({"placement": placement} if placement else {}))
    rng = np.random.default_rng(0)
    losses, norms = [], []
    for _ in range(steps):
        ids = rng.integers(0, cfg.vocab_size, size=(4, 32))
        tgt = np.roll(ids, -1, axis=1)
        tgt[:, -1] = -100
        losses.append(step(ids, tgt))
        norms.append(step.last.grad_norm)
    with (runtime.as_current() if runtime else __import__("contextlib").nullcontext()):
        return losses, norms, model.state_dict()


@pytest.mark.parametrize("array_module", [pytest.param("cupy", marks=pytest.mark.gpu), "numpy"])
def test_training_steps_on_a_gpu_worker_match_the_cpu(array_module, monkeypatch):
    # the GPU kernels (attention in whole tiles, the fused AdamW update, the clipping norm left on
    # the device) against the CPU's, three steps of a model with every op of GPT-2; "numpy" runs
    # the same GPU versions of the kernels on NumPy arrays (without the fused CuPy kernels)
    monkeypatch.setattr(tg.config, "gpu_array_module", array_module)
    want = _gpt2_steps(3)
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True) as rt:
        got = _gpt2_steps(3, rt, placement="gpu")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4)
    for k, v in want[2].items():
        np.testing.assert_allclose(got[2][k], v, rtol=1e-3, atol=1e-4, err_msg=k)


@pytest.mark.parametrize("array_module", [pytest.param("cupy", marks=pytest.mark.gpu), "numpy"])
def test_decoding_on_a_gpu_worker_replays_its_step_and_matches_the_cpu(array_module, monkeypatch):
    # one-position steps run again with the position in a tile (read back from the device by the
    # kernels that use it), and sdpa_at's GPU version cuts the keys after the position
    from tilegraph.models import Decoder

    monkeypatch.setattr(tg.config, "gpu_array_module", array_module)
    model = models.build("llama-debug", seed=0)
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 12))
    chunks = [seq[:, :5]] + [seq[:, t:t + 1] for t in range(5, 12)]
    with Decoder(model, cache_block=4) as dec:
        want = np.stack([dec.feed(c) for c in chunks])
    monkeypatch.setattr(tg.config, "placement", "gpu")
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True) as rt, \
            Decoder(model, runtime=rt, cache_block=4) as dec:
        got = np.stack([dec.feed(c) for c in chunks])
        assert dec.replayed == 3   # positions 7, 8 and 11 (tiles [5, 9) and [9, 13))
        assert {n.device for n in topo_order(dec.last_executable.roots) if not n.is_leaf} == {"gpu"}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_cuda_kernels_match_their_array_code(dtype):
    """The CUDA row kernels (layer/RMS norm forward and backward, the attention forward's masked
    softmax), the fused attention passes and the column sums against the array code they replace, run on the same
    CuPy arrays: rows shorter and longer than a block, every mask mode, rows with no visible key,
    -inf and NaN scores; and no kernel fell back to its array code (a build failure would)."""
    import warnings

    import cupy

    from tilegraph.ops import _gpu, attention as at, norm as nm

    rng = np.random.default_rng(0)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)

    def arr(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(dtype))

    def close(got, want):
        got, want = (got,) if not isinstance(got, tuple) else got, (want,) if not isinstance(want, tuple) else want
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
            np.testing.assert_allclose(cupy.asnumpy(g), cupy.asnumpy(w), **tol)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback warns
        for n in (96, 1000):
            x, g, w, b = arr(3, 5, n), arr(3, 5, n), arr(n), arr(n)
            for center in (True, False):
                for has_w, has_b in ((True, True), (True, False), (False, False)):
                    wb = [a for a, on in ((w, has_w), (b, has_b)) if on]
                    kw = dict(center=center, has_w=has_w, has_b=has_b)
                    fwd = nm._norm_fwd_cuda(x, *wb, eps=1e-5, **kw)
                    close(fwd, nm._norm_fwd_xp(x, *wb, eps=1e-5, **kw))
                    stats = list(fwd[1:])
                    for frozen in (False, True):  # a frozen weight and bias: dx alone
                        bkw = dict(center=center, has_w=has_w, grad_w=has_w and not frozen, grad_b=has_b and not frozen)
                        close(nm._norm_bwd_cuda(x, g, *stats, *wb[:int(has_w)], **bkw),
                              nm._norm_bwd_xp(x, g, *stats, *wb[:int(has_w)], **bkw))
        for rows, cols in ((7, 300), (16, 40)):
            s = arr(4, rows, cols)
            s[0, 1, 3] = np.nan
            s[1, 2, :] = -np.inf
            half = cols // 2
            for later in (None, at._later(cupy, (cols - rows - 2,), (rows,), (0, half), (half, cols - half), False),
                          at._later(cupy, (0,), (rows,), (3,), (cols,), False)):   # 3 rows before every key
                got, want = s.copy(), s.copy()
                close(at._softmax_rows_cuda(got, later), at._softmax_rows_generic(want, later))
                close(got, want)
            lse = arr(4, rows)
            lse[0, 0] = np.inf
            for later, lse_b in ((None, lse[:, :, None]),
                                 (at._later(cupy, (30,), (rows,), (0,), (cols,), False), lse[:, :, None]),
                                 (at._later(cupy, (0,), (rows,), (3,), (cols,), True), arr(4, 1, cols))):
                mask = at._mask_args(cupy, later)
                got, want = s.copy(), s.copy()
                at._exp_shifted(lse_b, *mask, got)
                at._exp_shifted_generic(lse_b, *mask, want)
                close(got, want)
                ds = arr(4, rows, cols)
                close(at._ds_of(lse_b, got, ds.copy()), at._ds_generic(lse_b, got, ds.copy()))
        x = arr(3, 5, 96)
        for axes in ((0, 1), (0,), (1,), (0, 1, 2)):   # a product with ones over leading axes; else CuPy's sum
            close(_gpu.sum_keepdims(x, axes), x.sum(axis=axes, keepdims=True))
    assert not _gpu._BROKEN


@pytest.mark.gpu
def test_gpu_attention_kernels_in_causal_row_blocks_match_numpy(monkeypatch):
    """The attention kernels' GPU versions on CuPy (fused passes, causal row blocks of 4 rows
    against the keys each sees, two key tiles) against the same code on NumPy (array code)."""
    import cupy

    from tilegraph.ops import attention as at

    monkeypatch.setattr(at, "_GPU_CAUSAL_ROWS", 4)
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((2, 4, 13, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 2, 13, 8)) for _ in range(2))
    spans = ((0, 6), (6, 7))                  # two key tiles
    attn = dict(n_k=2, n_h=1, heads=(0, 0, 1, 1), q_off=0, k_offs=(0, 6), causal=True, scale=0.35)

    def run(xp):
        a = [xp.asarray(x) for x in (q, do, k, v)]
        kv = [a[2][:, :, o:o + n] for o, n in spans] + [a[3][:, :, o:o + n] for o, n in spans]
        out, lse = at._sdpa_fwd_gpu(a[0], *kv, **attn)
        delta = (a[1] * out).sum(axis=-1)
        dq = at._sdpa_dq_gpu(a[0], a[1], lse, delta, *kv, **attn)
        dkv = [at._sdpa_dkv_gpu(kv[j], kv[2 + j], a[0], a[1], lse, delta, n_i=1, n_p=1, h_lo=0, h_hi=4, groups=2,
                                q_offs=(0,), k_off=o, causal=True, scale=0.35) for j, (o, _) in enumerate(spans)]
        return [out, lse, dq] + [g for pair in dkv for g in pair]

    for got, want in zip(run(cupy), run(np)):
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-10, atol=1e-12)


# -- checks of device values, read once per task ---------------------------------------------------
def _check_cost(in_shapes, out_shapes, itemsize, params):
    from tilegraph._graph import Cost

    return Cost(1e3, 1e3)


@kernel("test_check_later", cost=_check_cost)
def _check_later(x, *, fail, path, label):
    check_on_device(np.asarray(fail), lambda: TileError("test_check_later", "a value out of range", label))
    with open(path, "a") as f:  # what ran, in order, before the task ended
        f.write(label + "\n")
    return x + 1.0


def test_device_checks_are_read_once_when_the_task_ends_and_the_first_failure_names_its_kernel(tmp_path, monkeypatch):
    """On a GPU worker, a kernel's check of a device value (the token ids in range, say) is read
    with the task's others once all its kernels are queued: no wait for the GPU in the middle of
    a step. The task then fails with the first failed check's error, naming its kernel; on the
    CPU (and outside a task) a check is read at once."""
    from tilegraph.ops._common import new_tensor

    path = tmp_path / "ran.txt"
    x = tg.from_numpy(np.zeros((1, 4), np.float32))

    def chain(fails):
        y = x
        for i, fail in enumerate(fails):
            y = new_tensor(y.tiling, y.dtype, lambda idx, y=y, i=i, fail=fail: emit1(
                _check_later, [y.grid[idx]], y.grid[idx].shape, y.dtype, op=f"check{i}", fail=fail, path=str(path),
                label=f"kernel {i}"))
        return y

    monkeypatch.setattr(tg.config, "gpu_array_module", "numpy")  # GPU workers emulated with NumPy
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True):
        exe = tg.compile([chain([False] * 3)], placement="gpu")
        assert exe.n_tasks == 1 and {c.device for c in exe.clusters} == {"gpu"}
        np.testing.assert_array_equal(tg.compute(chain([False] * 3), placement="gpu")[0], np.full((1, 4), 3.0))
        path.write_text("")
        with pytest.raises(TileError, match=r"a value out of range; received: kernel 1") as info:
            tg.compute(chain([False, True, True]), placement="gpu")
        assert path.read_text().split("\n")[:3] == ["kernel 0", "kernel 1", "kernel 2"]  # all ran first
        assert any("in tile kernel 'test_check_later' of op 'check1'" in n for n in info.value.__notes__)
    path.write_text("")  # the local scheduler's CPU kernels: at once, the next kernel never runs
    with pytest.raises(TileError, match=r"received: kernel 1"):
        tg.compute(chain([False, True, True]))
    assert path.read_text().split("\n")[:2] == ["kernel 0", ""]


def test_check_on_device_outside_a_task_reads_at_once_and_inside_defers():
    from tilegraph._graph import deferred_device_checks, raise_failed_checks

    def err(what):
        return lambda: ValueError(what)

    with pytest.raises(ValueError, match="now"):
        check_on_device(np.asarray(True), err("now"))
    pending = []
    with deferred_device_checks(pending):
        check_on_device(np.asarray(False), err("first"))
        check_on_device(np.asarray(True), err("second"))
        check_on_device(np.asarray(True), err("third"))
    assert len(pending) == 3
    with pytest.raises(ValueError, match="second"):
        raise_failed_checks(pending)
    raise_failed_checks(pending[:1])  # none failed: nothing raised
    raise_failed_checks([])


@pytest.mark.gpu
def test_a_token_id_out_of_range_on_a_gpu_worker_is_a_clear_error():
    # the embedding's check of the ids is read on the device, with the step's other checks
    cfg = models.GPT2Config.flavor("debug")
    model = models.build(cfg, models.ModelTiling(batch=2, seq=16, feature=None, vocab=48), seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    ids = np.zeros((4, 32), np.int64)
    ids[1, 3] = cfg.vocab_size + 5
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True) as rt:
        step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, 16), (2, 16)],
                            runtime=rt, placement="gpu")
        with pytest.raises(TileError, match=rf"ids must lie in \[0, {cfg.vocab_size}\).*{cfg.vocab_size + 5}"):
            step(ids, np.zeros_like(ids))
