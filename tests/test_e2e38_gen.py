"""Generation audited end to end (round 2) as a user of transformers' ``generate`` would use it:
each test is a defect found so, and fails without its fix.

- a batch of prompts of different lengths, padded to one length with the tokenizer's
  ``attention_mask`` (transformers' way), had no way in: the mask was an unknown argument, and
  without it the padding was read as prompt text;
- a logit of -inf (a token masked out, which transformers' generate never picks) was refused;
- ``top_k`` kept exactly k tokens, the lowest ids among those tied with the k-th: transformers
  keeps every token tied with it;
- ``temperature=0`` (and ``tilegraph generate --temperature 0``) was refused without saying
  that greedy decoding is what it means.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import hf_model_cache
from tilegraph import models
from tilegraph.models import generate, next_tokens

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_e2e37_generation import VOCAB, _hf_config as _llama_config  # noqa: E402

PAD = 0


def _hf_config(arch: str):
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=3, n_positions=32,
                                       bos_token_id=None, eos_token_id=None)
    return _llama_config(arch)  # (the Llama of session 37's generation tests, of the same VOCAB)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return hf_model_cache(tmp_path_factory, _hf_config, 0.5)


LEFT = np.array([[5, 6, 7, 8, 9], [PAD, PAD, 11, 12, 13], [PAD, 3, 4, 5, 6], [PAD, PAD, 21, 22, 23]])
LEFT_MASK = (LEFT != PAD).astype(np.int64)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_left_padded_batch_with_its_attention_mask_decodes_as_transformers(hf_models, arch):
    # before: generate(..., attention_mask=...) was a TypeError, and without it the padded rows
    # continued their padding read as text
    hf, folder = hf_models(arch)
    model = models.from_hf(folder)
    with torch.no_grad():
        want = hf.generate(torch.tensor(LEFT), attention_mask=torch.tensor(LEFT_MASK), do_sample=False,
                           max_new_tokens=10, pad_token_id=PAD).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (no "a batch padded to one length?" warning with the mask)
        got = generate(model, LEFT, 10, attention_mask=LEFT_MASK, pad_id=PAD)
    np.testing.assert_array_equal(got, want)
    # as each prompt alone, and a bool mask or a TileTensor one reads the same
    for r in range(len(LEFT)):
        np.testing.assert_array_equal(got[r, 5:], generate(model, LEFT[r][LEFT_MASK[r] == 1], 10)[0, -10:])
    np.testing.assert_array_equal(generate(model, LEFT, 10, attention_mask=LEFT_MASK.astype(bool)), got)
    np.testing.assert_array_equal(generate(model, LEFT, 10, attention_mask=tg.from_numpy(LEFT_MASK)), got)


def test_a_right_padded_batch_with_its_mask_continues_each_prompt(hf_models):
    # (transformers decodes after the padding there, and warns; here each prompt is read alone)
    _, folder = hf_models("llama")
    model = models.from_hf(folder)
    right = np.array([[5, 6, 7, 8, 9], [11, 12, 13, PAD, PAD], [3, 4, 5, 6, PAD]])
    mask = (right != PAD).astype(np.int64)
    got = generate(model, right, 8, attention_mask=mask, eos_id=[3, 4], pad_id=PAD)
    np.testing.assert_array_equal(got[:, :5], right)   # the ids as given, then the new ones
    for r in range(len(right)):
        alone = generate(model, right[r][mask[r] == 1], 8, eos_id=[3, 4], pad_id=PAD)
        np.testing.assert_array_equal(got[r, 5:], alone[0, -8:])


def test_a_masked_batch_samples_alike_here_and_on_a_cluster(hf_models, embedded_runtime):
    _, folder = hf_models("llama")
    model = models.from_hf(folder)
    kw = dict(attention_mask=LEFT_MASK, strategy="top_k", top_k=5, seed=7, eos_id=[3, 4], pad_id=PAD)
    here = generate(model, LEFT, 10, **kw)
    np.testing.assert_array_equal(generate(model, LEFT, 10, **kw), here)   # seeded
    with embedded_runtime.as_current():
        np.testing.assert_array_equal(generate(model, LEFT, 10, **kw), here)


def test_only_the_longest_masked_prompt_counts_against_max_seq_len(hf_models):
    # the padding takes no position: a row's prompt and its new tokens must fit max_seq_len (32)
    _, folder = hf_models("llama")
    model = models.from_hf(folder)
    ids = np.zeros((2, 10), dtype=np.int64)
    ids[0, 2:], ids[1, 6:] = 7, 9
    mask = (ids != 0).astype(np.int64)
    assert generate(model, ids, 24, attention_mask=mask).shape == (2, 34)
    with pytest.raises(tg.TileError, match=r"max_seq_len=32; received: 8 prompt \+ 25 new = 33 \(the longest prompt "
                                           r"the attention_mask marks\)"):
        generate(model, ids, 25, attention_mask=mask)


def test_a_wrong_attention_mask_is_a_clear_error():
    model = models.build("gpt2-debug", seed=0)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    err = r"\[tilegraph.models.generate\] attention_mask must be 1s \(prompt\) and 0s \(padding\) of prompt_ids' "
    with pytest.raises(tg.TileError, match=err + r"shape \(2, 3\); received: int64 array of shape \(2, 2\)"):
        generate(model, ids, 2, attention_mask=np.ones((2, 2), dtype=np.int64))
    with pytest.raises(tg.TileError, match=err + r"shape \(2, 3\); received: values \[0, 2\]"):
        generate(model, ids, 2, attention_mask=np.array([[0, 2, 2], [2, 2, 2]]))
    with pytest.raises(tg.TileError, match=r"attention_mask rows of one run of 1s each \(the prompt\), with 0s only "
                                           r"before it .*; received: row 1: \[1, 0, 1\]"):
        generate(model, ids, 2, attention_mask=np.array([[1, 1, 1], [1, 0, 1]]))
    with pytest.raises(tg.TileError, match=r"received: row 0: \[0, 0, 0\]"):
        generate(model, ids, 2, attention_mask=np.array([[0, 0, 0], [1, 1, 1]]))
    # a tokenizer's whole output (transformers' generate(**enc)) is named as such
    enc = transformers.BatchEncoding({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    with pytest.raises(tg.TileError, match=r"a tokenizer's output goes in as generate\(model, enc\['input_ids'\], n, "
                                           r"attention_mask=enc\['attention_mask'\]\); received: a BatchEncoding "
                                           r"with keys \['attention_mask', 'input_ids'\]"):
        generate(model, enc, 2)
    # prompts of different lengths point at the mask
    with pytest.raises(tg.TileError, match=r"prompt_ids rows of one length .*pass attention_mask="):
        generate(model, [[1, 2, 3], [4, 5]], 2)


def test_a_token_masked_out_with_minus_inf_is_never_picked():
    # before: "logits must be finite; received: 1 entries are not", where transformers' generate
    # (a bad-words list, a logits processor of the user's) simply never samples it
    rng = np.random.default_rng(0)
    logits = np.tile(np.array([[0.0, -np.inf, 1.0, 0.5]]), (3000, 1))
    for kw in (dict(strategy="sample"), dict(strategy="top_k", top_k=4), dict(strategy="top_p", top_p=1.0),
               dict(strategy="top_p", top_p=0.9, temperature=2.0)):
        tok = next_tokens(logits, rng, **kw)
        assert (tok != 1).all() and set(tok.tolist()) == {0, 2, 3}, kw
    assert next_tokens(np.array([[-np.inf, -np.inf, -3.0]]), rng).tolist() == [2]
    assert next_tokens(np.array([[-np.inf, -np.inf, -3.0]]), rng, strategy="top_k", top_k=2).tolist() == [2]
    with pytest.raises(tg.TileError, match=r"logits must be finite or -inf \(a token masked out\); received: 2 "
                                           r"entries are NaN or \+inf"):
        next_tokens(np.array([[0.0, np.nan, np.inf]]), rng, strategy="sample")
    with pytest.raises(tg.TileError, match=r"at least one token not masked out \(-inf\) in each row; received: "
                                           r"rows \[1\] all -inf"):
        next_tokens(np.array([[0.0, 1.0], [-np.inf, -np.inf]]), rng, strategy="sample")


def test_top_k_keeps_every_token_tied_with_the_kth_like_transformers():
    # before: exactly k tokens, the lowest ids among the tied (top_k=1 on a tie: always the first)
    from transformers.generation.logits_process import TopKLogitsWarper

    rng = np.random.default_rng(0)
    row = np.array([2.0, 2.0, 2.0, 1.0, 3.0, 0.5])
    for k in (1, 2, 3, 4, 6):
        kept_hf = np.isfinite(TopKLogitsWarper(k)(None, torch.tensor(row[None])).numpy()[0])
        tok = next_tokens(np.tile(row, (4000, 1)), rng, strategy="top_k", top_k=k)
        np.testing.assert_array_equal(np.bincount(tok, minlength=6) > 0, kept_hf, err_msg=f"top_k={k}")
    tied = np.tile([[0.0, 2.0, 2.0, 1.0]], (4000, 1))
    freq = np.bincount(next_tokens(tied, rng, strategy="top_k", top_k=1), minlength=4) / 4000
    assert freq[1] == pytest.approx(0.5, abs=0.03) and freq[2] == pytest.approx(0.5, abs=0.03)


def test_temperature_zero_says_it_means_greedy_decoding(capsys):
    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"temperature must be a positive finite number \(for the most likely "
                                           r"token, as transformers' do_sample=False: strategy='greedy'"):
        generate(model, np.array([[1, 2]]), 2, strategy="sample", temperature=0)
    from tilegraph import cli

    assert cli.main(["generate", "nowhere", "--temperature", "0"]) == 2
    assert ("[tilegraph generate] --temperature > 0 (for the most likely token at each step, greedy decoding"
            in capsys.readouterr().err)


def test_eos_id_as_a_numpy_array_of_ids():
    # before: "eos_id must be None or a token id in [0, 96) (or a non-empty list of them); received: array([3, 5])"
    model = models.build("gpt2-debug", seed=0)
    np.testing.assert_array_equal(generate(model, [1, 2, 3], 4, eos_id=np.array([3, 5])),
                                  generate(model, [1, 2, 3], 4, eos_id=[3, 5]))


def _folder_of_bytes(tmp_path, generation_config: dict | None):
    import dataclasses
    import json

    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
    folder = tmp_path / "m"
    model.to_hf(folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_tilegraph_generate_says_when_the_folder_s_generation_config_samples(tmp_path, capsys):
    # before: a chat model's generation_config.json (do_sample, temperature 0.6, top_p 0.9), which
    # transformers' generate follows by default, was ignored without a word: greedy tokens
    from tilegraph import cli

    folder = _folder_of_bytes(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    base = ["generate", str(folder), "--tokenizer", "byte", "--local", "--max-new-tokens", "3"]
    assert cli.main(base) == 0
    greedy = capsys.readouterr()
    assert greedy.err.strip() == (
        f"tilegraph generate: note: {folder / 'generation_config.json'} samples (do_sample=true, temperature=0.6, "
        "top_p=0.9), as transformers' generate does by default; this decodes greedily (the most likely tokens): "
        "--top-k 50 --top-p 0.9 --temperature 0.6 samples as transformers would")
    assert cli.main(base + ["--top-k", "50", "--top-p", "0.9", "--temperature", "0.6"]) == 0
    assert capsys.readouterr().err == ""   # flags given: no note
    assert cli.main(base + ["--strategy", "greedy"]) == 0
    assert capsys.readouterr().err == ""   # greedy asked for
    (folder / "generation_config.json").write_text('{"do_sample": true, "top_k": 0}')
    assert cli.main(base) == 0
    assert capsys.readouterr().err.strip().endswith("this decodes greedily (the most likely tokens): --strategy "
                                                    "sample samples as transformers would")
    (folder / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert cli.main(base) == 0
    assert capsys.readouterr().err == ""


def _hf_transition_scores(hf, ids: np.ndarray, p: int, *, penalty=1.0, temperature=1.0, top_k=None, top_p=None):
    """transformers' processed scores of the tokens ``ids[:, p:]`` (a forward over the whole ids,
    then its repetition penalty and warpers at each position), log-softmaxed: its
    ``compute_transition_scores(..., normalize_logits=True)`` for those tokens."""
    from transformers.generation import logits_process as lp

    procs = ([lp.RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1 else []) \
        + ([lp.TemperatureLogitsWarper(float(temperature))] if temperature != 1 else []) \
        + ([lp.TopKLogitsWarper(top_k)] if top_k else []) + ([lp.TopPLogitsWarper(top_p)] if top_p else [])
    t = torch.tensor(ids)
    with torch.no_grad():
        logits = hf(t).logits.double()
    out = np.empty((len(ids), ids.shape[1] - p))
    for i in range(p, ids.shape[1]):
        s = logits[:, i - 1]
        for proc in procs:
            s = proc(t[:, :i], s)
        out[:, i - p] = torch.log_softmax(s, -1).gather(1, t[:, i:i + 1])[:, 0].numpy()
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_scores_of_the_new_tokens_as_transformers_transition_scores(hf_models, arch):
    # before: no scores at all (README: "Scores are not returned")
    hf, folder = hf_models(arch)
    model = models.from_hf(folder)
    prompt = np.array([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    ids, scores = generate(model, prompt, 8, repetition_penalty=1.3, return_scores=True)
    np.testing.assert_array_equal(ids, generate(model, prompt, 8, repetition_penalty=1.3))
    with torch.no_grad():
        res = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(2, 5, dtype=torch.long), do_sample=False,
                          max_new_tokens=8, repetition_penalty=1.3, output_scores=True, return_dict_in_generate=True)
        want = hf.compute_transition_scores(res.sequences, res.scores, normalize_logits=True).numpy()
    np.testing.assert_array_equal(ids, res.sequences.numpy())
    np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-5)
    # sampled: under the filtered distribution each token was drawn from
    for kw in (dict(strategy="top_k", top_k=5, temperature=0.7), dict(strategy="sample", top_k=8, top_p=0.8),
               dict(strategy="top_p", top_p=0.9, temperature=1.5)):
        ids, scores = generate(model, prompt, 8, seed=3, repetition_penalty=1.2, return_scores=True, **kw)
        np.testing.assert_array_equal(ids, generate(model, prompt, 8, seed=3, repetition_penalty=1.2, **kw))
        want = _hf_transition_scores(hf, ids, 5, penalty=1.2, **{k: v for k, v in kw.items() if k != "strategy"})
        np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-5, err_msg=str(kw))
        assert np.isfinite(scores).all() and (scores <= 0).all()


def test_scores_with_a_mask_an_end_and_on_a_cluster(hf_models, embedded_runtime):
    _, folder = hf_models("llama")
    model = models.from_hf(folder)
    kw = dict(attention_mask=LEFT_MASK, strategy="top_k", top_k=5, seed=7)
    free, free_scores = generate(model, LEFT, 10, return_scores=True, **kw)
    kw.update(eos_id=int(free[1, 7]), pad_id=PAD)   # row 1 ends at its third new token (or before)
    ids, scores = generate(model, LEFT, 10, return_scores=True, **kw)
    assert scores.shape == (4, 10) and scores.dtype == np.float64
    hit = ids[:, 5:] == kw["eos_id"]
    ended = np.cumsum(hit, axis=1) - hit > 0   # the positions after a row's eos
    assert ended[1].any() and (scores[ended] == 0).all() and (scores[~ended] < 0).all()
    # row 0 (the first batch, of prompt length 5) drew the same tokens before its end
    np.testing.assert_array_equal(scores[0][~ended[0]], free_scores[0][~ended[0]])
    with embedded_runtime.as_current():
        ids2, scores2 = generate(model, LEFT, 10, return_scores=True, **kw)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_allclose(scores2, scores, rtol=1e-12)
    ids0, s0 = generate(model, LEFT, 0, return_scores=True, **kw)
    assert s0.shape == (4, 0)
    with pytest.raises(tg.TileError, match=r"return_scores must be a bool; received: 'yes'"):
        generate(model, LEFT, 2, return_scores="yes")


def test_a_pad_token_added_past_the_vocabulary_may_fill_the_masked_padding(hf_models):
    # a "[PAD]" added to a tokenizer (GPT-2's has none) takes the id after the model's last: the
    # padding the mask marks is never read, so it was refused for nothing ("token ids must lie in
    # [0, vocab_size=50)")
    _, folder = hf_models("gpt2")
    model = models.from_hf(folder)
    added = np.where(LEFT_MASK == 1, LEFT, VOCAB)   # pad id 50
    np.testing.assert_array_equal(generate(model, added, 6, attention_mask=LEFT_MASK)[:, 5:],
                                  generate(model, LEFT, 6, attention_mask=LEFT_MASK)[:, 5:])
    with pytest.raises(tg.TileError, match=r"token ids must lie in \[0, vocab_size=50\); received: min 50, max 50 "
                                           r"\(where the attention_mask marks the prompts\)"):
        generate(model, np.where(LEFT_MASK == 1, VOCAB, 0), 2, attention_mask=LEFT_MASK)
