"""Generation audited end to end as a user of Hugging Face's ``generate`` would use it: each test
is a defect found so, and fails without its fix.

- a transformers tokenizer given for stop strings: its ``vocab_size`` leaves out its added
  tokens (the end-of-text token of a chat model), and generate never picked them;
- ``eos_id`` as a list (Hugging Face's ``eos_token_id`` of a Llama 3 chat model) was refused;
- a prompt given as a TileTensor (as ``model(ids)`` takes one) was refused as "rows of
  different lengths";
- a loop of ``model(ids, cache=cache)`` recomputed every earlier position at each call,
  silently, where the docstring said it computes only the new ones;
- a ``cache_block`` above ``max_seq_len`` allocated cache tiles of that many rows;
- a batch padded to one length (a tokenizer's ``padding=True``) was decoded with its padding read
  as prompt text, silently: transformers' generate masks it.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import hf_model_cache
from tilegraph import models
from tilegraph.models import Decoder, generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 50


def _hf_config(arch: str):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return hf_model_cache(tmp_path_factory, _hf_config, 0.5)


def _hf_generate(hf, prompt, n, **kw) -> np.ndarray:
    ids = torch.tensor(prompt)
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw).numpy()


def _chat_tokenizer():
    """A transformers tokenizer of ten letters (ids 0-9) and an added end-of-text token "<eot>"
    (id 10), which its ``vocab_size`` (10) leaves out and ``len()`` (11) counts, as a Qwen or
    Llama 3 chat model's tokenizer does with ``<|im_end|>`` / ``<|eot_id|>``."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({c: i for i, c in enumerate("abcdefghij")},
                                                           unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens([tokenizers.AddedToken("<eot>", special=True)])
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>")
    assert (hf_tok.vocab_size, len(hf_tok), hf_tok.eos_token_id) == (10, 11, 10)
    return hf_tok


def test_a_transformers_tokenizer_s_added_end_of_text_token_is_picked():
    # before: with the tokenizer given (for stop strings) only ids below its vocab_size (10) were
    # picked, so the row never produced "<eot>" (id 10) and ran on to max_new_tokens
    tok = _chat_tokenizer()
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=11), seed=1)
    prompt = np.array([[1, 2, 3]])
    kw = dict(strategy="sample", seed=0)
    free = generate(model, prompt, 20, **kw)
    first = int(np.argmax(free[0, 3:] == tok.eos_token_id))
    assert free[0, 3 + first] == tok.eos_token_id and first > 2    # the model picks it, after a few tokens
    want = generate(model, prompt, 20, eos_id=tok.eos_token_id, **kw)
    got = generate(model, prompt, 20, eos_id=tok.eos_token_id, stop=["zz"], tokenizer=tok, **kw)
    np.testing.assert_array_equal(got, want)
    assert (got[0, 3 + first:] == tok.eos_token_id).all()
    # a tokenizer that is smaller still leaves out the ids it cannot decode, but not eos_id
    small = generate(model, prompt, 20, eos_id=10, tokenizer=tg.io.ByteTokenizer(), **kw)   # 256 ids: all
    np.testing.assert_array_equal(small, want)


class _FiveIds:
    """A tokenizer of ids 0-4 (a model's vocabulary padded past its tokenizer's)."""

    vocab_size = 5

    def decode(self, ids):
        return "".join("abcde"[i] for i in ids)


def test_ids_past_the_tokenizer_are_never_picked_but_eos_id_is():
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=11), seed=1)
    prompt = np.array([[1, 2, 3]])
    got = generate(model, prompt, 20, strategy="sample", seed=0, tokenizer=_FiveIds())
    assert (got[0, 3:] < 5).all()
    got = generate(model, prompt, 20, strategy="sample", seed=0, tokenizer=_FiveIds(), eos_id=10)
    new = got[0, 3:]
    assert ((new < 5) | (new == 10)).all() and (new == 10).any()
    end = int(np.argmax(new == 10))
    assert (new[end:] == 10).all()


def test_a_list_of_eos_ids_ends_rows_like_transformers(hf_models):
    # before: "eos_id must be None or a token id in [0, 50); received: [..]"
    hf, folder = hf_models("llama")
    model = models.from_hf(folder)
    prompt = np.random.default_rng(1).integers(0, VOCAB, (3, 5))
    free = generate(model, prompt, 20)
    eos = [int(free[0, 8]), int(free[1, 10])]       # row 0 ends at the first, row 1 at the second (or before)
    other = min(set(range(VOCAB)) - set(prompt[:, [0, -1]].ravel().tolist()) - set(eos))   # (no row starts or
    for pad in (None, other):                                                           # ends with it)
        got = generate(model, prompt, 20, eos_id=eos, pad_id=pad)
        want = _hf_generate(hf, prompt, 20, eos_token_id=eos, pad_token_id=pad)   # HF pads with eos[0] by default
        want = np.pad(want, ((0, 0), (0, got.shape[1] - want.shape[1])), constant_values=eos[0] if pad is None else pad)
        np.testing.assert_array_equal(got, want)
    assert (got[:2, 5:] != free[:2, 5:]).any()   # rows did end early
    np.testing.assert_array_equal(generate(model, prompt, 20, eos_id=(eos[0],)), generate(model, prompt, 20,
                                                                                            eos_id=eos[0]))
    for bad in ([], [3, 50], [3.0], "3"):
        with pytest.raises(tg.TileError, match=r"eos_id must be None or a token id in \[0, 50\) \(or a non-empty "
                                               r"list of them\)"):
            generate(model, prompt, 3, eos_id=bad)


