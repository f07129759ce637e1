"""Generation with a KV cache: greedy against Hugging Face generate, the cache against a full forward,
sampling filters and determinism, the repetition penalty against Hugging Face's, stop strings, input
errors, and the cache staying on the workers.

HF models are built from tiny configs with random weights (norm gains and biases too), saved with
save_pretrained and loaded with tilegraph.models.from_hf, as in test_models_hf.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import hf_model_cache
from conftest import check_against_torch, randn
from tilegraph import models
from tilegraph._graph import ValueRef, topo_order
from tilegraph.io import ByteTokenizer
from tilegraph.models import Decoder, ModelTiling, generate, next_tokens
from tilegraph.models.generate import find_stop, penalize_repetition

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, B, P, N = 50, 2, 7, 12


def _hf_config(arch: str):
    # no eos in the configs: HF would stop at it, and the eos test passes its own
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=3, n_positions=32, n_inner=40,
                                       bos_token_id=None, eos_token_id=None)
    # grouped-query attention: 4 query heads share 2 key/value heads
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None)


ARCHS = ["gpt2", "llama-gqa"]
# width 24 (gpt2) or 32 (llama), head_dim 8: feature tiles of 2 or 3 heads leave a ragged last
# tile, as do vocab 50 in 20s, batch 2 in 1s and a 7-token prompt in 3s
TILINGS = {
    "single": lambda arch: ModelTiling(),
    "ragged": lambda arch: ModelTiling(feature=16 if arch == "gpt2" else 24, vocab=20, batch=1, seq=3),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return hf_model_cache(tmp_path_factory, _hf_config, 0.5)


def _prompt(seed=0, b=B, p=P):
    return np.random.default_rng(seed).integers(0, VOCAB, (b, p))


def _hf_generate(hf, prompt, n, **kw) -> np.ndarray:
    ids = torch.tensor(prompt)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          **{"pad_token_id": 0, **kw})
    return out.numpy()


# ------------------------------------------------------------------------------------ greedy ----
@pytest.mark.parametrize("mode", list(TILINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(hf_models, arch, mode):
    hf, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS[mode](arch))
    prompt = _prompt()
    # a 4-row cache block: the prompt's last tile fills up, then new tiles start
    got = generate(model, prompt, N, cache_block=4 if mode == "ragged" else 64)
    want = _hf_generate(hf, prompt, N)
    assert got.shape == (B, P + N) and got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    assert len(set(got[:, P:].ravel().tolist())) > 3  # not a degenerate repetition of one token


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_ends_rows_like_transformers(hf_models, arch):
    hf, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["ragged"](arch))
    prompt = _prompt(1)
    free = generate(model, prompt, N)
    eos = int(free[0, P + 3])  # row 0 produces it after 4 steps (or earlier)
    got = generate(model, prompt, N, eos_id=eos)
    want = _hf_generate(hf, prompt, N, eos_token_id=eos, pad_token_id=eos)
    want = np.pad(want, ((0, 0), (0, P + N - want.shape[1])), constant_values=eos)  # HF stops when all rows end
    np.testing.assert_array_equal(got, want)
    first = int(np.argmax(free[0, P:] == eos))
    assert (got[0, P + first:] == eos).all() and (got[0, :P + first] == free[0, :P + first]).all()


# ---------------------------------------------------------------------------------- KV cache ----
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_logits_equal_a_full_forward(hf_models, arch):
    _, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["ragged"](arch))
    seq = _prompt(2, p=P + 3 + 4)
    want = model(seq).numpy()                                  # (B, T, V), no cache
    scale = np.abs(want).max()
    with Decoder(model, cache_block=4) as dec:
        got = {P - 1: dec.feed(seq[:, :P])}                    # prefill
        got[P + 2] = dec.feed(seq[:, P:P + 3])                 # a chunk of 3 against the cache
        # the prompt tiles (3, 3, 1) stay; the chunk fills the last one up to the 4-row block
        assert dec.cache[0].k.chunks[2] == (3, 3, 4)
        for t in range(P + 3, seq.shape[1]):                   # then one token at a time
            got[t] = dec.feed(seq[:, t:t + 1])
        assert dec.cache[1].v.chunks[2] == (3, 3, 4, 4)
        assert dec.length == seq.shape[1]
        for t, logits in got.items():
            np.testing.assert_allclose(logits, want[:, t], rtol=1e-5, atol=1e-5 * scale, err_msg=f"position {t}")

        # the last step computed the new position only: its only token ids are the new ones (and
        # the position, a tile of its own), and every attention kernel has one query row; it was
        # the step recorded for the position before, run again
        assert dec.replayed == 2   # positions 12 and 13 (10 starts a tile, 11 records the step)
        nodes = topo_order(dec.last_executable.roots)
        int_leaves = [n for n in nodes if n.is_leaf and n.out_meta[0][1].kind in "iu"]
        assert int_leaves and all(n.out_meta[0][0][-1] == 1 for n in int_leaves)
        attn = [n for n in nodes if not n.is_leaf and n.kernel.name == "sdpa_at"]
        heads = model.tiling.heads_per_tile(model.config)
        assert len(attn) == model.config.n_layers * B * -(-model.config.n_heads // heads)
        assert all(n.inputs[0].shape[2] == 1 for n in attn)


def test_attention_with_a_query_offset_matches_torch(rng):
    """Causal attention of the last T of S positions (q_offset = S - T), forward and gradients."""
    def ref(q, k, v):
        t, s = q.shape[2], k.shape[2]
        mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    for t, s, mode in ((1, 9, "single"), (4, 11, "ragged"), (5, 5, "even")):
        arrays = [randn(rng, 2, 4, t, 8), randn(rng, 2, 2, s, 8), randn(rng, 2, 2, s, 8)]
        check_against_torch(lambda q, k, v: tg.scaled_dot_product_attention(q, k, v, is_causal=True, q_offset=s - t),
                            ref, arrays, "bhtD,bgsD,bgsD", mode)
    q, k = tg.from_numpy(arrays[0]), tg.from_numpy(arrays[1])
    with pytest.raises(tg.TileError, match=r"q_offset \+ T == S.*T=5, S=5, q_offset=1"):
        tg.scaled_dot_product_attention(q, k, k, is_causal=True, q_offset=1)
    with pytest.raises(tg.TileError, match="q_offset must be a non-negative int"):
        tg.scaled_dot_product_attention(q, k, k, is_causal=True, q_offset=-1)


# ---------------------------------------------------------------------------------- sampling ----
def test_next_tokens_keeps_to_the_top_k_and_the_nucleus():
    rng = np.random.default_rng(0)
    probs = np.array([0.1, 0.4, 0.2, 0.3])                   # ranked: 1, 3, 2, 0
    logits = np.tile(np.log(probs), (4000, 1)) + 7.0          # a shift changes nothing
    cases = [(dict(strategy="top_p", top_p=0.5), {1: 0.4, 3: 0.3}),
             (dict(strategy="top_p", top_p=0.75), {1: 0.4, 3: 0.3, 2: 0.2}),
             (dict(strategy="top_p", top_p=1.0), {1: 0.4, 3: 0.3, 2: 0.2, 0: 0.1}),
             (dict(strategy="top_k", top_k=2), {1: 0.4, 3: 0.3}),
             (dict(strategy="sample", top_k=3, top_p=0.6), {1: 0.4, 3: 0.3}),
             (dict(strategy="sample"), {1: 0.4, 3: 0.3, 2: 0.2, 0: 0.1})]
    for kw, kept in cases:
        tok = next_tokens(logits, rng, **kw)
        assert tok.dtype == np.int64 and tok.shape == (4000,)
        freq = np.bincount(tok, minlength=4) / len(tok)
        total = sum(kept.values())
        for t in range(4):
            assert freq[t] == pytest.approx(kept.get(t, 0.0) / total, abs=0.03), (kw, t)
    # temperature sharpens: at 0.25 token 1 (p 0.4 against 0.3) wins about 3 draws in 4
    freq = np.bincount(next_tokens(logits, rng, strategy="sample", temperature=0.25), minlength=4) / 4000
    assert freq[1] == pytest.approx(0.4 ** 4 / (probs ** 4).sum(), abs=0.03)
    # ties rank by token id, as argmax does
    tied = np.array([[0.0, 2.0, 2.0, 1.0]])
    assert next_tokens(tied, rng)[0] == 1
    assert next_tokens(tied, rng, strategy="top_k", top_k=1)[0] in (1, 2)   # both kept, as transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_top_k_of_one_is_greedy(hf_models, arch):
    _, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["ragged"](arch))
    prompt = _prompt(3)
    np.testing.assert_array_equal(generate(model, prompt, N, strategy="top_k", top_k=1, temperature=0.7, seed=5),
                                  generate(model, prompt, N))


def _allowed(logits, temperature, top_k, top_p, slack=1e-4) -> np.ndarray:
    """Tokens a filter may keep, with a little slack for float32 differences between the cached
    logits (which the sampler saw) and these full-forward ones."""
    z = logits.astype(np.float64) / temperature
    spread = slack * np.abs(z).max()
    keep = np.ones(z.shape, bool)
    if top_k is not None:
        better = (z[None, :] > z[:, None] + spread).sum(axis=1)  # tokens clearly above each one
        keep &= better < top_k
    if top_p is not None:
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_k is not None:
            p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        mass_before = np.array([p[z > z[i] + spread].sum() for i in range(len(z))])
        keep &= mass_before < top_p + slack
    return keep


@pytest.mark.parametrize("kw", [dict(strategy="top_k", top_k=3, temperature=1.5),
                                dict(strategy="top_p", top_p=0.6, temperature=1.2),
                                dict(strategy="sample", top_k=6, top_p=0.8)], ids=["top_k", "top_p", "both"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_is_seeded_and_stays_inside_its_filter(hf_models, arch, kw):
    _, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["single"](arch))
    prompt = _prompt(4)
    out = generate(model, prompt, N, seed=7, **kw)
    np.testing.assert_array_equal(out, generate(model, prompt, N, seed=7, **kw))
    assert (out != generate(model, prompt, N, seed=8, **kw)).any()
    assert (out[:, :P] == prompt).all()

    logits = model(out[:, :-1]).numpy()                      # the scores each new token was drawn from
    off_greedy = 0
    for b in range(B):
        for t in range(P, P + N):
            row = logits[b, t - 1]
            keep = _allowed(row, kw.get("temperature", 1.0), kw.get("top_k"), kw.get("top_p"))
            assert keep[out[b, t]], (b, t)
            off_greedy += out[b, t] != row.argmax()
    assert off_greedy > 0  # it did sample


# ------------------------------------------------------------------------ repetition penalty ----
def test_repetition_penalty_matches_transformers_processor(rng):
    # mixed signs, zeros, repeated ids, a row whose ids are all one token; float32 as decoding sees it
    logits = (rng.standard_normal((4, 33)) * 3).astype(np.float32)
    logits[:, :3] = 0.0
    ids = rng.integers(0, 33, (4, 11))
    ids[3] = 5
    for penalty in (0.5, 1.0, 1.3, 2.0, 7):
        want = transformers.RepetitionPenaltyLogitsProcessor(float(penalty))(torch.tensor(ids), torch.tensor(logits))
        got = penalize_repetition(logits, ids, penalty)
        assert got.dtype == np.float32 and got.shape == logits.shape
        np.testing.assert_array_equal(got, want.numpy(), err_msg=f"penalty {penalty}")
    np.testing.assert_array_equal(penalize_repetition(logits, np.zeros((4, 0), np.int64), 2.0), logits)
    with pytest.raises(tg.TileError, match=r"ids must lie in \[0, vocab=33\).*max 33"):
        penalize_repetition(logits, np.full((4, 1), 33), 2.0)
    with pytest.raises(tg.TileError, match=r"ids must be integers of shape \(batch=4, seq\)"):
        penalize_repetition(logits, ids[:2], 2.0)


@pytest.mark.parametrize("penalty", [1.8, 0.7])
@pytest.mark.parametrize("arch", ARCHS)
def test_repetition_penalty_generates_like_transformers(hf_models, arch, penalty):
    hf, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["ragged"](arch))
    prompt = _prompt(7)
    got = generate(model, prompt, N, repetition_penalty=penalty)
    np.testing.assert_array_equal(got, _hf_generate(hf, prompt, N, repetition_penalty=penalty))
    free = generate(model, prompt, N)
    assert (got != free).any()  # it changed the continuation, towards fewer repeats when > 1, more when < 1

    def repeats(ids):
        return sum(len(row) - len(set(row.tolist())) for row in ids)
    assert repeats(got) < repeats(free) if penalty > 1 else repeats(got) > repeats(free)


def test_repetition_penalty_applies_before_sampling(hf_models):
    """Sampling with a penalty draws what next_tokens draws from the penalised logits of the
    prompt and the tokens so far (the order of Hugging Face's processors: penalty, then temperature
    and the filters)."""
    _, folder = hf_models("gpt2")
    model = models.from_hf(folder, TILINGS["single"]("gpt2"))
    prompt = _prompt(8)
    kw = dict(strategy="sample", top_k=8, temperature=0.9)
    out = generate(model, prompt, N, repetition_penalty=1.5, seed=11, **kw)
    logits = model(out[:, :-1]).numpy()
    rng = np.random.default_rng(11)
    for t in range(P, P + N):
        scores = penalize_repetition(logits[:, t - 1], out[:, :t], 1.5)
        np.testing.assert_array_equal(next_tokens(scores, rng, **kw), out[:, t], err_msg=f"position {t}")


# ------------------------------------------------------------------------------ stop strings ----
def test_find_stop_cuts_after_the_first_completed_stop_string():
    assert find_stop("a = 1\n\nb = 2", ["\n\n"]) == 7
    assert find_stop("a = 1\n\nb = 2", ["b", "\n\n"]) == 7       # the one completed first
    assert find_stop("abc", ["bc", "c"]) == 3 and find_stop("abc", ["abc", "b"]) == 2
    assert find_stop("abc", ["x"]) is None and find_stop("", ["x"]) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_strings_end_rows_with_the_byte_tokenizer(hf_models, arch):
    _, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["ragged"](arch))    # vocab 50: ids are bytes 0..49 ("0", "1", ...)
    tok = ByteTokenizer()
    prompt = _prompt(9)
    free = generate(model, prompt, N)
    text0 = tok.decode(free[0, P:])
    stop = text0[3:5]                                          # two tokens of row 0's continuation
    end0 = text0.index(stop) + 2
    assert end0 <= 5
    out = generate(model, prompt, N, stop=stop, tokenizer=tok, pad_id=49)
    want = free.copy()
    for r in range(B):   # one byte per token: a row ends with the token that completes the stop string
        end = find_stop(tok.decode(free[r, P:]), [stop])
        if end is not None:
            want[r, P + end:] = 49
    np.testing.assert_array_equal(out, want)
    assert tok.decode(out[0, P:P + end0]).endswith(stop) and (out[0, P + end0:] == 49).all()

    # the prompt is not searched: a character of the prompt that the continuation never produces
    only_in_prompt = [c for c in tok.decode(prompt[0]) if c not in text0]
    assert only_in_prompt
    np.testing.assert_array_equal(generate(model, prompt[:1], N, stop=[only_in_prompt[0]], tokenizer=tok,
                                           pad_id=0), free[:1])
    # several stop strings: the first completed ends the row; eos pads when no pad_id is given
    out = generate(model, prompt[:1], N, stop=["\x7f", stop], tokenizer=tok, eos_id=48)   # "\x7f": never
    first_eos = np.flatnonzero(free[0, P:] == 48)
    end = min(end0, int(first_eos[0]) + 1) if first_eos.size else end0
    np.testing.assert_array_equal(out[0, :P + end], free[0, :P + end])
    assert (out[0, P + end:] == 48).all()


def test_a_stop_string_may_end_inside_a_token(hf_models):
    """With tokens of several characters the row keeps the token that completes the stop string;
    find_stop cuts its text right after the stop string."""
    class Pairs:   # each id decodes to two characters: "ab" ends inside a token when "b" starts one
        def decode(self, ids):
            return "".join(f"{chr(97 + i % 26)}{chr(97 + (i + 1) % 26)}" for i in ids)

    _, folder = hf_models("gpt2")
    model = models.from_hf(folder, TILINGS["single"]("gpt2"))
    prompt = _prompt(10)[:1]
    free = generate(model, prompt, N)
    text = Pairs().decode(free[0, P:])
    stop = text[5:7]        # from the middle of the third token to the middle of the fourth
    out = generate(model, prompt, N, stop=stop, tokenizer=Pairs(), pad_id=0)
    k = next(k for k in range(1, N + 1) if stop in Pairs().decode(free[0, P:P + k]))
    np.testing.assert_array_equal(out[0, :P + k], free[0, :P + k])
    assert (out[0, P + k:] == 0).all()
    got = Pairs().decode(out[0, P:P + k])
    assert got[:find_stop(got, [stop])].endswith(stop) and len(got) - find_stop(got, [stop]) == 1


# ------------------------------------------------------------------------------------ errors ----
def test_bad_input_is_a_clear_error():
    model = models.build("gpt2-debug", ModelTiling(seq=4), seed=0)   # max_seq_len 32, vocab 96
    prompt = np.zeros((2, 5), np.int64)
    err = tg.TileError
    with pytest.raises(err, match=r"exceed the model's max_seq_len=32.*5 prompt \+ 28 new = 33"):
        generate(model, prompt, 28)
    with pytest.raises(err, match=r"strategy must be one of 'greedy', 'sample', 'top_k', 'top_p'.*'beam'"):
        generate(model, prompt, 3, strategy="beam")
    for bad in (0, 0.0, -0.1, 1.5, float("nan"), "0.9"):
        with pytest.raises(err, match=r"top_p must be a number in \(0, 1\]"):
            generate(model, prompt, 3, strategy="top_p", top_p=bad)
    with pytest.raises(err, match=r"top_k must be an int >= 1.*received: 0"):
        generate(model, prompt, 3, strategy="top_k", top_k=0)
    with pytest.raises(err, match=r"strategy='top_k' needs top_k"):
        generate(model, prompt, 3, strategy="top_k")
    with pytest.raises(err, match=r"greedy decoding takes no top_k or top_p"):
        generate(model, prompt, 3, top_p=0.9)
    with pytest.raises(err, match=r"temperature must be a positive finite number"):
        generate(model, prompt, 3, strategy="sample", temperature=0)
    with pytest.raises(err, match=r"token ids must lie in \[0, vocab_size=96\).*max 96"):
        generate(model, np.full((1, 3), 96), 3)
    with pytest.raises(err, match=r"prompt_ids must be integers of shape \(batch, prompt length\)"):
        generate(model, np.zeros((2, 0), np.int64), 3)
    with pytest.raises(err, match=r"max_new_tokens must be an int >= 0"):
        generate(model, prompt, -1)
    with pytest.raises(err, match=r"eos_id must be None or a token id in \[0, 96\)"):
        generate(model, prompt, 3, eos_id=96)
    with pytest.raises(err, match=r"model must be a tilegraph.models model"):
        generate(object(), prompt, 3)
    for bad in (0, -1.2, float("nan"), float("inf"), True, "1.2"):
        with pytest.raises(err, match=r"repetition_penalty must be a positive finite number \(1: none\)"):
            generate(model, prompt, 3, repetition_penalty=bad)
    with pytest.raises(err, match=r"pad_id must be None or a token id in \[0, 96\)"):
        generate(model, prompt, 3, pad_id=-1)
    byte = ByteTokenizer()
    for bad in ("", ["x", ""], [3], {"x"}):
        with pytest.raises(err, match=r"stop must be a non-empty string or a list of them"):
            generate(model, prompt, 3, stop=bad, tokenizer=byte, pad_id=0)
    with pytest.raises(err, match=r"stop strings need the tokenizer that decodes the ids \(tokenizer=...\)"):
        generate(model, prompt, 3, stop="x", pad_id=0)
    with pytest.raises(err, match=r"stop strings need eos_id or pad_id.*eos_id=None, pad_id=None"):
        generate(model, prompt, 3, stop="x", tokenizer=byte)
    np.testing.assert_array_equal(generate(model, prompt, 0), prompt)

    # a chunk that does not fit leaves the decoder as it was
    with Decoder(model) as dec:
        dec.feed(np.zeros((2, 30), np.int64))
        with pytest.raises(err, match=r"max_seq_len=32.*seq=33 \(30 cached \+ 3 new\)"):
            dec.feed(np.zeros((2, 3), np.int64))
        assert dec.length == 30
        with pytest.raises(err, match=r"every chunk must hold the batch of the first one \(2 rows\)"):
            dec.feed(np.zeros((1, 1), np.int64))
        assert dec.feed(np.zeros((2, 2), np.int64)).shape == (2, 96)
    with pytest.raises(err, match=r"cache must be a list of 2 KVCache"):
        model(prompt, cache=[tg.nn.KVCache()])


# ------------------------------------------------------------------------------- distributed ----
@pytest.mark.distributed
def test_generation_on_the_embedded_cluster_keeps_the_cache_on_the_workers(hf_models, embedded_runtime):
    rt = embedded_runtime
    _, folder = hf_models("llama-gqa")
    model = models.from_hf(folder, TILINGS["ragged"]("llama-gqa"))
    prompt = _prompt(5)
    sampled = dict(strategy="top_p", top_p=0.8, seed=3)
    local, local_sampled = generate(model, prompt, N), generate(model, prompt, N, **sampled)
    np.testing.assert_array_equal(generate(model, prompt, N, runtime=rt), local)
    with rt.as_current():  # the current runtime is used when none is given
        np.testing.assert_array_equal(generate(model, prompt, N, **sampled), local_sampled)

    cells = [c for p in model.parameters() for c in p.cells.flat]
    twin = models.from_hf(folder, TILINGS["ragged"]("llama-gqa"))   # the same weights, kept on the client
    with Decoder(model, runtime=rt, cache_block=4) as dec, Decoder(twin) as ref:
        # parameters moved to the workers once, for the decoder's lifetime
        assert all(isinstance(c.value, ValueRef) for c in cells)
        seq = _prompt(6, p=P + 6)
        chunks = [seq[:, :P]] + [seq[:, t:t + 1] for t in range(P, seq.shape[1])]
        for ids in chunks:  # float32 sums may run in another order on the workers
            want = ref.feed(ids)
            np.testing.assert_allclose(dec.feed(ids), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        tiles = [r for c in dec.cache for t in (c.k, c.v) for r in t.grid.flat]
        # a one-position step writes into a last tile with room for the 4-row block (3 written)
        assert dec.cache[0].k.chunks[2] == (3, 3, 4, 4) and dec.length == P + 6
        assert dec.replayed == 2   # positions 9 and 12 ran the steps recorded for 8 and 11 again
        values = [r.node.cell.value for r in tiles]
        assert all(isinstance(v, ValueRef) for v in values)   # references, not arrays on the client
        futures = [v.future for v in values]
        # the logits came back; the kept tiles' own picks may still be on their way
        from distributed import wait

        wait(futures, timeout=60)
        assert all(f.status == "finished" for f in futures)
        held = rt.client.who_has(futures)
        assert all(held[f.key] for f in futures)               # each one is held by a worker
        # tiles that no longer grow have a future of their own (no fused task's tuple kept alive)
        final = [r.node.cell.value for c in dec.cache for r in c.k.grid[:, :, :-1].flat]
        assert all(v.index is None for v in final)
    # and back on the client afterwards
    assert all(isinstance(c.value, np.ndarray) for c in cells)


class _Unpicklable(ByteTokenizer):
    """A tokenizer that cannot travel to a worker (it holds a lock)."""

    def __init__(self):
        import threading

        super().__init__()
        self.lock = threading.Lock()


@pytest.mark.distributed
def test_generate_on_a_cluster_decodes_in_one_task_on_a_worker(embedded_runtime, monkeypatch):
    """Before: each new token was a Dask round trip from the client (submit, run, fetch the
    logits), about half of a GPT-2 124M token's time on an embedded cluster. The loop now runs as
    one task on a worker; the client's Decoder is not used, the tokens and a Generator's draws
    are the same as here, and the parameters are back on the client after."""
    import importlib

    gen = importlib.import_module("tilegraph.models.generate")  # (the package's `generate` is the function)
    rt = embedded_runtime
    model = models.build("gpt2-debug", seed=0)
    prompt = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    greedy = generate(model, prompt, 12)
    rng = np.random.default_rng(7)
    sampled = [generate(model, prompt, 6, strategy="top_k", top_k=5, seed=rng) for _ in range(2)]
    stops = dict(stop=["e"], tokenizer=ByteTokenizer(), pad_id=0)
    stopped = generate(model, prompt, 12, strategy="sample", seed=1, **stops)
    fed = []
    feed = Decoder.feed
    monkeypatch.setattr(Decoder, "feed", lambda self, ids: fed.append(ids.shape) or feed(self, ids))

    np.testing.assert_array_equal(generate(model, prompt, 12, runtime=rt), greedy)
    rng = np.random.default_rng(7)  # a Generator goes on from where the worker left it
    for want in sampled:
        np.testing.assert_array_equal(generate(model, prompt, 6, strategy="top_k", top_k=5, seed=rng, runtime=rt),
                                      want)
    np.testing.assert_array_equal(generate(model, prompt, 12, strategy="sample", seed=1, runtime=rt, **stops),
                                  stopped)
    assert fed == []  # no token was decoded from here
    assert all(isinstance(c.value, np.ndarray) for p in model.parameters() for c in p.cells.flat)

    # where it cannot run on a worker, a round trip per token, as before, with the same tokens:
    other = {**stops, "tokenizer": _Unpicklable()}  # a tokenizer that does not pickle
    np.testing.assert_array_equal(generate(model, prompt, 12, strategy="sample", seed=1, runtime=rt, **other),
                                  stopped)
    assert len(fed) > 1
    fed.clear()
    monkeypatch.setattr(gen, "ONE_WORKER_MEMORY_SHARE", 1e-9)  # parameters too large for one worker
    np.testing.assert_array_equal(generate(model, prompt, 12, runtime=rt), greedy)
    assert len(fed) == 12


def test_decoding_records_no_history_and_leaves_the_garbage_collector_as_it_found_it(monkeypatch):
    import gc

    import tilegraph._autograd as autograd
    from tilegraph import models

    model = models.build("gpt2-debug", seed=0)
    records = []

    class Counted(autograd.Record):
        def __init__(self, *args):
            records.append(1)
            super().__init__(*args)

    monkeypatch.setattr(autograd, "Record", Counted)
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with models.Decoder(model) as dec:
                dec.feed(np.array([[1, 2, 3]]))
                dec.feed(np.array([[4]]))
            assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert not records  # inference: no autograd history
    model(np.array([[1, 2, 3]]))
    assert records  # (which a forward outside decoding records)


def test_generate_never_picks_an_id_its_tokenizer_cannot_decode():
    """A model whose vocabulary is larger than its tokenizer's (a padded one; tilegraph train
    --init of a bigger model on a smaller tokenizer) sampled ids past the tokenizer's, which
    BPETokenizer.decode refuses: with a tokenizer, only ids it decodes are picked."""
    from tilegraph.io import ByteTokenizer

    import dataclasses

    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=400), seed=3)
    prompt = np.array([[1, 2, 3]])
    free = generate(model, prompt, 24, strategy="sample", seed=0)
    assert (free[0, 3:] >= 257).any()  # the model alone picks them (so the test can tell)
    tok = ByteTokenizer(eos=True)
    kept = generate(model, prompt, 24, strategy="sample", seed=0, tokenizer=tok)
    assert (kept[0, 3:] < 257).all()
    tok.decode(kept[0])


def _stall_decoding(dask_worker=None, where="loop", stall=True):
    """On this worker, the decoding task's loop (``where="loop"``) or every fused task
    ("tasks") waits a minute before it runs; or no longer (``stall=False``)."""
    import importlib
    import time

    module, name = {"loop": ("tilegraph.models.generate", "_Loop"),
                    "tasks": ("tilegraph.exec", "program")}[where]
    owner = getattr(importlib.import_module(module), name)
    attr = "run" if where == "loop" else "run_cluster"
    if stall:
        run = getattr(owner, attr)
        setattr(owner, "_unstalled", run)
        setattr(owner, attr, lambda *a, **kw: time.sleep(60) or run(*a, **kw))
    elif hasattr(owner, "_unstalled"):
        setattr(owner, attr, owner._unstalled)


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["one task", "per token"])
def test_a_worker_lost_while_generate_decodes_on_it_is_a_clear_error_and_the_model_stays_usable(
        own_runtime, monkeypatch, path):
    """Before: Dask's FutureCancelledError ("already forgotten") on the path decoding in one task,
    after a scheduler log line listing every scattered parameter tile the worker took with it;
    the path of a round trip per token said to resume training from a checkpoint. Now a
    WorkerLostError naming the worker, within seconds, that says the model is intact; that log
    line names three keys and the count; generate runs again on the workers left."""
    import importlib
    import logging
    import os
    import signal
    import threading
    import time

    rt = own_runtime
    model = models.build("gpt2-debug", seed=0)
    prompt = np.array([[1, 2, 3, 4]])
    want = generate(model, prompt, 8)
    where = "loop" if path == "one task" else "tasks"
    if path == "per token":  # parameters too large for one worker: the client decodes
        monkeypatch.setattr(importlib.import_module("tilegraph.models.generate"), "ONE_WORKER_MEMORY_SHARE", 1e-9)
    rt.client.run(_stall_decoding, where=where)
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    log = logging.getLogger("distributed.scheduler")
    log.addHandler(handler)
    pids = rt.client.run(os.getpid)
    got = {}

    def decode():
        try:
            got["ids"] = generate(model, prompt, 8, runtime=rt)
        except Exception as e:
            got["error"] = e

    thread = threading.Thread(target=decode)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not (busy := [a for a, keys in rt.client.processing().items() if any(k.startswith("tg-") for k in keys)]):
            assert time.monotonic() < deadline and thread.is_alive(), got
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(pids[busy[0]], signal.SIGKILL)
        thread.join(60)
        took = time.monotonic() - t0
    finally:
        log.removeHandler(handler)
    error = got.get("error")
    assert isinstance(error, tg.TileError) and type(error).__name__ == "WorkerLostError", got
    assert str(error).startswith(f"[tilegraph.models.{'generate' if path == 'one task' else 'Decoder'}] lost worker "
                                 f"{busy[0]} (left the cluster")
    assert "the model's parameters are this process's own, only lent to the workers: generate can " \
           "run again on the workers left" in str(error)
    assert took < 15
    lost = [r.getMessage() for r in records if "lose scattered data" in r.getMessage()]
    assert lost and all(len(m) < 600 and re.search(r"\.\.\. \(\d+ keys\)\}", m) for m in lost), lost
    assert all(isinstance(c.value, np.ndarray) for p in model.parameters() for c in p.cells.flat)
    rt.client.run(_stall_decoding, where=where, stall=False)
    np.testing.assert_array_equal(generate(model, prompt, 8, runtime=rt), want)
