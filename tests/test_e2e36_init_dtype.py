"""``tilegraph train --init`` of a float16 Zarr checkpoint, and the sample after training.

A float16 Hugging Face folder converted to Zarr (quantized or not) trained in float16 under
``--init``, adapters included (``lora_u float16`` in the run's checkpoints), while ``--init`` of
the folder itself widened it to float32 and said so: the run now trains in float32 from either
(quantized Linear weights kept quantized, dequantized to float32 tiles), as from a float32
checkpoint of the same weights, with the same line on stderr. The Python API keeps the stored
dtype unless asked (``Checkpoint.new_model(dtype=...)``, ``peft.from_quantized(dtype=...)``).

A worker lost while ``tilegraph train`` drew its sample, after training and the final checkpoint,
made the command exit 2 with generate's advice to load the model again: a finished run read as
failed by a batch script. It is a warning line naming the checkpoint and ``tilegraph generate``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft

IDS = np.random.default_rng(0).integers(0, 257, (2, 9))
LORA = {"method": "lora", "rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["attn.q", "attn.v"]}


def _config():
    return dataclasses.replace(models.config("gpt2-debug"), vocab_size=257, max_seq_len=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A float16 Hugging Face folder, its Zarr checkpoints by ``tilegraph convert`` (float16,
    plain and int4) and float32 checkpoints of the same weights (widened first): name -> path."""
    from tilegraph.cli import main
    from tilegraph.io import save_checkpoint

    root = tmp_path_factory.mktemp("init_dtype")
    models.build(_config(), seed=0, dtype=np.float16).to_hf(root / "hf16")
    assert main(["convert", str(root / "hf16"), str(root / "q16")]) == 0
    assert main(["convert", str(root / "hf16"), str(root / "q"), "--quantize", "int4"]) == 0
    widened = models.from_hf(root / "hf16", dtype=np.float32)
    save_checkpoint(root / "ref16", widened)
    save_checkpoint(root / "ref", widened, quantize="int4")
    return {name: root / name for name in ("hf16", "q16", "q", "ref16", "ref")}


def _weights(model) -> dict[str, np.ndarray]:
    """Every parameter's value and every quantized weight's dequantized value, by name."""
    out = {n: v for n, v in model.state_dict().items()}
    for name, q in peft.named_quantized(model):
        out[name] = tg.compute(q.dequantized())[0]
    return out


def _float_dtypes(model) -> set:
    return ({np.dtype(p.dtype) for p in model.parameters()} | {q.dtype for _, q in peft.named_quantized(model)}
            | {np.dtype(model.dtype)})


# ---------------------------------------------------------------- --init widens to float32 ----
@pytest.mark.parametrize("method", ["none", "lora"])
@pytest.mark.parametrize("stored, ref", [("q16", "ref16"), ("q", "ref")])
def test_init_of_a_float16_checkpoint_trains_in_float32(checkpoints, stored, ref, method, capsys):
    """--init of a float16 Zarr checkpoint (plain, or quantized: kept quantized under adapters)
    loads float32, as a float32 checkpoint of the same weights does, with the HF folder's line."""
    from tilegraph.cli.finetune import add_adapters, init_model

    model, quantized = init_model(str(checkpoints[stored]), method)
    err = capsys.readouterr().err
    assert _float_dtypes(model) == {np.dtype(np.float32)}
    said = [x for x in err.splitlines() if "widened to float32" in x]
    assert len(said) == 1 and "float16" in said[0] and str(checkpoints[stored]) in said[0], err
    want, want_quantized = init_model(str(checkpoints[ref]), method)
    assert "widened" not in capsys.readouterr().err  # a float32 checkpoint: nothing to say
    assert quantized == want_quantized == (stored == "q" and method != "none")
    if quantized:  # the Linear weights stay quantized, their tiles dequantized to float32
        assert len(peft.named_quantized(model)) == 12
    if method != "none":
        add_adapters(model, LORA, seed=0)
        add_adapters(want, LORA, seed=0)
        assert peft.lora_layers(model) and all(
            layer.lora_u.dtype == np.float32 and layer.lora_v.dtype == np.float32
            for layer in peft.lora_layers(model).values())
    assert _float_dtypes(model) == {np.dtype(np.float32)}
    have, ref_weights = _weights(model), _weights(want)
    assert have.keys() == ref_weights.keys()
    for name in have:  # exactly: float16 widens to float32 without rounding
        assert have[name].dtype == np.float32 and np.array_equal(have[name], ref_weights[name]), name
    logits = tg.compute(model(IDS))[0]
    assert logits.dtype == np.float32 and np.array_equal(logits, tg.compute(want(IDS))[0])


def test_the_python_api_keeps_the_stored_dtype_unless_asked(checkpoints):
    from tilegraph.io import load_checkpoint

    assert np.dtype(models.from_zarr(checkpoints["q16"]).dtype) == np.float16
    assert np.dtype(load_checkpoint(checkpoints["q16"]).new_model(values=False).dtype) == np.float16
    base = peft.from_quantized(checkpoints["q"])
    assert _float_dtypes(base) == {np.dtype(np.float16)}
    wide = peft.from_quantized(checkpoints["q"], dtype="float32")
    assert _float_dtypes(wide) == {np.dtype(np.float32)}
    ref = peft.from_quantized(checkpoints["ref"])
    assert all(np.array_equal(a, b) for a, b in zip(_weights(wide).values(), _weights(ref).values()))
    with pytest.raises(tg.TileError, match="from_quantized"):
        peft.from_quantized(checkpoints["q"], dtype="int8")
    with pytest.raises(tg.TileError, match="new_model"):
        load_checkpoint(checkpoints["q16"]).new_model(dtype="complex64")


