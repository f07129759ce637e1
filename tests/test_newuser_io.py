"""What a new user of tilegraph.io and tilegraph.models runs into: checkpoints, token files,
tokenizers and Hugging Face export given odd but legal input, or the wrong kind of argument."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph._errors import TileError
from tilegraph.io import (BPETokenizer, ByteTokenizer, CheckpointError, CheckpointManager, TokenDataset,
                          build_token_file, is_checkpoint, load_checkpoint, save_checkpoint, save_file)


@pytest.fixture(scope="module")
def model():
    return models.build("gpt2-debug", seed=0)


@pytest.fixture
def token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20, encoding="utf-8")
    out = tmp_path / "a.tok"
    build_token_file([tmp_path / "a.txt"], out, ByteTokenizer(eos=True))
    return out


@pytest.fixture
def bpe(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 40 + "héllo wörld\n" * 10,
                                          encoding="utf-8")
    return BPETokenizer.train([tmp_path / "c"], vocab_size=300)


# ------------------------------------------------------------------------------ checkpoints ----
def test_manager_orders_checkpoints_by_step_past_six_digits(tmp_path, model):
    # "step-1000000" sorts before "step-999999" by name: the newest was pruned as the oldest
    mgr = CheckpointManager(tmp_path / "ck", keep=1, async_save=False)
    mgr.save(999_999, model)
    mgr.save(1_000_000, model)
    assert mgr.latest() == tmp_path / "ck" / "step-1000000"
    assert [p.name for p in mgr.checkpoints()] == ["step-1000000"]
    assert load_checkpoint(mgr.latest()).step == 1_000_000


@pytest.mark.parametrize("step", ["x", 1.7, -5, True])
def test_save_checkpoint_step_must_be_a_non_negative_int(tmp_path, model, step):
    with pytest.raises(CheckpointError, match=r"step must be an int >= 0.*received: " + repr(repr(step))[1:-1]):
        save_checkpoint(tmp_path / "ck", model, step=step)
    assert not (tmp_path / "ck").exists()
    mgr = CheckpointManager(tmp_path / "m", async_save=False)
    with pytest.raises(CheckpointError, match="step must be an int >= 0"):
        mgr.save(step, model)  # a negative step named the folder "step--00005"
    assert not (tmp_path / "m").exists() or not any((tmp_path / "m").iterdir())


@pytest.mark.parametrize("kw, what", [({"metadata": [1, 2]}, "metadata"), ({"metadata": "note"}, "metadata"),
                                      ({"trainer_state": [("a", 1)]}, "trainer_state"),
                                      ({"files": ["tok.json"]}, "files")])
def test_save_checkpoint_metadata_and_files_must_be_dicts(tmp_path, model, kw, what):
    with pytest.raises(CheckpointError, match=f"{what} must be a dict"):
        save_checkpoint(tmp_path / "ck", model, **kw)
    assert not (tmp_path / "ck").exists()


def test_save_checkpoint_quantize_dict_names_must_exist(tmp_path, model):
    # a misspelt parameter name left that weight exact without a word
    with pytest.raises(CheckpointError, match=r"quantize names parameters the model does not have.*'blocks.0.mlp.fc1'"):
        save_checkpoint(tmp_path / "ck", model, quantize={"blocks.0.mlp.fc1": "int8",
                                                          "blocks.0.mlp.fc1.weight": "int8"})
    assert not (tmp_path / "ck").exists()
    save_checkpoint(tmp_path / "ok", model, quantize={"blocks.0.mlp.fc1.weight": "int8"})
    assert load_checkpoint(tmp_path / "ok").arrays["model/blocks.0.mlp.fc1.weight"]["quantized"]["method"] == "int8"


def test_paths_with_a_tilde_mean_the_home_folder(tmp_path, monkeypatch, model):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    save_checkpoint("~/ck", model, step=2)
    assert is_checkpoint(home / "ck") and not (work / "~").exists()  # not a folder named "~" here
    assert load_checkpoint("~/ck").step == 2 and is_checkpoint("~/ck")
    assert CheckpointManager("~/ck-dir").dir == home / "ck-dir"
    (home / "a.txt").write_text("hello world " * 10, encoding="utf-8")
    build_token_file("~/a.txt", "~/a.tok")
    assert TokenDataset("~/a.tok", 8).path == (home / "a.tok").resolve()
    model.to_hf("~/hf")
    assert (home / "hf" / "config.json").is_file()
    assert models.from_hf("~/hf").config == model.config


def test_empty_and_non_path_arguments_are_refused(tmp_path, model):
    with pytest.raises(CheckpointError, match=r"a path .*received: ''"):
        save_checkpoint("", model)  # was Path("") == ".": "the folder . exists"
    assert is_checkpoint(None) is False  # was a TypeError from pathlib


# ------------------------------------------------------------------------------- hf export ----
@pytest.mark.parametrize("target", [".", ""])
def test_to_hf_into_the_working_folder_is_refused(tmp_path, monkeypatch, model, target):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TileError, match="to_hf"):  # was ValueError: PosixPath('.') has an empty name
        model.to_hf(target)
    assert list(tmp_path.iterdir()) == []


def test_files_written_onto_a_folder_are_refused(tmp_path, bpe):
    (tmp_path / "d").mkdir()
    for save in (bpe.save, lambda p: save_file({"x": np.zeros(2, np.float32)}, p)):
        for target in (tmp_path / "d", "."):  # was IsADirectoryError / ValueError
            with pytest.raises(TileError, match="the path of a file to write, not a folder"):
                save(target)
    assert list((tmp_path / "d").iterdir()) == []


# ------------------------------------------------------------------------------ tokenizers ----
def test_bpe_round_trip_keeps_text_that_spells_the_end_of_text_token(bpe):
    text = "split on <|endoftext|> here"
    ids = bpe.encode(text)
    assert bpe.eos_id not in ids.tolist()  # not a document boundary inside the text
    assert bpe.decode(ids) == text
    assert [e.tolist() for e in bpe.encode_batch([text])] == [ids.tolist()]
    # a real end-of-text id is still dropped when decoding
    assert bpe.decode(np.append(ids, bpe.eos_id)) == text


def test_bpe_eos_that_the_vocabulary_lacks_is_refused(tmp_path, bpe):
    bpe.save(tmp_path / "bpe.json")
    with pytest.raises(TileError, match=r"end-of-text token eos must be in the tokenizer's vocabulary.*'</s>'"):
        BPETokenizer.load(tmp_path / "bpe.json", eos="</s>")
    assert BPETokenizer.load(tmp_path / "bpe.json", eos=None).eos_id is None


# ------------------------------------------------------------------------------ token files ----
@pytest.mark.parametrize("tok, shown", [(ByteTokenizer, "the class ByteTokenizer"), ("byte", "str 'byte'")])
def test_build_token_file_needs_a_tokenizer_object(tmp_path, tok, shown):
    (tmp_path / "a.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(TileError, match=f"tokenizer must be a tokenizer object.*received: {shown}"):
        build_token_file([tmp_path / "a.txt"], tmp_path / "a.tok", tok)  # was AttributeError
    assert not (tmp_path / "a.tok").exists()


@pytest.mark.parametrize("kw, what", [({"seq_len": 8.5}, "seq_len"), ({"seq_len": None}, "seq_len"),
                                      ({"seq_len": 8, "seed": 1.5}, "seed"),
                                      ({"seq_len": 8, "val_fraction": "0.1"}, "val_fraction")])
def test_token_dataset_argument_types(token_file, kw, what):
    # seq_len=8.5 gave windows of 8 and seed=1.5 seed 1, without a word; None a bare TypeError
    with pytest.raises(TileError, match=f"{what} must be"):
        TokenDataset(token_file, **kw)


def test_token_dataset_offsets_must_be_integers(token_file):
    ds = TokenDataset(token_file, 8)
    with pytest.raises(TileError, match="step must be an int >= 0"):
        ds.batch_offsets(1.5, 2)
    with pytest.raises(TileError, match="batch_size an int >= 1"):
        ds.batch_offsets(0, 2.5)
    with pytest.raises(TileError, match="offsets must be integers"):
        ds.read(np.array([0.5]))  # read window 0 as if asked for it
    x, _ = ds.read([1])
    assert x.shape == (1, 8)


# -- found by that pass, fixed after it -----------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_models_refuse_a_seed_numpy_would_reject_or_truncate(seed):
    with pytest.raises(tg.TileError, match=r"^\[tilegraph.models.GPT2\] seed must be an int >= 0"):
        tg.models.build("gpt2-debug", seed=seed)
    assert tg.models.build("gpt2-debug", seed=np.random.default_rng(0)).parameters()  # a Generator itself


def test_models_config_of_a_non_name(tmp_path):
    with pytest.raises(tg.TileError, match=r"^\[tilegraph.models.config\] unknown flavor"):
        tg.models.config(["gpt2"])


def test_from_hf_with_a_dtype_numpy_does_not_know(tmp_path):
    tg.models.build("gpt2-debug").to_hf(tmp_path / "hf")
    with pytest.raises(tg.TileError, match=r"bfloat16 is not supported \(float16, float32 and float64 are\); "
                                           r"received: 'bfloat16'"):
        tg.models.from_hf(tmp_path / "hf", dtype="bfloat16")


@pytest.mark.parametrize("ids", [["a"], [65.7], np.array([65.0])])
def test_byte_decode_of_ids_that_are_not_integers(ids):
    with pytest.raises(tg.TileError, match=r"^\[tilegraph.io.ByteTokenizer.decode\] token ids must be integers"):
        ByteTokenizer().decode(ids)
    assert ByteTokenizer().decode([65, 66]) == "AB"


def test_load_into_something_that_is_not_a_model(tmp_path):
    m = tg.models.build("gpt2-debug")
    tg.io.save_checkpoint(tmp_path / "ck", m)
    with pytest.raises(tg.TileError, match=r"a model to load into.*received: str"):
        tg.io.load_checkpoint(tmp_path / "ck").load_into("x")


def test_a_tokenizer_whose_unknown_token_its_vocabulary_lacks_is_named():
    tokenizers = pytest.importorskip("tokenizers")
    broken = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[], unk_token="<unk>"))
    tok = BPETokenizer(broken, eos=None)
    assert tok.encode("a").tolist() == [0]
    with pytest.raises(TileError, match=r"^\[tilegraph.io.BPETokenizer.encode\] a tokenizer that can encode any "
                       r"text.*received: .*<unk>"):
        tok.encode("b")  # was the library's bare Exception


@pytest.mark.parametrize("cls", ["GPT2Config", "LlamaConfig"])
def test_model_configs_refuse_a_switch_that_is_not_a_bool(cls):
    with pytest.raises(TileError, match=rf"^\[tilegraph.models.{cls}\] tie_embeddings must be true or false"):
        getattr(tg.models, cls)(tie_embeddings="no")  # a non-empty str: tied, though 'no' was meant