def test_a_prompt_given_as_a_tile_tensor():
    # before: "prompt_ids rows of one length (...); received: rows of lengths [3]"
    model = models.build("gpt2-debug", seed=0)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(generate(model, model.tiling.tile_ids(ids), 5), generate(model, ids, 5))
    np.testing.assert_array_equal(generate(model, tg.from_numpy(ids[0]), 5), generate(model, ids[:1], 5))


def test_a_loop_of_model_calls_on_a_cache_warns_that_it_recomputes_the_prefix():
    # before: silent, each call's graph held every earlier step's (7163 nodes at position 200,
    # against 1451 at 40): 1 ms a token at first, 0.7-1.4 s later on
    model = models.build("gpt2-debug", seed=0)
    seq = np.random.default_rng(0).integers(0, 96, (1, 6))
    want = model(seq).numpy()
    cache = model.new_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(seq[:, :4], cache=cache).numpy()        # the first call: nothing cached yet
    with pytest.warns(UserWarning, match=r"\[tilegraph.models.GPT2\] the cache holds keys and values of an earlier "
                                         r"call that were never computed into it .* tilegraph.models.Decoder") as w:
        got = model(seq[:, 4:5], cache=cache).numpy()
    assert w[0].filename == __file__                   # the user's line
    np.testing.assert_allclose(got[:, -1], want[:, 4], rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():                    # the Decoder keeps its cache computed
        warnings.simplefilter("error")
        with Decoder(model, cache_block=2) as dec:
            for chunk in (seq[:, :3], seq[:, 3:4], seq[:, 4:5], seq[:, 5:6]):
                last = dec.feed(chunk)
    np.testing.assert_allclose(last, want[:, 5], rtol=1e-5, atol=1e-6)


def test_a_cache_block_above_max_seq_len_holds_no_more_rows_than_max_seq_len():
    # before: a tile of cache_block rows (10**6: 6.4 s and 1.2 GB for 20 gpt2-debug tokens)
    model = models.build("gpt2-debug", seed=0)                 # max_seq_len 32
    prompt = np.array([[1, 2, 3]])
    with Decoder(model, cache_block=10**5) as dec:
        dec.feed(prompt)
        dec.feed(np.array([[4]]))
        assert dec.cache[0].k.shape[2] == 32 and dec.cache[1].v.chunks[2] == (32,)
    np.testing.assert_array_equal(generate(model, prompt, 29, cache_block=10**9), generate(model, prompt, 29))


def test_a_batch_padded_to_one_length_warns_that_the_padding_is_read_as_text(hf_models):
    # before: silent, and the padded row's continuation was neither transformers' (which masks
    # the padding) nor its prompt's alone
    hf, folder = hf_models("llama")
    model = models.from_hf(folder)
    pad = 0
    left = np.array([[5, 6, 7, 8, 9], [pad, pad, 11, 12, 13]])
    mask = (np.arange(5)[None] >= np.array([[0], [2]])).astype(np.int64)
    with torch.no_grad():
        want = hf.generate(torch.tensor(left), attention_mask=torch.tensor(mask), do_sample=False, max_new_tokens=8,
                           pad_token_id=pad).numpy()
    # the equivalent here: each prompt a call of its own
    np.testing.assert_array_equal(generate(model, left[1:, 2:], 8)[0, 3:], want[1, 5:])
    with pytest.warns(UserWarning, match=r"\[tilegraph.models.generate\] prompt rows \[1\] start or end with more "
                                         r"pad_id=0 tokens than others: a batch padded to one length\?.*one call each"):
        got = generate(model, left, 8, pad_id=pad)
    assert (got[1, 5:] != want[1, 5:]).any()
    right = np.array([[5, 6, 7, 8, 9], [11, 12, 13, pad, pad]])
    with pytest.warns(UserWarning, match=r"prompt rows \[1\] start or end with more pad_id=0"):
        generate(model, right, 2, pad_id=pad)
    with warnings.catch_warnings():   # rows padded alike (or a prompt of the pad token alone) are no sign of it
        warnings.simplefilter("error")
        generate(model, np.array([[pad, 5, 6], [pad, 7, 8]]), 2, pad_id=pad)
        generate(model, np.array([[pad], [pad]]), 2, pad_id=pad)
        generate(model, left, 2)   # no pad_id: nothing to tell padding by


def test_tilegraph_generate_stops_at_any_eos_id_the_config_lists(tmp_path, capsys):
    # config.json's eos_token_id [EOS, DE] (as a Llama 3 chat model lists two): `tilegraph
    # generate` kept the first and ran past the second ("def  de de de de ..."), where
    # transformers' generate stops at any of them.
    import dataclasses
    import json

    from test_newuser_generate import DE, EOS, _tokenizer_json
    from tilegraph import cli
    from tilegraph.io.safetensors import load_file, save_file

    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=8), seed=0)
    folder = tmp_path / "eot"
    model.to_hf(folder)
    w = {k: v.copy() for k, v in load_file(folder / "model.safetensors").items()}
    w["transformer.ln_f.weight"][:] = 0.0  # every position's logits: wte @ 1, so DE (0.5) wins
    w["transformer.ln_f.bias"][:] = 1.0
    w["transformer.wte.weight"][DE] = 0.5
    w["transformer.wte.weight"][EOS] = 0.4
    save_file(w, folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = [EOS, DE]
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer.json").write_text(_tokenizer_json())
    assert cli.main(["generate", str(folder), "--local", "--ids", "--max-new-tokens", "8"]) == 0
    text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    ids = [int(i) for i in ids.split()]
    assert ids[-1] == DE and ids.count(DE) == 1, ids  # one new id, the second eos id: it stopped there
    assert text == "def  de"
