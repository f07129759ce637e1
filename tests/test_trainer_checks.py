"""Bad arguments of Trainer and TrainStep are refused when they are built, naming the argument and
the value received; a checkpoint that does not fit leaves the model and the optimizer as they were."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import lm_ids, lm_loss, mse
from tilegraph import models
from tilegraph._tensor import tensor_from_cells
from tilegraph._train import COMPILE_OPTIONS


def _lm(seed=0):
    return models.build("gpt2-debug", seed=seed)


def _lm_data():
    ids = lm_ids(96, shape=(4, 9))
    return lambda step: (ids[:, :-1], ids[:, 1:])


def _values(model, optimizer) -> list[np.ndarray]:
    """Every parameter and every optimizer state tensor, computed."""
    state = [tensor_from_cells(p.tiling, p.dtype, grid) for p, grids in zip(optimizer.params, optimizer.state_cells)
             for grid in grids]
    return tg.compute(*model.parameters(), *state)


def _assert_unchanged(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    assert len(before) == len(after)
    for i, (b, a) in enumerate(zip(before, after)):
        np.testing.assert_array_equal(a, b, err_msg=f"value {i}")


def _sgd_trainer(seed=1):
    model = _lm(seed)
    opt = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, tg.Trainer(model, opt, _lm_data(), loss_fn=lm_loss, batch_size=4, progress=False)


# -- 1. a failed load changes nothing ---------------------------------------------------------------
def test_load_checkpoint_of_another_optimizer_changes_nothing(tmp_path):
    src = _lm(0)
    tg.io.save_checkpoint(tmp_path / "ck", src, tg.optim.AdamW(src.parameters()))
    model, opt, trainer = _sgd_trainer()
    trainer.fit(1)  # momentum state that a partial load would lose
    before = _values(model, opt)
    # (session 39: the error names the kind to make, was "optimizer state of a SGD; received: state of a AdamW")
    with pytest.raises(tg.io.CheckpointError, match=r"the checkpoint holds, AdamW: make a tg\.optim\.AdamW .*; "
                       r"received: the state of an AdamW for an SGD$"):
        trainer.load_checkpoint(tmp_path / "ck")
    _assert_unchanged(before, _values(model, opt))
    assert opt.step_count == 1 and trainer._last_checkpoint is None


def test_load_checkpoint_without_optimizer_state_changes_nothing(tmp_path):
    tg.io.save_checkpoint(tmp_path / "ck", _lm(0), step=5)
    model, opt, trainer = _sgd_trainer()
    before = _values(model, opt)
    with pytest.raises(tg.io.CheckpointError, match=r"a checkpoint with optimizer state; received: saved without"):
        trainer.load_checkpoint(tmp_path / "ck")
    _assert_unchanged(before, _values(model, opt))
    assert opt.step_count == 0


def test_load_checkpoint_with_a_corrupt_optimizer_chunk_changes_nothing(tmp_path):
    """Every tile is read before any is set: a chunk failing its checksum leaves the weights."""
    src = _lm(0)
    src_opt = tg.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    path = tg.io.save_checkpoint(tmp_path / "ck", src, src_opt, step=3)
    chunk = next((path / "optimizer" / "momentum_buffer" / "wte.weight").glob("c*"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    model, opt, trainer = _sgd_trainer()
    before = _values(model, opt)
    with pytest.raises(tg.io.CheckpointError, match=r"'optimizer/momentum_buffer/wte.weight': a chunk failed"):
        trainer.load_checkpoint(path)
    _assert_unchanged(before, _values(model, opt))


@pytest.mark.distributed
def test_a_failed_read_on_the_workers_changes_nothing(tmp_path, own_runtime):
    """On a cluster the tiles are read by the workers; one failing its checksum leaves the weights
    and the optimizer state the workers hold, and a good checkpoint then loads there. (A cluster
    of its own: the state it leaves on the workers would count against the tests that measure
    what the shared cluster's workers hold.)"""
    src = _lm(0)
    src_opt = tg.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    good = tg.io.save_checkpoint(tmp_path / "good", src, src_opt, step=3)
    bad = tg.io.save_checkpoint(tmp_path / "bad", src, src_opt, step=3)
    chunk = next((bad / "optimizer" / "momentum_buffer" / "wte.weight").glob("c*"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    model = _lm(1)
    opt = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = tg.Trainer(model, opt, _lm_data(), own_runtime, loss_fn=lm_loss, batch_size=4, progress=False)
    trainer.fit(1)  # parameters and state now live on the workers
    with own_runtime.as_current():
        before = _values(model, opt)
        with pytest.raises(tg.io.CheckpointError, match=r"'optimizer/momentum_buffer/wte.weight': a chunk failed"):
            trainer.load_checkpoint(bad)
        _assert_unchanged(before, _values(model, opt))
        assert opt.step_count == 1
        assert trainer.load_checkpoint(good) == 3 and opt.step_count == src_opt.step_count == 0
        _assert_unchanged(_values(src, src_opt), _values(model, opt))


def test_a_matching_checkpoint_still_loads(tmp_path):
    src = _lm(0)
    src_opt = tg.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    tg.Trainer(src, src_opt, _lm_data(), loss_fn=lm_loss, batch_size=4, progress=False).fit(2)
    path = tg.io.save_checkpoint(tmp_path / "ck", src, src_opt)
    model, opt, trainer = _sgd_trainer()
    assert trainer.load_checkpoint(path) == 2 and opt.step_count == 2
    _assert_unchanged(_values(src, src_opt), _values(model, opt))


# -- 2. restore_optimizer with another model's optimizer ------------------------------------------
def test_restore_optimizer_over_another_models_parameters_says_so(tmp_path):
    src = _lm(0)
    path = tg.io.save_checkpoint(tmp_path / "ck", src, tg.optim.AdamW(src.parameters()))
    model, other = _lm(1), _lm(2)
    opt = tg.optim.AdamW(other.parameters())
    with pytest.raises(tg.io.CheckpointError, match=r"every optimizer parameter must belong to the model; received: "
                                                    r"optimizer.params\[0\] \(.*\) is not among model.named_parameters"):
        tg.io.load_checkpoint(path).restore_optimizer(opt, model)


# -- 3. the data's vocabulary against the model's ----------------------------------------------------
@pytest.fixture
def byte_tokens(tmp_path):
    from tilegraph.io import ByteTokenizer, build_token_file

    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 100)
    build_token_file([tmp_path / "a.txt"], tmp_path / "t.bin", ByteTokenizer(eos=True))  # 257 ids
    return tmp_path / "t.bin"


def test_trainer_refuses_data_whose_ids_do_not_fit_the_model(byte_tokens):
    from tilegraph.io import TokenDataset

    data = TokenDataset(byte_tokens, 16, split="train", seed=0)
    model = _lm()  # vocab_size 96
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] data's token ids must fit the model.*received: "
                                           r"data.vocab_size=257 \(ids up to 256\), model config.vocab_size=96"):
        tg.Trainer(model, tg.optim.AdamW(model.parameters()), data, batch_size=2, progress=False)


