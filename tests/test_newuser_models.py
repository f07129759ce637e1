"""A new user's tries with tilegraph.models: flavors, tilings, recompute, HF folders, generation,
tokenizers. Each test names the defect it pins (a raw traceback, or a wrong value taken silently)."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import BPETokenizer, ByteTokenizer
from tilegraph.models import Decoder, ModelTiling, generate


@pytest.fixture(scope="module")
def gpt2():
    return models.build("gpt2-debug", seed=0)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text("def f(x):\n    return x + 1\n" * 50, encoding="utf-8")
    return BPETokenizer.train([folder], 300)


# ------------------------------------------------------------------------------------- models ----
@pytest.mark.parametrize("value", ["yes", 1, None, "False"])
def test_recompute_non_bool_is_refused_not_taken_silently(gpt2, value):
    """model.recompute = "yes" (or 1, None) was kept as given; "False" even turned recompute on."""
    model = models.build("llama-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"recompute must be True or False; received: "):
        model.recompute = value
    assert model.recompute is False
    with pytest.raises(tg.TileError, match="recompute must be True or False"):
        models.build("gpt2-debug", recompute=value)
    model.recompute = np.bool_(True)
    assert model.recompute is True


@pytest.mark.parametrize("kwargs, message", [
    ({"config": "gpt2-debug"}, "config must be a model config"),        # AttributeError: head_dim
    ({"seq": "8"}, "seq must be a positive int or None; received: '8'"),  # TypeError in a comparison
    ({"batch": 0}, "batch must be a positive int or None; received: 0"),  # taken as no batch at all
    ({"seq": -3}, "seq must be a positive int or None; received: -3"),
])
def test_tiling_default_bad_arguments_raise_tile_error(kwargs, message):
    """ModelTiling.default("gpt2-debug") raised AttributeError, seq="8" TypeError; batch=0 passed."""
    kwargs = {"config": models.FLAVORS["gpt2-debug"], **kwargs}
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.ModelTiling.default\] " + message):
        ModelTiling.default(**kwargs)
    assert ModelTiling.default(models.FLAVORS["gpt2"], batch=8, seq=1024) == ModelTiling(vocab=7180, batch=2)


def test_model_tiling_checks_its_sizes_when_made():
    """ModelTiling(seq="4").tile_ids(ids) raised a raw TypeError: the sizes were only checked by a model."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.ModelTiling\] seq tile must be a positive int"):
        ModelTiling(seq="4")
    with pytest.raises(tg.TileError, match="batch tile must be a positive int or None; received: 0"):
        ModelTiling(batch=0)
    assert ModelTiling(batch=np.int64(2)).tile_ids(np.zeros((3, 5), np.int64)).chunks[0] == (2, 1)


# ---------------------------------------------------------------------------------- generation ----
def test_generate_and_decoder_refuse_a_runtime_that_is_not_one(gpt2):
    """generate(..., runtime="x") and Decoder(model, runtime=...) raised AttributeError (scatter_cells)."""
    prompt = np.array([[1, 2, 3]])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.generate\] runtime must be a tilegraph Runtime"):
        generate(gpt2, prompt, 2, runtime="tcp://127.0.0.1:8786")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.Decoder\] runtime must be a tilegraph Runtime"):
        Decoder(gpt2, runtime=object())


def test_decoder_close_lets_the_next_feed_take_another_batch(gpt2):
    """After close() the cache was empty but the Decoder still held the first batch size: feeding 2
    rows was refused with "every chunk must hold the batch of the first one (1 rows)"."""
    dec = Decoder(gpt2)
    first = dec.feed(np.array([[1, 2, 3]]))
    dec.close()
    both = dec.feed(np.array([[1, 2, 3], [4, 5, 6]]))
    assert both.shape == (2, gpt2.config.vocab_size) and dec.length == 3
    np.testing.assert_allclose(both[:1], first, rtol=1e-5, atol=1e-6)
    dec.close()


# --------------------------------------------------------------------------------- HF folders ----
def test_to_hf_overwrite_must_be_a_bool_and_keeps_the_folder(gpt2, tmp_path):
    """model.to_hf(path, overwrite="no") took the true str as True and replaced the folder there."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(tg.TileError, match=r"to_hf\(.*\)\] overwrite must be True or False; received: 'no'"):
        gpt2.to_hf(out, overwrite="no")
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("value", ["1MB", 1.5, 0, True])
def test_to_hf_bad_max_shard_bytes_names_to_hf_and_writes_nothing(gpt2, tmp_path, value):
    """max_shard_bytes="1MB" raised a raw TypeError; 0 a TileError naming the temporary folder
    (".out.1a2b3c4d.tmp") instead of to_hf."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.GPT2.to_hf\(.*out\)\] max_shard_bytes must be a "
                       "positive int"):
        gpt2.to_hf(tmp_path / "out", max_shard_bytes=value)
    assert list(tmp_path.iterdir()) == []


