"""`tilegraph generate` and `tilegraph eval` tried as a new user with a trained model would, and
the Python API behind them (generate, next_tokens, find_stop): each test is a defect found that
way, and fails without its fix.

The Hugging Face folders here hold a debug GPT-2 whose output does not depend on its input
(ln_f's gain is 0, so every position's hidden state is ln_f's bias) and a SentencePiece-style
tokenizer (Llama's: a word's leading space is the "▁" of its token): folder "de" always prefers
"▁de"; folder "mix" gives "▁de" and the end of text the same logit, the rest far below.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import cli, models
from tilegraph.io.safetensors import load_file, save_file
from tilegraph.models.generate import find_stop, generate, next_tokens

EOS, DEF, DE = 0, 1, 2  # ids of "<|endoftext|>", "▁def", "▁de"


def _tokenizer_json() -> str:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": EOS, "▁def": DEF, "▁de": DE, "d": 3, "e": 4, "f": 5, "▁": 6, "▁d": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("▁", "d"), ("▁d", "e"), ("▁de", "f")]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    return tok.to_str()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("newuser-generate")
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=8), seed=0)
    tokenizer = _tokenizer_json()
    for name, eos_logit in (("de", 0.4), ("mix", 0.5)):
        folder = root / name
        model.to_hf(folder)
        weights = {k: v.copy() for k, v in load_file(folder / "model.safetensors").items()}
        dim = weights["transformer.ln_f.bias"].shape[0]
        weights["transformer.ln_f.weight"][:] = 0.0
        weights["transformer.ln_f.bias"][:] = 1.0
        weights["transformer.wte.weight"][DE] = 0.5        # logit 0.5 * dim
        weights["transformer.wte.weight"][EOS] = eos_logit
        save_file(weights, folder / "model.safetensors")
        config = json.loads((folder / "config.json").read_text())
        config["eos_token_id"] = EOS  # as a real GPT-2's config.json names <|endoftext|>
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "tokenizer.json").write_text(tokenizer)
        assert dim == 32
    return root


def _generate(capsys, *args) -> tuple[str, list[int]]:
    """``tilegraph generate ARGS --local --ids``: the text printed and the ids."""
    code = cli.main(["generate", *map(str, args), "--local", "--ids"])
    out, err = capsys.readouterr()
    assert code == 0, err
    text, ids = out.rstrip("\n").rsplit("\n", 1)
    return text, [int(i) for i in ids.split()]


def _error(capsys, *args) -> str:
    code = cli.main(list(map(str, args)))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


# --------------------------------------------------------------- the text of a continuation ----
def test_a_continuation_keeps_the_space_its_first_token_starts_with(folders, capsys):
    # "▁de" decoded alone is "de": the new text was decoded apart from the prompt's, and
    # `--prompt def` printed "defde de de"
    text, ids = _generate(capsys, folders / "de", "--prompt", "def", "--max-new-tokens", "3")
    assert ids == [DEF, DE, DE, DE] and text == "def de de de"
    # a stop string that starts with the space is found in the first new token (it was found in
    # the second, "de de", and printed "defde de")
    text, ids = _generate(capsys, folders / "de", "--prompt", "def", "--max-new-tokens", "5", "--stop", " de")
    assert ids == [DEF, DE] and text == "def de"
    # generate() searches the same text: the row ends at the first token
    model = cli.load_model(folders / "de", "test")
    tokenizer = cli.load_tokenizer(folders / "de", None)
    out = generate(model, [[DEF]], 4, stop=" de", tokenizer=tokenizer, pad_id=EOS)
    assert out.tolist() == [[DEF, DE, EOS, EOS, EOS]]


# ----------------------------------------------------------------------------- end of text ----
def test_generate_ends_at_the_eos_token_of_a_hugging_face_folder(folders, capsys):
    # the tokenizer.json of an HF folder was loaded without an end-of-text token: generation ran
    # past <|endoftext|> (printed as nothing) into more text, as if it were not there
    text, ids = _generate(capsys, folders / "mix", "--prompt", "def", "--top-k", "2", "--seed", "4",
                          "--max-new-tokens", "20")
    assert ids == [DEF, DE, DE, DE, EOS] and text == "def de de de"
    assert cli.load_tokenizer(folders / "mix", None, eos_from_config=True).eos_id == EOS
    assert cli.load_tokenizer(folders / "mix", None).eos_id is None  # eval: as before


def test_the_ids_printed_end_at_the_end_of_text(folders, capsys):
    # --tokenizer PATH knows <|endoftext|> by its name: generation stopped there, and --ids
    # printed the padding after it (eos again, up to --max-new-tokens) as if generated
    free = _generate(capsys, folders / "mix", "--prompt", "def", "--top-k", "2", "--seed", "4", "--max-new-tokens",
                     "20")
    text, ids = _generate(capsys, folders / "mix", "--prompt", "def", "--tokenizer", folders / "mix" / "tokenizer.json",
                          "--top-k", "2",
                          "--seed", "4", "--max-new-tokens", "20")
    assert (text, ids) == free and ids.count(EOS) == 1 and ids[-1] == EOS


# ------------------------------------------------------------------ errors named as flags ----
def test_too_many_new_tokens_are_named_as_the_flag(folders, capsys):
    # it was generate()'s "[tilegraph.models.generate] prompt and new tokens exceed ..."
    err = _error(capsys, "generate", folders / "de", "--prompt", "def de", "--max-new-tokens", "31", "--local")
    assert err == ("tilegraph generate: error: [tilegraph generate] --max-new-tokens of at most 30: the model's "
                   "max_seq_len=32 less the --prompt's 2 tokens; received: --max-new-tokens=31")
    err = _error(capsys, "generate", folders / "de", "--prompt", " ".join(["def"] * 33), "--max-new-tokens", "0",
                 "--local")
    assert "a --prompt of fewer tokens than the model's max_seq_len=32 (room for new ones); received: 33 tokens" in err
    # a prompt that fills the window, and no new tokens: the prompt
    text, ids = _generate(capsys, folders / "de", "--prompt", " ".join(["def"] * 32), "--max-new-tokens", "0")
    assert ids == [DEF] * 32 and text == " ".join(["def"] * 32)


def test_an_empty_stop_string_is_named_as_the_flag(folders, capsys):
    # it was "[tilegraph.models.generate] stop must be a non-empty string or a list of them; received: ['']"
    err = _error(capsys, "generate", folders / "de", "--stop", "\\n", "--stop", "", "--local")
    assert err == ("tilegraph generate: error: [tilegraph generate] --stop strings of at least one character; "
                   "received: --stop ''")


def test_eval_names_a_validation_split_too_small_for_the_batch_as_flags(folders, capsys):
    # the default corpus is read in its validation part: it was checked against the whole corpus,
    # then eval_offsets failed naming batch_size and the temporary file tokens.bin
    ck = folders / "byte"
    if not ck.exists():
        model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
        tg.io.save_checkpoint(ck, model, files=cli.tokenizer_files(tg.io.ByteTokenizer(eos=True)))
    err = _error(capsys, "eval", ck, "--batch-size", "100000", "--batches", "1", "--local")
    assert re.fullmatch(r"tilegraph eval: error: \[tilegraph eval\] the validation split \(last 5%\) of the default "
                        r"training corpus to hold --batch-size=100000 windows of --seq-len=32 tokens \(100000 x 32 "
                        r"\+ 1 = 3,200,001 tokens; or a smaller --batch-size or --seq-len\); received: [\d,]+ "
                        r"tokens, [\d,]+ window\(s\), from \d+ source\(s\)", err), err


# --------------------------------------------------------------------------------- the API ----
def test_find_stop_takes_one_string_as_one_stop_string():
    # a bare string was iterated as its characters: "\n\n" stopped at the first "\n"
    assert find_stop("x = 1\ny\n\n", "\n\n") == 9
    assert find_stop("x = 1\ny\n\n", ["\n\n"]) == 9 and find_stop("abc", None) is None
    with pytest.raises(tg.TileError, match=r"stop must be a non-empty string or a list of them; received: \[''\]"):
        find_stop("abc", [""])  # it returned 0: the whole text cut off


def test_prompts_of_different_lengths_are_a_clear_error():
    # NumPy's "setting an array element with a sequence ... inhomogeneous shape" came through
    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.generate\] prompt_ids rows of one length .*; "
                                           r"received: rows of lengths \[3, 2\]"):
        generate(model, [[1, 2, 3], [4, 5]], 2)


def test_a_tiny_temperature_samples_the_best_token():
    # logits / temperature overflowed to inf, inf - inf is NaN, and the token drawn was not the best
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings either
        assert next_tokens(np.array([[5.0, 10.0, 1.0]]), rng, strategy="sample", temperature=1e-320).tolist() == [1]
        assert next_tokens(np.array([[-1e308, 1e308, 0.0]]), rng, strategy="top_k", top_k=3,
                           temperature=0.5).tolist() == [1]