def test_trainer_refuses_eval_data_whose_ids_do_not_fit_the_model(byte_tokens):
    import dataclasses

    from tilegraph.io import TokenDataset

    data = TokenDataset(byte_tokens, 16, split="train", seed=0)
    val = TokenDataset(byte_tokens, 16, split="val", seed=0)
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
    tg.Trainer(model, tg.optim.AdamW(model.parameters()), data, eval_data=val, batch_size=2, progress=False)  # fits
    val.vocab_size = 300  # as a dataset of a larger tokenizer
    with pytest.raises(tg.TileError, match=r"eval_data's token ids must fit the model.*received: "
                                           r"eval_data.vocab_size=300 \(ids up to 299\), model config.vocab_size=257"):
        tg.Trainer(model, tg.optim.AdamW(model.parameters()), data, eval_data=val, batch_size=2, progress=False)


# -- 4. TrainStep's arguments -----------------------------------------------------------------------
def _mlp(seed=0):
    return tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=seed)


@pytest.mark.parametrize("kw, message", [
    (dict(optimizer=None), r"optimizer must be a tilegraph.optim optimizer .*; received: optimizer=None"),
    (dict(runtime="tcp://x"), r"runtime must be None or a tilegraph Runtime .*; received: runtime='tcp://x'"),
    (dict(foo=1), rf"keyword arguments it forwards to compile are {', '.join(COMPILE_OPTIONS)}; received: foo=1"),
    (dict(state_groups=[]), r"keyword arguments it forwards to compile are .*; received: state_groups=\[\]"),
    (dict(placement="tpu"), r"placement must be one of 'auto', 'cpu', 'gpu' \(or None: tilegraph.config.placement\); "
                            r"received: 'tpu'"),
    (dict(accum_steps=0), r"accum_steps must be an integer >= 1; received: 0"),
    (dict(batch_tiles=8), r"batch_tiles must be None or a list of tilings.*; received: batch_tiles=8"),
    (dict(loss_fn="mse"), r"loss_fn must be callable.*; received: loss_fn='mse'"),
    (dict(model=[1]), r"model must be a tilegraph.nn.Module; received: list"),
])
def test_train_step_checks_its_arguments_when_built(kw, message):
    model = _mlp()
    args = dict(model=model, optimizer=tg.optim.SGD(model.parameters(), lr=0.1), loss_fn=mse)
    args.update(kw)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TrainStep\] " + message):
        tg.TrainStep(args.pop("model"), args.pop("optimizer"), args.pop("loss_fn"), **args)


def test_train_step_refuses_an_optimizer_of_another_model():
    model, other = _mlp(0), _mlp(1)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TrainStep\] every optimizer parameter must belong to the "
                                           r"model; received: optimizer.params\[0\] \(.*\) is not among"):
        tg.TrainStep(model, tg.optim.SGD(other.parameters(), lr=0.1), mse)