def test_from_hf_of_the_safetensors_file_says_to_give_the_folder(gpt2, tmp_path):
    """from_hf("folder/model.safetensors") said "config.json must be a JSON object ... Not a directory"."""
    gpt2.to_hf(tmp_path / "hf")
    with pytest.raises(tg.TileError, match=r"must be a Hugging Face model folder .*not a file.*its folder: "):
        models.from_hf(tmp_path / "hf" / "model.safetensors")
    assert models.from_hf(tmp_path / "hf").config == gpt2.config


# --------------------------------------------------------------------------------- tokenizers ----
@pytest.mark.parametrize("eos", ["no", 1, None])
def test_byte_tokenizer_eos_must_be_a_bool(eos):
    """ByteTokenizer(eos="no") made a 257-id tokenizer with an end-of-text token, silently."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.io.ByteTokenizer\] eos must be True or False"):
        ByteTokenizer(eos=eos)
    assert ByteTokenizer(eos=True).vocab_size == 257


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab_size": "300"}, "vocab_size must be an int; received: '300'"),      # TypeError
    ({"vocab_size": 300.0}, "vocab_size must be an int; received: 300.0"),      # TypeError
    ({"min_frequency": -1}, "min_frequency must be an int >= 0; received: -1"),  # OverflowError
    ({"eos": 5}, "eos must be the end-of-text token's text"),                   # TypeError
    ({"eos": ""}, "eos must be the end-of-text token's text"),                  # an empty special token
])
def test_bpe_train_bad_arguments_raise_tile_error(tmp_path, kwargs, message):
    """BPETokenizer.train met these with raw TypeError/OverflowError from the library (or took eos="")."""
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text("abc abd abe\n" * 20)
    kwargs = {"vocab_size": 300, **kwargs}
    with pytest.raises(tg.TileError, match=r"\[tilegraph.io.BPETokenizer.train\] " + message):
        BPETokenizer.train([tmp_path], **kwargs)


def test_bpe_decode_ids_outside_the_vocabulary(bpe):
    """decode([-1]) raised OverflowError; decode([100000]) returned "" (the id dropped silently)."""
    for ids in ([-1], [70, 100000], [bpe.vocab_size]):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.io.BPETokenizer.decode\] token ids must lie in "
                           rf"\[0, {bpe.vocab_size}\)"):
            bpe.decode(ids)
    assert bpe.decode(bpe.encode("def g(y):")) == "def g(y):"


def test_bpe_encode_batch_of_one_str_is_refused(bpe):
    """encode_batch("abc") encoded each character as its own text, silently."""
    with pytest.raises(tg.TileError, match=r"encode_batch\] texts must be a list of texts"):
        bpe.encode_batch("def f")
    assert [a.tolist() for a in bpe.encode_batch(["def f"])] == [bpe.encode("def f").tolist()]


def test_bpe_tokenizer_from_a_path_or_with_a_non_str_eos(bpe, tmp_path):
    """BPETokenizer("bpe.json") raised AttributeError (token_to_id); load(path, eos=5) a TypeError."""
    bpe.save(tmp_path / "bpe.json")
    with pytest.raises(tg.TileError, match=r"tokenizer must be a tokenizers.Tokenizer .*BPETokenizer.load"):
        BPETokenizer(str(tmp_path / "bpe.json"))
    with pytest.raises(tg.TileError, match="eos must be the end-of-text token's text"):
        BPETokenizer.load(tmp_path / "bpe.json", eos=5)
    assert BPETokenizer.load(tmp_path / "bpe.json").eos_id == bpe.eos_id


def test_a_model_larger_than_the_memory_left_is_refused_before_any_weight_is_drawn(monkeypatch):
    import types

    import psutil

    from tilegraph import models, nn

    cfg = models.GPT2Config.flavor("debug")
    need = models.build(cfg).num_parameters() * 4   # fits: built
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=need // 2))
    with pytest.raises(tg.TileError, match=r"tilegraph\.models\.build\] a model whose weights fit this process's "
                                           r"memory .*GPT2Config\(dim=32, n_layers=2, .*: [\d,]+ parameters"):
        models.build(cfg)
    with nn.deferred_init():   # no weights drawn: no check, as from_hf and from_zarr build
        assert models.build(cfg).num_parameters() == need // 4
