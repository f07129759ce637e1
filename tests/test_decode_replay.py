"""Decoding steps run again: a one-position step holds its position in a tile and writes into a
cache tile with room, so the Decoder runs the graph it recorded for one position again for the next
ones of that tile. Against the step recorded afresh (bitwise), a full forward, torch's attention,
on the embedded cluster, and what a failed or refused step leaves behind."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.models import Decoder, ModelTiling
from tilegraph.ops.attention import kv_cache_write, sdpa_at
from tilegraph.ops.rope import rope, rope_at

FLAVORS = {
    # ragged everywhere: batch 3 in 2s, the feature (heads) and vocab tiles uneven, prompt 5 in 2s
    "gpt2": lambda: models.build("gpt2-debug", ModelTiling(feature=32, vocab=50, batch=2, seq=2), seed=1),
    "llama": lambda: models.build("llama-debug", ModelTiling(feature=32, vocab=50, batch=2, seq=2), seed=1),
}


def _feed_all(model, chunks, replay, block, runtime=None):
    with Decoder(model, cache_block=block, replay=replay, runtime=runtime) as dec:
        out = [dec.feed(c) for c in chunks]
        return np.stack(out), dec.replayed, dec.length


def _chunks(vocab, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, (3, 5 + 9 + 2 + 6))
    # a prompt, one position at a time across tile ends, a chunk of 2 (the tile with room cut
    # back to what it holds first), then one at a time again
    return ([ids[:, :5]] + [ids[:, t:t + 1] for t in range(5, 14)] + [ids[:, 14:16]]
            + [ids[:, t:t + 1] for t in range(16, 22)]), ids


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_replayed_steps_equal_steps_recorded_afresh_and_a_full_forward(flavor):
    model = FLAVORS[flavor]()
    chunks, ids = _chunks(model.config.vocab_size)
    replayed, n_replayed, length = _feed_all(model, chunks, True, 3)
    recorded, n_recorded, _ = _feed_all(model, chunks, False, 3)
    # per 3-row tile: a step starts it (or grows the prompt's), the next records, the third replays
    assert n_recorded == 0 and n_replayed == 4 and length == ids.shape[1]
    np.testing.assert_array_equal(replayed, recorded)
    full = model(ids).numpy()
    ends = np.cumsum([c.shape[1] for c in chunks]) - 1
    np.testing.assert_allclose(replayed, full[:, ends].transpose(1, 0, 2), rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_replayed_steps_on_the_embedded_cluster_equal_local_ones(embedded_runtime):
    model = FLAVORS["llama"]()
    chunks, _ = _chunks(model.config.vocab_size, seed=1)
    local, n_local, _ = _feed_all(model, chunks, True, 4)
    remote, n_remote, _ = _feed_all(model, chunks, True, 4, runtime=embedded_runtime)
    assert n_local == n_remote >= 4
    np.testing.assert_allclose(remote, local, rtol=1e-5, atol=1e-5 * np.abs(local).max())


def test_a_step_past_max_seq_len_is_refused_when_replayed_and_the_cache_stays():
    model = models.build("gpt2-debug", seed=0)            # max_seq_len 32
    n = model.config.max_seq_len
    with Decoder(model) as dec:
        dec.feed(np.zeros((1, n - 4), dtype=np.int64))
        for t in range(4):
            dec.feed(np.array([[t]]))
        assert dec.replayed == 2 and dec.length == n
        with pytest.raises(tg.TileError, match=r"max_seq_len=32.*seq=33 \(32 cached \+ 1 new\)"):
            dec.feed(np.array([[1]]))
        assert dec.length == n


def test_a_failed_replay_leaves_the_cache_as_it_was(monkeypatch):
    model = models.build("llama-debug", seed=0)
    seq = np.random.default_rng(2).integers(0, model.config.vocab_size, (1, 9))
    with Decoder(model, replay=False) as ref:
        want = [ref.feed(seq[:, :5])] + [ref.feed(seq[:, t:t + 1]) for t in range(5, 9)]
    with Decoder(model) as dec:
        got = [dec.feed(seq[:, :5])] + [dec.feed(seq[:, t:t + 1]) for t in range(5, 7)]
        step = dec._step
        assert step is not None
        run = step.exe.run

        def broken(*a, **kw):
            raise RuntimeError("a worker died")

        monkeypatch.setattr(step.exe, "run", broken)
        with pytest.raises(RuntimeError, match="a worker died"):
            dec.feed(seq[:, 7:8])
        assert dec.length == 7
        monkeypatch.setattr(step.exe, "run", run)
        got += [dec.feed(seq[:, t:t + 1]) for t in range(7, 9)]
        assert dec.replayed == 2   # positions 7 (after the failure) and 8
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


@pytest.mark.parametrize("version", ["cpu-version", "numpy-run-of-the-device-version"])
def test_sdpa_at_matches_torch_and_never_reads_the_rows_after_the_position(rng, monkeypatch, version):
    torch = pytest.importorskip("torch")
    from tilegraph.ops import attention

    if version != "cpu-version":
        monkeypatch.setattr(attention._sdpa_at, "cpu", attention._sdpa_at.gpu)
    b, h, hkv, d, cap, p = 2, 4, 2, 8, 11, 6      # grouped-query heads; keys written up to position 6
    q = rng.standard_normal((b, h, 1, d))
    k, v = rng.standard_normal((2, b, hkv, cap, d))
    k[:, :, p + 1:], v[:, :, p + 1:] = np.nan, np.inf  # room of the cache tile, never written
    tiles = (1, 2, 1, d)
    got = sdpa_at(tg.from_numpy(q, tiles), tg.from_numpy(k, (1, 1, 4, d)), tg.from_numpy(v, (1, 1, 4, d)),
                  tg.from_numpy(np.array([p]))).numpy()
    kt, vt = (torch.tensor(a[:, :, :p + 1]).repeat_interleave(h // hkv, dim=1) for a in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(torch.tensor(q), kt, vt).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_rope_at_equals_rope_at_that_offset(rng):
    x = rng.standard_normal((2, 3, 1, 8))
    got = rope_at(tg.from_numpy(x, (1, 2, 1, 8)), tg.from_numpy(np.array([37])), 500.0).numpy()
    np.testing.assert_array_equal(got, rope(tg.from_numpy(x, (1, 2, 1, 8)), 500.0, position_offset=37).numpy())


def test_kv_cache_write_places_positions_and_refuses_one_outside_its_tile():
    new = tg.from_numpy(np.ones((1, 2, 1, 3)), (1, 1, 1, 3))
    past = kv_cache_write(None, new, tg.from_numpy(np.array([0])), 0, 4)
    assert past.chunks[2] == (4,)
    two = kv_cache_write(past, new * 2.0, tg.from_numpy(np.array([1])), 1, 4)
    assert two.chunks[2] == (4,)                                   # the same tile, one more row
    np.testing.assert_array_equal(two.numpy()[0, :, :, 0], [[1, 2, 0, 0]] * 2)
    with pytest.raises(tg.TileError, match=r"a position in this cache tile \[0, 4\).*position 5"):
        kv_cache_write(past, new, tg.from_numpy(np.array([5])), 1, 4).numpy()
    with pytest.raises(tg.TileError, match=r"length in the last tile of past \[0, 4\].*7"):
        kv_cache_write(past, new, tg.from_numpy(np.array([7])), 7, 4)


def test_bad_input_is_a_clear_error():
    x = tg.from_numpy(np.ones((1, 1, 1, 2)))
    with pytest.raises(tg.TileError, match=r"position must be an int TileTensor of shape \(1,\).*float64 \(1,\)"):
        sdpa_at(x, x, x, tg.from_numpy(np.array([0.0])))
    with pytest.raises(tg.TileError, match=r"position must be an int TileTensor of shape \(1,\).*int64 \(2,\)"):
        rope_at(x, tg.from_numpy(np.array([0, 1])))
    with pytest.raises(tg.TileError, match=r"one sequence tile"):
        sdpa_at(tg.from_numpy(np.ones((1, 1, 2, 2)), (1, 1, 1, 2)), x, x, tg.from_numpy(np.array([0])))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.Decoder\] replay must be a bool.*'yes'"):
        Decoder(models.build("gpt2-debug"), replay="yes")