def test_train_step_checks_batch_tiles_against_the_batch():
    model = _mlp()
    step = tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.1), mse, batch_tiles=[(8, None)])
    x, y = np.ones((8, 8), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(tg.TileError, match=r"batch_tiles must hold one tiling per batch array \(2 here\); received: "
                                           r"batch_tiles=\[\(8, None\)\] for 2 arrays"):
        step(x, y)
    assert model.parameters()[0].numpy().shape == (8, 16)  # nothing ran


def test_eval_step_checks_runtime_and_compile_options():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.EvalStep\] runtime must be .*; received: runtime='tcp://x'"):
        tg.EvalStep(_mlp(), mse, runtime="tcp://x")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.EvalStep\] keyword arguments .*; received: fuse2=True"):
        tg.EvalStep(_mlp(), mse, fuse2=True)


# -- 5. Trainer's arguments -------------------------------------------------------------------------
def _data(step):
    x = np.random.default_rng(step).standard_normal((8, 8)).astype(np.float32)
    return x, np.zeros((8, 2), np.float32)


def _trainer(**kw):
    model = _mlp()
    opt = tg.optim.SGD(model.parameters(), lr=0.1)
    return tg.Trainer(model, opt, _data, **{"loss_fn": mse, "batch_size": 8, "progress": False, **kw})


#: (Trainer keyword arguments, what the error says after "[tilegraph.Trainer] "); "{tmp}": a folder
#: holding one file, "file"
TRAINER_CASES = {
    "accum_steps": (dict(accum_steps=0), r"accum_steps must be an integer >= 1; received: 0"),
    "log_dir file": (dict(log_dir="{tmp}/file"), r"log_dir must be a folder \(made when missing\); received: "
                                                 r"log_dir='{tmp}/file': an existing file"),
    "log_dir under a file": (dict(log_dir="{tmp}/file/run"), r"log_dir must be a folder .*; received: "
                                                             r"log_dir='{tmp}/file/run': {tmp}/file is a file"),
    "checkpoint_dir file": (dict(checkpoint_dir="{tmp}/file"), r"checkpoint_dir must be a folder .*; received: "
                                                               r"checkpoint_dir='{tmp}/file': an existing file"),
    "eval_data list": (dict(eval_data=[1, 2]), r"eval_data must be None or a callable eval_data\(batch\) -> tuple of "
                                               r"arrays, as data is; received: eval_data=\[1, 2\]"),
    "on_step item": (dict(on_step=[1]), r"on_step must be a list of callables hook\(trainer, ...\); received: "
                                        r"on_step\[0\]=1 \(int\)"),
    "on_step callable": (dict(on_step=print), r"on_step must be a list of callables .*; received: "
                                              r"on_step=<built-in function print>"),
    "on_checkpoint item": (dict(on_checkpoint=["x"]), r"on_checkpoint must be a list .*; received: "
                                                      r"on_checkpoint\[0\]='x' \(str\)"),
    "runtime": (dict(runtime="tcp://127.0.0.1:8786"), r"runtime must be None or a tilegraph Runtime .*; received: "
                                                      r"runtime='tcp://127.0.0.1:8786'"),
    "eval_every alone": (dict(eval_every=2), r"eval_every evaluates on eval_data: give an eval_data, or eval_every=0; "
                                             r"received: eval_every=2, eval_data=None"),
    "eval_every": (dict(eval_every=-1, eval_data=_data), r"eval_every must be an integer >= 0; received: -1"),
    "eval_batches": (dict(eval_batches=0, eval_data=_data), r"eval_batches must be an integer >= 1; received: 0"),
    "parallel": (dict(parallel="ddp"), r"parallel must be one of 'auto', 'tiles', 'data', 'sharded', 'zero3' .*; "
                                       r"received: 'ddp'"),
    "compile option": (dict(fuse_all=True), r"keyword arguments it forwards to compile are .*; "
                                            r"received: fuse_all=True"),
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_checks_its_arguments_when_built(tmp_path, case):
    (tmp_path / "file").write_text("x")
    kw, message = TRAINER_CASES[case]
    kw = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] " + message.replace("{tmp}", str(tmp_path))):
        _trainer(**kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made


def test_trainer_token_data_needs_token_eval_data(tmp_path):
    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    (tmp_path / "a.txt").write_text("abc\n" * 200)
    build_token_file([tmp_path / "a.txt"], tmp_path / "t.bin", ByteTokenizer())  # 256 ids
    data = TokenDataset(tmp_path / "t.bin", 8, split="train", seed=0)
    model = tg.nn.Embedding(256, 8, seed=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] eval_data must be None or a token dataset "
                                           r"\(eval_offsets, tensors\), as data is; received: eval_data=<function"):
        tg.Trainer(model, tg.optim.SGD(model.parameters(), lr=0.1), data, eval_data=_data, progress=False)


def test_trainer_with_good_arguments_still_trains(tmp_path):
    seen = []
    trainer = _trainer(eval_data=_data, eval_every=2, eval_batches=1, log_dir=tmp_path / "run",
                       on_step=(lambda t, s: seen.append(s.loss),))
    res = trainer.fit(2)
    assert res.steps == 2 and seen == res.losses and [s for s, _ in res.val_losses] == [2]