@pytest.mark.distributed
def test_a_float16_checkpoint_loads_float32_on_the_workers(checkpoints):
    """With a runtime the stored tiles are read on the workers: there too each cell gets a
    value of its own dtype (float32), quantized arrays dequantized straight to it."""
    from tilegraph.io import load_checkpoint

    from tilegraph._graph import ValueRef

    with tg.connect(n_workers=1, threads_per_worker=1, quiet=True) as rt:
        for stored, ref in (("q16", "ref16"), ("q", "ref")):
            ck = load_checkpoint(checkpoints[stored])
            model = ck.new_model(values=False, dtype=np.float32)
            ck.load_into(model)
            refs = [c.value for p in model.parameters() for c in p.cells.flat]
            assert refs and all(isinstance(r, ValueRef) for r in refs)  # read there, where they stay
            held = {rt.client.gather(r.future)[r.index].dtype for r in refs}  # as the workers hold them
            assert held == {np.dtype(np.float32)}, (stored, held)
            want = models.from_zarr(checkpoints[ref])
            for (name, a), (_, b) in zip(model.state_dict().items(), want.state_dict().items()):
                assert a.dtype == np.float32 and np.array_equal(a, b), (stored, name)
            assert np.array_equal(tg.compute(model(IDS))[0], tg.compute(want(IDS))[0]), stored
        wide = peft.from_quantized(checkpoints["q"], dtype=np.float32)
        assert np.array_equal(tg.compute(wide(IDS))[0], tg.compute(peft.from_quantized(checkpoints["ref"])(IDS))[0])


def _train(main, init: str, out: str) -> int:
    return main(["train", "--init", init, "--set", "peft.method=lora", "--set", 'data.sources=["text.txt"]',
                 "--set", "data.seq_len=32", "--set", "train.batch_size=2", "--set", "train.eval_every=0",
                 "--steps", "2", "--out", out, "--no-progress"])


@pytest.mark.distributed
def test_train_lora_on_a_float16_quantized_checkpoint_trains_and_saves_float32(checkpoints, tmp_path, capsys,
                                                                               monkeypatch):
    """The reproducer: `tilegraph train --init q --set peft.method=lora` of a float16 int4
    checkpoint wrote lora_u float16; now every float array of its checkpoints is float32 (the
    base's Linear weights still stored quantized), trained as from the float32 checkpoint."""
    from tilegraph.cli import main
    from tilegraph.io import load_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("def tile(graph): return graph  # some text to train on\n" * 200)
    assert _train(main, str(checkpoints["q"]), "r") == 0
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if "widened to float32" in x]
    assert len(said) == 1 and "float16" in said[0], err
    assert _train(main, str(checkpoints["ref"]), "ref") == 0
    assert "widened" not in capsys.readouterr().err
    ck, want = load_checkpoint("r/checkpoints/step-000002"), load_checkpoint("ref/checkpoints/step-000002")
    assert ck.info["model"]["dtype"] == "float32"
    assert {a["dtype"] for a in ck.arrays.values()} == {"float32"}, ck.arrays
    quantized = [n for n, a in ck.arrays.items() if a.get("quantized")]
    assert "model/blocks.0.attn.q.weight" in quantized and "model/blocks.0.attn.q.lora_u" not in quantized
    assert ck.arrays.keys() == want.arrays.keys()
    for name in ck.arrays:
        np.testing.assert_allclose(ck.array(name), want.array(name), rtol=1e-5, atol=1e-7, err_msg=name)


# ------------------------------------------------------- a worker lost during the sample ----
SMALL = """
[data]
max_mb = 0.05
seq_len = 16
[train]
batch_size = 2
warmup = 0
eval_every = 0
"""


@pytest.mark.distributed
@pytest.mark.parametrize("lost", [["tcp://127.0.0.1:39999"], []], ids=["worker", "tasks"])
def test_a_worker_lost_while_sampling_after_training_is_a_warning(tmp_path, capsys, monkeypatch, lost):
    """generate's WorkerLostError after the run and its final checkpoint were complete made
    `tilegraph train` exit 2 ("load the model again"); now one warning line, exit 0."""
    import importlib

    from tilegraph._health import WorkerHealth, lost_worker_error
    from tilegraph.cli import main

    generation = importlib.import_module("tilegraph.models.generate")

    def lose(model, *args, **kwargs):  # the error generate's watched gather raises for a lost worker
        raise lost_worker_error(WorkerHealth(lost=list(lost)), "the decoding on a worker", None,
                                where="tilegraph.models.generate", hint=generation._lost_hint(model, []))

    monkeypatch.setattr(generation, "generate", lose)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.toml").write_text(SMALL)
    assert main(["train", "small.toml", "--out", "run", "--steps", "2", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    last = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (last / "zarr.json").is_file()
    assert "load the model again" not in err and "error" not in err, err
    warned = [x for x in err.splitlines() if "warning" in x]
    assert len(warned) == 1, err
    assert "no sample" in warned[0] and "complete" in warned[0] and "tilegraph generate run/checkpoints/step-000002" \
        in warned[0], warned
    assert (lost[0] in warned[0]) if lost else ("lost" in warned[0])
    assert "checkpoint: run/checkpoints/step-000002" in out and "sample (" not in out, out  # the summary, as usual
