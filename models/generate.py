"""Text generation with a KV cache: greedy decoding, top-k and top-p (nucleus) sampling, a
repetition penalty and stop strings; prompts of different lengths padded to one with their
``attention_mask``, and the log-probabilities of the new tokens (``return_scores``).

The prompt runs once (prefill) and leaves every layer's keys and values in a cache of leaf tiles;
each new token then runs a one-position forward that attends to the cache and appends its own
keys and values (:class:`Decoder`). The cache tiles stay where they were computed: with a runtime
connected they are references to values on the workers, and only the logits of the last position
come back to the client, where the next token is picked (:func:`next_tokens`). :func:`generate`
on a cluster of CPU workers runs that whole loop as one task on a worker instead, which saves a
Dask round trip per token.

>>> import numpy as np
>>> from tilegraph import models
>>> model = models.build("gpt2-debug", seed=0)
>>> prompt = np.array([[1, 2, 3], [4, 5, 6]])
>>> generate(model, prompt, 4).shape
(2, 7)
>>> generate(model, prompt, 4, strategy="top_p", top_p=0.9, temperature=0.8, seed=1).shape
(2, 7)
>>> from tilegraph.io import ByteTokenizer
>>> out = generate(model, prompt, 4, repetition_penalty=1.3, stop=["\\n"], tokenizer=ByteTokenizer(), pad_id=0)
>>> out.shape
(2, 7)
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from tilegraph._autograd import no_grad
from tilegraph._errors import TileError
from tilegraph._graph import to_host
from tilegraph._lower import Executable
from tilegraph._remote import NotPicklable, check_model_reachable, lend_model, lent_all, own_futures, put_back, run_on_a_worker
from tilegraph._tensor import TileTensor, from_numpy
from tilegraph.nn import training
from tilegraph.runtime import Runtime, current_runtime

from ._common import CausalLM

__all__ = ["generate", "next_tokens", "penalize_repetition", "find_stop", "Decoder", "STRATEGIES"]

#: "greedy" takes the most likely token (and no top_k, top_p or temperature other than 1);
#: "sample" draws from softmax(logits / temperature),
#: restricted to the ``top_k`` most likely tokens and then to the smallest set holding ``top_p``
#: of the probability when those are given; "top_k" and "top_p" are "sample" with that one filter.
STRATEGIES = ("greedy", "sample", "top_k", "top_p")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_sampling(where: str, strategy, temperature, top_k, top_p) -> None:
    if strategy not in STRATEGIES:
        raise TileError(where, f"strategy must be one of {', '.join(map(repr, STRATEGIES))}", repr(strategy))
    if strategy == "greedy" and (top_k is not None or top_p is not None):
        raise TileError(where, "greedy decoding takes no top_k or top_p (use strategy='sample', 'top_k' or "
                        "'top_p')", f"top_k={top_k!r}, top_p={top_p!r}")
    if strategy == "top_k" and (top_k is None or top_p is not None):
        raise TileError(where, "strategy='top_k' needs top_k and no top_p (strategy='sample' combines both)",
                        f"top_k={top_k!r}, top_p={top_p!r}")
    if strategy == "top_p" and (top_p is None or top_k is not None):
        raise TileError(where, "strategy='top_p' needs top_p and no top_k (strategy='sample' combines both)",
                        f"top_k={top_k!r}, top_p={top_p!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise TileError(where, "top_k must be an int >= 1", repr(top_k))
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating))
                              or not 0 < top_p <= 1):
        raise TileError(where, "top_p must be a number in (0, 1]", repr(top_p))
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not 0 < temperature < np.inf:
        raise TileError(where, "temperature must be a positive finite number" + (
            " (for the most likely token, as transformers' do_sample=False: strategy='greedy', the default)"
            if not isinstance(temperature, bool) and temperature == 0 else ""), repr(temperature))
    # the most likely token is the same at any temperature: greedy decoding would ignore one, as it
    # would top_k and top_p (and as `tilegraph generate --temperature` is refused with greedy)
    if strategy == "greedy" and temperature != 1:
        raise TileError(where, "greedy decoding takes no temperature other than the default 1 (the most likely "
                        "token, whatever the temperature; use strategy='sample', 'top_k' or 'top_p' to sample with "
                        "one)", f"temperature={temperature!r}")


def _check_penalty(where: str, penalty) -> None:
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float, np.floating)) or not 0 < penalty < np.inf:
        raise TileError(where, "repetition_penalty must be a positive finite number (1: none)", repr(penalty))


def _penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """``logits`` (B, V) with the entries where ``seen`` (B, V) is True made less likely."""
    hit = np.where(logits > 0, logits / penalty, logits * penalty)
    return np.where(seen, hit, logits).astype(logits.dtype, copy=False)


def penalize_repetition(logits, ids, penalty: float) -> np.ndarray:
    """``logits`` (B, V) with every token that occurs in its row of ``ids`` (B, T) penalised as
    Hugging Face's ``repetition_penalty`` (CTRL, Keskar et al. 2019) does: a positive logit is
    divided by ``penalty``, a negative one multiplied by it, once however often the token
    occurs. ``penalty > 1`` discourages repeats, ``1`` changes nothing, below 1 encourages them.

    >>> penalize_repetition(np.array([[2.0, -2.0, 1.0]]), np.array([[0, 1, 0]]), 2.0)
    array([[ 1., -4.,  1.]])
    """
    where = "tilegraph.models.generate.penalize_repetition"
    _check_penalty(where, penalty)
    logits, ids = np.asarray(logits), np.asarray(ids)
    if logits.ndim != 2 or logits.dtype.kind != "f":
        raise TileError(where, "logits must be floats of shape (batch, vocab)", f"{logits.dtype} {logits.shape}")
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[0] != logits.shape[0]:
        raise TileError(where, f"ids must be integers of shape (batch={logits.shape[0]}, seq)",
                        f"{ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= logits.shape[1]):
        raise TileError(where, f"ids must lie in [0, vocab={logits.shape[1]})", f"min {ids.min()}, max {ids.max()}")
    seen = np.zeros(logits.shape, dtype=bool)
    np.put_along_axis(seen, ids.astype(np.int64), True, axis=1)
    return _penalize(logits, seen, float(penalty))


def find_stop(text: str, stop) -> int | None:
    """Where ``text`` ends if cut after the first of the ``stop`` strings (one string or a list
    of them, as :func:`generate` takes; None: none) to be completed in it (the stop string
    kept), or None when none occurs.

    >>> find_stop("x = 1\\n\\ny = 2\\n", ["\\n\\n", "y"])
    7
    >>> find_stop("x = 1\\ny\\n\\n", "\\n\\n")   # one string is one stop string, not its characters
    9
    >>> find_stop("x = 1", ["\\n"]) is None
    True
    """
    where = "tilegraph.models.generate.find_stop"
    if not isinstance(text, str):
        raise TileError(where, "text must be a str (tokenizer.decode's)", type(text).__name__)
    if stop is None:
        return None
    stops = _as_stops(where, stop)
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


def _as_stops(where: str, stop) -> tuple[str, ...]:
    """``stop`` (a string or a list of them) as a tuple of non-empty strings. A bare string is
    one stop string: iterated, it would be its characters, each a stop string of its own."""
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise TileError(where, "stop must be a non-empty string or a list of them", repr(stop))
    return tuple(stops)


def _continuation(tokenizer, prompt_ids, new_ids, prompt_text: str | None = None) -> str:
    """The text ``new_ids`` add after ``prompt_ids``: the two decoded together, less the text of
    the prompt (``prompt_text``, decoded here when None). Tokenizers that put a word's leading
    space on its token (SentencePiece's "▁", Llama's) drop that space at the start of a text:
    decoded alone, new ids that begin a word would lose the space between the prompt and them.
    Where the prompt's text is not a prefix of the whole, the new ids are decoded alone."""
    if prompt_text is None:
        prompt_text = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(np.concatenate([np.asarray(prompt_ids), np.asarray(new_ids)]))
    if whole.startswith(prompt_text):
        return whole[len(prompt_text):]
    return tokenizer.decode(new_ids)


def _check_stop(where: str, stop, tokenizer, fill) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = _as_stops(where, stop)
    if stops and not callable(getattr(tokenizer, "decode", None)):
        raise TileError(where, "stop strings need the tokenizer that decodes the ids (tokenizer=...)",
                        f"tokenizer={tokenizer!r}")
    if stops and fill is None:
        raise TileError(where, "stop strings need eos_id or pad_id: the id that fills a row after it stopped",
                        "eos_id=None, pad_id=None")
    return stops


def next_tokens(logits, rng: np.random.Generator, *, strategy: str = "greedy", temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None) -> np.ndarray:
    """Pick one token per row of ``logits`` (B, V); returns (B,) int64.

    Sampling follows Hugging Face's order: scale by 1 / temperature, keep the ``top_k`` best
    tokens, then keep the best tokens until their probability reaches ``top_p`` (a token is kept
    when the tokens better than it hold less than ``top_p``, so the best one always is), and draw
    from what is left, renormalised, with one ``rng.random()`` per row. Tokens tied with the
    ``top_k``-th best are kept too (as transformers' ``top_k``); otherwise ties rank by token id
    (greedy's pick, top_p's cut). A logit of -inf (a token masked out) is never picked.

    >>> rng = np.random.default_rng(0)
    >>> next_tokens(np.array([[0.0, 3.0, 1.0]]), rng)
    array([1])
    >>> next_tokens(np.log([[0.5, 0.3, 0.2]]), rng, strategy="top_p", top_p=0.5)   # only token 0 is kept
    array([0])
    """
    where = "tilegraph.models.generate.next_tokens"
    _check_sampling(where, strategy, temperature, top_k, top_p)
    if strategy != "greedy" and not isinstance(rng, np.random.Generator):  # (greedy draws nothing)
        raise TileError(where, "rng must be a numpy.random.Generator (np.random.default_rng(seed)) to sample",
                        f"{type(rng).__name__} {rng!r:.60}")
    return _pick(_checked_logits(where, logits), rng, strategy, temperature, top_k, top_p)[0]


def _checked_logits(where: str, logits) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0 or logits.dtype.kind != "f":
        raise TileError(where, "logits must be floats of shape (batch, vocab)", f"{logits.dtype} {logits.shape}")
    bad = np.isnan(logits) | (logits == np.inf)   # -inf is a token masked out: never picked (as transformers')
    if bad.any():
        raise TileError(where, "logits must be finite or -inf (a token masked out)",
                        f"{int(bad.sum())} entries are NaN or +inf")
    if (logits == -np.inf).all(axis=-1).any():
        raise TileError(where, "logits with at least one token not masked out (-inf) in each row",
                        f"rows {np.flatnonzero((logits == -np.inf).all(axis=-1)).tolist()} all -inf")
    return logits


def _pick(logits: np.ndarray, rng: np.random.Generator, strategy: str, temperature: float, top_k: int | None,
          top_p: float | None, scores: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`next_tokens`'s tokens (B,), and with ``scores`` the log-probability (B,) of each
    under the distribution it was picked from (else None): the softmax of the logits for greedy
    decoding, the filtered and renormalised one when sampling (transformers'
    ``compute_transition_scores`` with ``normalize_logits=True``)."""
    if strategy == "greedy":
        tok = np.argmax(logits, axis=-1).astype(np.int64)
        if not scores:   # (a softmax over the vocabulary a token: not for nothing)
            return tok, None
        z = logits.astype(np.float64)
        best = np.take_along_axis(z, tok[:, None], axis=-1)
        with np.errstate(under="ignore"):
            return tok, -np.log(np.exp(z - best).sum(axis=-1))
    # the best logit made 0 before the division: logits / a tiny temperature could overflow to
    # inf, and inf - inf below is NaN, which picked a token at random instead of the best one
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # a logit far below the best is -inf: probability 0, as it should be
        z = (z - z.max(axis=-1, keepdims=True)) / float(temperature)
    order = np.argsort(-z, axis=-1, kind="stable")             # best first; ties by token id
    zs = np.take_along_axis(z, order, axis=-1)
    p = np.exp(zs - zs[:, :1])
    if top_k is not None and top_k < p.shape[1]:   # the k best, and any tied with the k-th (as transformers')
        p[:, top_k:][zs[:, top_k:] < zs[:, top_k - 1:top_k]] = 0.0
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        before = np.cumsum(p, axis=-1) - p                     # mass of the better tokens
        p[before >= top_p] = 0.0
        p /= p.sum(axis=-1, keepdims=True)
    # Kept tokens are a prefix of ``order``; pick by the inverse of the cumulative distribution.
    c = np.cumsum(p, axis=-1)
    u = rng.random(len(p))[:, None] * c[:, -1:]
    pick = np.minimum((c <= u).sum(axis=-1), (p > 0).sum(axis=-1) - 1)
    with np.errstate(divide="ignore"):
        logp = np.log(np.take_along_axis(p, pick[:, None], axis=-1)[:, 0])
    return np.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(np.int64), logp


def _check_eos(where: str, eos_id, vocab: int) -> tuple[int, ...]:
    """``eos_id`` (None, an id, or a non-empty list of ids as Hugging Face's ``eos_token_id``) as
    a tuple of ids, checked against the model's ``vocab``."""
    if eos_id is None:
        return ()
    if isinstance(eos_id, np.ndarray) and eos_id.ndim == 1:   # (a tensor's .numpy(), as transformers' takes)
        eos_id = eos_id.tolist()
    ids = list(eos_id) if isinstance(eos_id, (list, tuple)) else [eos_id]
    if not ids or not all(_is_int(i) and 0 <= i < vocab for i in ids):
        raise TileError(where, f"eos_id must be None or a token id in [0, {vocab}) (or a non-empty list of them)",
                        repr(eos_id))
    return tuple(dict.fromkeys(int(i) for i in ids))


def _warn_if_padded(where: str, prompt: np.ndarray, pad_id: int) -> None:
    """Warn where the rows of ``prompt`` (B, P) start or end with runs of ``pad_id`` of different
    lengths: a batch of prompts padded to one length (a tokenizer's ``padding=True``), which
    generate, without ``attention_mask``, reads as text of the prompts: the continuation of a
    padded row is not its prompt's (transformers' generate masks the padding)."""
    pads = prompt == pad_id
    lead = np.cumprod(pads, axis=1).sum(axis=1)
    trail = np.cumprod(pads[:, ::-1], axis=1).sum(axis=1)
    if len(set(lead.tolist())) > 1 or len(set(trail.tolist())) > 1:
        import warnings

        rows = np.flatnonzero((lead != lead.min()) | (trail != trail.min())).tolist()
        warnings.warn(f"[{where}] prompt rows {rows} start or end with more pad_id={pad_id} tokens than others: a "
                      "batch padded to one length? Without attention_mask generate reads padding as prompt text, "
                      "which changes the continuation: pass the tokenizer's attention_mask= (as to transformers' "
                      "generate), or generate prompts of different lengths one call each",
                      stacklevel=3)


def _pickable(tokenizer, vocab: int, eos_ids: tuple[int, ...]) -> np.ndarray | None:
    """The ids :func:`generate` may pick (None: all ``vocab`` of them). A model's vocabulary may
    be larger than its tokenizer's (a padded one, an --init model on a smaller tokenizer): the
    ids past the tokenizer's are ids it cannot decode, and are left out, but for the ``eos_ids``
    given. The tokenizer's size is its ``vocab_size`` or, where larger, its ``len()``:
    transformers' tokenizers leave their added tokens out of ``vocab_size`` (a Qwen chat model's
    ``<|im_end|>``, a Llama 3's ``<|eot_id|>``), and with one given for its stop strings a row
    never picked its end-of-text token and ran on to ``max_new_tokens``."""
    sizes = [getattr(tokenizer, "vocab_size", None)]
    if tokenizer is not None:
        try:
            sizes.append(len(tokenizer))
        except TypeError:  # no len(): tilegraph's own tokenizers
            pass
    sizes = [int(n) for n in sizes if _is_int(n) and n > 0]
    size = max(sizes, default=vocab)
    if size >= vocab:
        return None
    return np.concatenate([np.arange(size), [i for i in eos_ids if i >= size]]).astype(np.int64)


def _check_runtime(where: str, runtime) -> None:
    if runtime is not None and not isinstance(runtime, Runtime):  # else an AttributeError (scatter_cells)
        raise TileError(where, "runtime must be a tilegraph Runtime (tilegraph.connect()) or None",
                        type(runtime).__name__)
    if runtime is not None:  # a closed one's client fails with Dask's own errors, naming no argument
        runtime.require_open(where)


def _check_cache_block(where: str, cache_block) -> None:
    """Here, before anything runs: on a worker (generate's loop as one task) nn.KVCache's own
    check came back as a page of Dask's worker log and an error naming tilegraph.nn.KVCache."""
    if not _is_int(cache_block) or cache_block < 1:
        raise TileError(where, "cache_block must be an int >= 1 (the rows of each KV cache tile)",
                        f"cache_block={cache_block!r}")


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector held off for one decoding step (then back as it was).
    Recording and planning a step allocate tens of thousands of short-lived objects, freed by
    reference counting, but each 700 allocations start a collection: GPT-2 124M decoded 3-5 ms
    per token (about 10%) faster on 2 cores without them. The step's few reference cycles wait
    for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _LogitsLayout:
    """Where the last position's logits (B, V) lie in the values of a step's first roots."""

    def __init__(self, logits, grid_shape):
        self.grid_shape = grid_shape
        self.n = math.prod(grid_shape)
        self.shape = (logits.shape[0], logits.shape[2])
        self.dtype = logits.dtype
        self.b_offs, self.v_offs = logits.tiling.offsets(0), logits.tiling.offsets(2)

    def gather(self, values) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        for (i, j), val in zip(np.ndindex(*self.grid_shape), values[:self.n]):
            tile = to_host(val)                                             # (b, t, v) of the last seq tile
            out[self.b_offs[i]:self.b_offs[i] + tile.shape[0], self.v_offs[j]:self.v_offs[j] + tile.shape[2]] = tile[:, -1]
        return out


@dataclass
class _Step:
    """A recorded one-position step that runs again for the next positions of its cache tile."""

    exe: Executable
    ids: TileTensor          # the leaves its token ids are set into
    position: TileTensor     # the leaf its position is set into
    cells: list              # per layer, the cache tiles it reads and writes (KVCache.rewritten_cells)
    logits: _LogitsLayout
    next: int                # the position it runs for next
    end: int                 # the end of its cache tile: positions up to here fit


class Decoder:
    """Runs a model over successive chunks of token ids, each attending to all earlier ones
    through a per-layer KV cache; returns the logits of each chunk's last position.

    With a runtime (``runtime`` or the current one) the model's parameters still on the client
    are lent to the workers (sent at the first Decoder or :func:`generate` on that runtime, and
    kept there for the next ones while each parameter holds the same array: see
    :func:`tilegraph._train.lend_cells`), and the client's values are put back on :meth:`close`
    (use ``with``); the cache
    tiles stay on the workers as references (:attr:`cache`), and only the last position's
    logits are fetched. Without one, everything runs on Dask's local scheduler. ``cache_block``:
    the rows of each cache tile that positions after the prompt's go into (at most the model's
    ``max_seq_len``: no tile holds more).

    >>> import numpy as np
    >>> from tilegraph import models
    >>> model = models.build("llama-debug", seed=0)
    >>> with Decoder(model) as dec:
    ...     first = dec.feed(np.array([[1, 2, 3]]))    # prefill: the prompt, once
    ...     second = dec.feed(np.array([[4]]))         # one more position against the cache
    ...     print(second.shape, dec.length)
    (1, 128) 4
    """

    def __init__(self, model: CausalLM, *, runtime=None, cache_block: int = 64, replay: bool = True):
        where = "tilegraph.models.Decoder"
        if not isinstance(model, CausalLM):
            raise TileError(where, "model must be a tilegraph.models model (GPT2, Llama)", type(model).__name__)
        _check_runtime(where, runtime)
        _check_cache_block(where, cache_block)
        if not isinstance(replay, (bool, np.bool_)):
            raise TileError(where, "replay must be a bool", repr(replay))
        self.model = model
        self.runtime = runtime if runtime is not None else current_runtime()
        # before anything is submitted: the decoding task, reading another client's futures, was
        # cancelled by Dask ("lost dependencies"), which read as a lost worker; quantized weights too
        check_model_reachable(where, model, self.runtime)
        # a tile never holds more than max_seq_len positions: a cache_block above it (a cache size
        # meant, as transformers' max_cache_len) allocated zeros that are never written (10**6 rows
        # took 6.4 s and 1.2 GB for 20 gpt2-debug tokens, 10**8 would take 13 GB a tile)
        self.cache = model.new_cache(min(int(cache_block), model.config.max_seq_len))
        self.batch: int | None = None
        #: whether one-position steps run a recorded step again (see :meth:`feed`)
        self.replay = bool(replay)
        #: the executable of the last :meth:`feed` (to inspect its graph and tasks)
        self.last_executable: Executable | None = None
        #: how many :meth:`feed` calls ran a recorded step again instead of recording one
        self.replayed = 0
        self._step: _Step | None = None
        self._restore = lend_model(model, self.runtime) if self.runtime is not None else []

    @property
    def length(self) -> int:
        """Positions fed so far."""
        return self.cache[0].length

    def feed(self, ids) -> np.ndarray:
        """Run ``ids`` (B, T) after the positions fed before; returns the logits (B, V) of the
        token that follows ``ids``' last position.

        One position at a time (T = 1, decoding) the step's graph holds its position in a tile and
        the cache's last tile has room for ``cache_block`` rows: the graph recorded and planned
        for one position runs again, with new values in its leaves, for the next positions of that
        cache tile (recording and planning were about half of a GPT-2 124M token's time); with
        ``replay=False`` every call records and plans its own graph."""
        where = "tilegraph.models.Decoder.feed"
        ids = np.asarray(ids)
        vocab = self.model.config.vocab_size
        if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise TileError(where, "ids must be integers of shape (batch, seq), both at least 1",
                            f"{ids.dtype} array of shape {ids.shape}")
        if self.batch is not None and ids.shape[0] != self.batch:
            raise TileError(where, f"every chunk must hold the batch of the first one ({self.batch} rows)",
                            f"{ids.shape[0]} rows")
        if ids.min() < 0 or ids.max() >= vocab:
            raise TileError(where, f"token ids must lie in [0, vocab_size={vocab})",
                            f"min {ids.min()}, max {ids.max()}")
        ids = ids.astype(np.int64)
        step = self._step
        if step is not None and ids.shape[1] == 1 and self.length == step.next < step.end:
            return self._replay(step, ids)
        self._step = None
        at = self.replay and ids.shape[1] == 1 and self.length > 0
        saved = [(c.k, c.v, c._written) for c in self.cache]
        try:
            with no_grad(), training(False), _collector_paused():
                tiled = self.model.tiling.tile_ids(ids)
                if at:   # the position in a tile of its own (see above)
                    position = from_numpy(np.array([self.length], dtype=np.int64))
                    for c in self.cache:
                        c.position = position
                logits = self.model(tiled, cache=self.cache)                   # (B, T, V)
                last = logits.grid[:, -1, :]                                    # (B tiles, V tiles)
                pending = [c.pending() for c in self.cache]
                exe = Executable(list(last.flat) + [r for p in pending for r in p], runtime=self.runtime)
                values = exe.run(fetch=range(last.size), lost=self._lost())
        except BaseException:
            for c, (k, v, written) in zip(self.cache, saved):   # a failed step leaves the cache as it was
                c.k, c.v, c._written = k, v, written
            raise
        finally:
            for c in self.cache:
                c.position = None
        self.last_executable = exe
        self.batch = ids.shape[0]
        layout = _LogitsLayout(logits, last.shape)
        out = layout.gather(values)
        k = last.size
        cells = [c.rewritten_cells() for c in self.cache] if at else [None]
        if all(cs is not None for cs in cells):   # the step can run again for the next positions
            for c, cs in zip(self.cache, cells):
                c.store_into(cs, values[k:k + len(cs)])
                k += len(cs)
            self._step = _Step(exe, tiled, position, cells, layout, self.length,
                               self.cache[0].k.shape[2])
        else:
            for c, p in zip(self.cache, pending):
                c.store(values[k:k + len(p)])
                k += len(p)
        if self.runtime is not None:
            self._own_futures()
        return out

    def _replay(self, step: "_Step", ids: np.ndarray) -> np.ndarray:
        """Run ``step`` again for one more position (see :meth:`feed`): new ids and position in its
        leaves, and the cache tiles it wrote last time in place of those it read."""
        self.model._ids(step.ids, self.length)   # the max_seq_len check the recording made
        for idx, ref in zip(np.ndindex(*step.ids.tiling.grid), step.ids.grid.flat):
            ref.node.cell.set(ids[step.ids.tiling.slices(idx)])
        step.position.grid[0].node.cell.set(np.array([self.length], dtype=np.int64))
        with _collector_paused():
            values = step.exe.run(fetch=range(step.logits.n), lost=self._lost())
        k = step.logits.n
        for c, cs in zip(self.cache, step.cells):   # (only now: a failed step leaves the cache as it was)
            c.advance(cs, values[k:k + len(cs)])
            k += len(cs)
        step.next = self.length
        self.last_executable = step.exe
        self.replayed += 1
        if self.runtime is not None:
            self._own_futures()
        return step.logits.gather(values)

    def _lost(self) -> dict:
        """The ``where`` and ``hint`` of the error for a worker lost during a decoding step."""
        return {"where": "tilegraph.models.Decoder", "hint": _lost_hint(self.model, self._restore)}

    def _own_futures(self) -> None:
        """Give each finished cache tile a future of its own.

        A value left on the workers is an element of its fused task's result tuple, which keeps
        the task's other outputs (activations of the prefill, say) alive while it is referenced.
        Every tile but the last along the sequence is final (only the last one grows), so those
        get their own small future and the tuple can go.
        """
        own_futures(self.runtime, [ref.node.cell for c in self.cache for t in (c.k, c.v) for ref in t.grid[:, :, :-1].flat])

    def close(self) -> None:
        """Drop the cache and put back the parameter values that were on the client."""
        self.cache = self.model.new_cache(self.cache[0].block)
        self._step = None
        self.batch = None  # the empty cache takes a batch of any size again
        put_back(self._restore)
        self._restore = []

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate(model: CausalLM, prompt_ids, max_new_tokens: int, *, strategy: str = "greedy",
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             repetition_penalty: float = 1.0, seed=0, eos_id: int | list[int] | None = None, stop=None,
             tokenizer=None, pad_id: int | None = None, attention_mask=None, return_scores: bool = False,
             runtime=None, cache_block: int = 64):
    """Continue each prompt (B, P) by ``max_new_tokens`` tokens; returns the ids (B, P + N), int64
    (a 1-D prompt is one row).

    ``attention_mask`` (B, P) of 1s and 0s, a tokenizer's for a batch padded to one length
    (``padding=True``, left or right), marks each row's prompt: its 1s, which must be one run;
    the 0s are padding, never read. Each row then continues its prompt as if it were generated
    alone (transformers' ``generate`` with ``attention_mask``): rows of one prompt length decode
    together, one batch after another (sampling draws from one ``rng`` across them). The ids
    come back as given, padding included, followed by the N new ones (``out[:, P:]``, as
    transformers' layout); the longest prompt plus N must fit ``max_seq_len``.

    ``return_scores=True`` returns ``(ids, scores)``: ``scores`` (B, N) float64 holds the
    natural log-probability of each new token under the distribution it was picked from (the
    softmax of the logits, after ``repetition_penalty``; when sampling, after ``temperature``,
    ``top_k`` and ``top_p`` too, renormalised), as transformers'
    ``compute_transition_scores(out.sequences, out.scores, normalize_logits=True)``; 0 at the
    positions after a row ended (their ``pad_id``). ``scores.sum(axis=1)`` is each continuation's
    log-likelihood. (With a ``tokenizer`` of fewer ids than the model's, below, the softmax is
    over the ids that may be picked.)

    ``strategy`` is one of :data:`STRATEGIES` ("greedy", "sample", "top_k", "top_p"; see
    :func:`next_tokens` for ``temperature``, ``top_k`` and ``top_p``). Sampling draws from
    ``np.random.default_rng(seed)`` on the client, so the same seed gives the same tokens.
    ``repetition_penalty`` (Hugging Face's, 1: none) applies :func:`penalize_repetition` with
    the row's prompt and the tokens generated so far before any other step, for every strategy.

    A row ends when it produces ``eos_id`` (that token kept; a list of ids, as Hugging Face's
    ``eos_token_id`` of a Llama 3 chat model: any of them), or when the text its new tokens
    add after the prompt's (``tokenizer.decode`` of both, less the prompt's text; the prompt is
    not searched) contains one of the ``stop`` strings (a string or a list). A stopped row
    keeps the token that completed the stop string, so its text holds the stop string whole,
    and may run past it by the rest of that token: ``text[:find_stop(text, stop)]`` cuts it
    right after the stop string (:func:`find_stop`).
    Later positions of an ended row hold ``pad_id`` (default ``eos_id``, the first of a list; stop
    strings need one of the two), and generation stops once all rows have ended (Hugging Face's
    ``generate`` with ``pad_token_id``, padded to full length). P + N may not exceed the model's
    ``max_seq_len``. ``runtime`` and ``cache_block``: see :class:`Decoder`; on a runtime whose
    workers are CPU workers, the loop runs as one task on the worker holding the most of the
    parameters (they gather there, when they take at most :data:`ONE_WORKER_MEMORY_SHARE` of its
    memory), with the same tokens as here. Parameters held here are lent to the workers: the copy
    sent at the first call stays there for the next calls while the parameter holds the same array
    (a parameter given a new value, by an optimizer step run here or ``load_state_dict``, is sent
    again), and is released with the model or the runtime. With a ``tokenizer``
    of fewer ids than the model's vocabulary, only ids it can decode are picked (and ``eos_id``):
    its ``vocab_size`` or, where larger, its ``len()`` (transformers' tokenizers count their added
    tokens, ``<|im_end|>`` say, only there).
    """
    where = "tilegraph.models.generate"
    if not isinstance(model, CausalLM):
        raise TileError(where, "model must be a tilegraph.models model (GPT2, Llama)", type(model).__name__)
    _check_sampling(where, strategy, temperature, top_k, top_p)
    _check_penalty(where, repetition_penalty)
    cfg = model.config
    if isinstance(prompt_ids, TileTensor):  # (as model(ids) takes them) its ids computed: NumPy's
        prompt_ids = prompt_ids.numpy()     # asarray of one raised, read as rows of different lengths
    if isinstance(prompt_ids, Mapping) and "input_ids" in prompt_ids:   # a tokenizer's BatchEncoding, whole
        raise TileError(where, "prompt_ids as token ids (B, P): a tokenizer's output goes in as "
                        "generate(model, enc['input_ids'], n, attention_mask=enc['attention_mask'])",
                        f"a {type(prompt_ids).__name__} with keys {sorted(prompt_ids)}")
    try:
        prompt = np.asarray(prompt_ids)
    except ValueError:  # rows of different lengths: NumPy's message names no argument
        lengths = [len(r) if hasattr(r, "__len__") else "a scalar" for r in prompt_ids]
        raise TileError(where, "prompt_ids rows of one length (a batch decodes its rows in step: pad the prompts to "
                        "one length and pass attention_mask=, as a tokenizer's padding=True gives both, or generate "
                        "prompts of different lengths one call each)", f"rows of lengths {lengths}") from None
    if prompt.ndim == 1:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.dtype.kind not in "iu" or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise TileError(where, "prompt_ids must be integers of shape (batch, prompt length), both at least 1",
                        f"{np.asarray(prompt_ids).dtype} array of shape {np.shape(prompt_ids)}")
    b, p = prompt.shape
    spans = _check_mask(where, attention_mask, prompt.shape)   # (start, length) of each row's prompt; None: all
    # (the padding is never read: a pad token added past the model's vocabulary, as a "[PAD]"
    # added to GPT-2's tokenizer, may fill it)
    read = prompt if spans is None else np.concatenate([prompt[r, s:s + n] for r, (s, n) in enumerate(spans)])
    if read.min() < 0 or read.max() >= cfg.vocab_size:
        raise TileError(where, f"token ids must lie in [0, vocab_size={cfg.vocab_size})",
                        f"min {read.min()}, max {read.max()}"
                        + (" (where the attention_mask marks the prompts)" if spans is not None else ""))
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise TileError(where, "max_new_tokens must be an int >= 0", repr(max_new_tokens))
    longest = p if spans is None else max(n for _, n in spans)
    if longest + max_new_tokens > cfg.max_seq_len:
        raise TileError(where, f"prompt and new tokens exceed the model's max_seq_len={cfg.max_seq_len}",
                        f"{longest} prompt + {max_new_tokens} new = {longest + max_new_tokens}"
                        + (" (the longest prompt the attention_mask marks)" if spans is not None else ""))
    eos_ids = _check_eos(where, eos_id, cfg.vocab_size)
    if pad_id is not None and (not _is_int(pad_id) or not 0 <= pad_id < cfg.vocab_size):
        raise TileError(where, f"pad_id must be None or a token id in [0, {cfg.vocab_size})", repr(pad_id))
    fill = (eos_ids[0] if eos_ids else None) if pad_id is None else int(pad_id)  # HF: pad_token_id or eos[0]
    if pad_id is not None and b > 1 and attention_mask is None:
        _warn_if_padded(where, prompt, int(pad_id))
    stops = _check_stop(where, stop, tokenizer, fill)
    _check_runtime(where, runtime)
    _check_cache_block(where, cache_block)
    try:
        rng = np.random.default_rng(seed)
    except (TypeError, ValueError):  # a negative int, a float, ...: NumPy's message names no argument
        raise TileError(where, "seed must be None, an int >= 0 or what else np.random.default_rng takes "
                        "(a SeedSequence, a Generator)", repr(seed)) from None
    if not isinstance(return_scores, (bool, np.bool_)):
        raise TileError(where, "return_scores must be a bool", repr(return_scores))
    out = np.empty((b, p + max_new_tokens), dtype=np.int64)
    out[:, :p] = prompt
    scores = np.zeros((b, max_new_tokens))
    if max_new_tokens == 0:
        return (out, scores) if return_scores else out
    loop = _Loop(max_new_tokens, strategy, temperature, top_k, top_p, float(repetition_penalty), eos_ids, fill,
                 stops, tokenizer, _pickable(tokenizer, cfg.vocab_size, eos_ids), cache_block, bool(return_scores))
    runtime = runtime if runtime is not None else current_runtime()
    check_model_reachable(where, model, runtime)  # before anything is submitted
    if spans is None:
        out, scores = _run(runtime, model, loop, out, rng)
    else:  # each row its prompt alone (its mask's run of 1s); rows of one prompt length as one batch
        for n in dict.fromkeys(n for _, n in spans):
            rows = [r for r, (_, m) in enumerate(spans) if m == n]
            part = np.empty((len(rows), n + max_new_tokens), dtype=np.int64)
            part[:, :n] = [prompt[r, spans[r][0]:spans[r][0] + n] for r in rows]
            done, scores[rows] = _run(runtime, model, loop, part, rng)
            out[rows, p:] = done[:, n:]
    return (out, scores) if return_scores else out


def _run(runtime, model: CausalLM, loop: "_Loop", out: np.ndarray,
         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``loop`` filling ``out`` (prompts of one length): as one task on a worker where it can,
    else here; ``out`` and its scores."""
    if runtime is not None:
        done = _decode_on_a_worker(runtime, model, loop, out, rng)
        if done is not None:
            return done
    return loop.run(model, out, rng, runtime)


def _check_mask(where: str, mask, shape: tuple) -> list[tuple[int, int]] | None:
    """The (start, length) of each row's prompt that ``mask`` (B, P) marks with a run of 1s
    (a tokenizer's ``attention_mask``, its padding on either side); None where it marks every
    position, or is None."""
    if mask is None:
        return None
    if isinstance(mask, TileTensor):
        mask = mask.numpy()
    try:
        m = np.asarray(mask)
    except ValueError:
        m = np.asarray(None)
    if m.ndim == 1 and len(shape) == 2 and shape[0] == 1:
        m = m[None]
    if m.shape != shape or m.dtype.kind not in "biuf" or not np.isin(m, (0, 1)).all():
        raise TileError(where, f"attention_mask must be 1s (prompt) and 0s (padding) of prompt_ids' shape {shape}",
                        f"{m.dtype} array of shape {m.shape}" if m.dtype.kind in "biuf" and m.shape != shape
                        else repr(mask) if m.dtype.kind not in "biuf" else f"values {np.unique(m)[:6].tolist()}")
    m = m.astype(bool)
    if m.all():
        return None
    spans = []
    for r, row in enumerate(m):
        on = np.flatnonzero(row)
        if on.size == 0 or on[-1] - on[0] + 1 != on.size:
            raise TileError(where, "attention_mask rows of one run of 1s each (the prompt), with 0s only before it "
                            "(left padding) or after it (right padding)",
                            f"row {r}: {row.astype(int).tolist()}")
        spans.append((int(on[0]), int(on.size)))
    return spans


@dataclass
class _Loop:
    """:func:`generate`'s decoding loop and its settings (checked), to run here or as one task
    on a worker (:func:`_decode_on_a_worker`)."""
    new: int
    strategy: str
    temperature: float
    top_k: int | None
    top_p: float | None
    penalty: float
    eos_ids: tuple[int, ...]
    fill: int | None
    stops: tuple
    tokenizer: object
    picks: np.ndarray | None   # the ids that may be picked (:func:`_pickable`; None: all)
    cache_block: int
    scores: bool = False       # whether run() computes the new ids' scores (else zeros)

    def run(self, model: CausalLM, out: np.ndarray, rng: np.random.Generator,
            runtime, stopped: Callable[[], bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Fill ``out``'s columns after the prompt (those before it), drawing from ``rng``; with
        ``runtime`` None, on Dask's local scheduler in this process. Returns ``out`` and the
        scores (B, N) of its new ids (see :func:`generate`'s ``return_scores``). ``stopped()``
        true before a token: stop there (a worker's task that the client cancelled)."""
        max_new_tokens, fill, eos_ids, stops, tokenizer = self.new, self.fill, self.eos_ids, self.stops, self.tokenizer
        b, p = out.shape[0], out.shape[1] - max_new_tokens
        prompt = out[:, :p]
        rows = np.arange(b)
        done = np.zeros(b, dtype=bool)
        seen = np.zeros((b, model.config.vocab_size), dtype=bool)   # (B, V): tokens the penalty applies to
        scores = np.zeros((b, max_new_tokens))
        seen[rows[:, None], prompt] = True
        # the text a row's new tokens add is decoded after its prompt's (see _continuation)
        prompt_texts = [tokenizer.decode(row) for row in prompt] if stops else []
        with Decoder(model, runtime=runtime, cache_block=self.cache_block) as dec:
            logits = dec.feed(prompt)
            for i in range(max_new_tokens):
                if stopped is not None and stopped():
                    break
                if self.penalty != 1:
                    logits = _penalize(logits, seen, self.penalty)
                picks = self.picks   # (ids the tokenizer cannot decode are never picked)
                tok, logp = _pick(_checked_logits("tilegraph.models.generate.next_tokens",
                                                  logits if picks is None else logits[:, picks]),
                                  rng, self.strategy, self.temperature, self.top_k, self.top_p, self.scores)
                if picks is not None:
                    tok = picks[tok]
                if done.any():
                    tok[done] = fill
                out[:, p + i] = tok
                if self.scores:
                    scores[:, i] = np.where(done, 0.0, logp)
                seen[rows, tok] = True
                if eos_ids:
                    done |= np.isin(tok, eos_ids)
                for r in np.flatnonzero(~done) if stops else ():
                    text = _continuation(tokenizer, prompt[r], out[r, p:p + i + 1], prompt_texts[r])
                    done[r] = find_stop(text, stops) is not None
                if done.all():
                    out[:, p + i + 1:] = fill
                    break
                if i + 1 < max_new_tokens:
                    logits = dec.feed(tok[:, None])
        return out, scores


#: the share of the smallest worker memory limit that a model's parameters may take for
#: :func:`generate` to decode on one worker (they gather there)
ONE_WORKER_MEMORY_SHARE = 0.5


def _decode_on_a_worker(runtime: Runtime, model: CausalLM, loop: _Loop, out: np.ndarray,
                        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`generate`'s loop as one task on a worker (the one holding the most of the model's
    parameters, which gather there), decoding on that worker's local scheduler: each token was a
    Dask round trip (submit, run, fetch the logits), about a third of a GPT-2 124M token's time
    and nine tenths of a gpt2-debug token's on an embedded cluster. The model travels pickled
    with its values as references (what the client still holds is lent first, see
    :func:`tilegraph._remote.lend_model`, and the client's values put back after), and ``rng``
    comes back with its state (:func:`tilegraph._remote.run_on_a_worker`).
    None where it cannot run so (GPU workers, whose kernels a local run would not use; parameters
    over :data:`ONE_WORKER_MEMORY_SHARE` of a worker's memory; a tokenizer that cannot be
    pickled): the caller then decodes with a round trip per token."""
    workers = runtime.snapshot()
    if workers.threads["gpu"]:
        return None
    limits = [m for a, m in workers.memory_limits.items() if a in workers.addrs["cpu"] and m]
    nbytes = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in model.parameters())
    if limits and nbytes > ONE_WORKER_MEMORY_SHARE * min(limits):
        return None
    restore = lend_model(model, runtime)
    try:
        done, scores, state = run_on_a_worker(
            runtime, functools.partial(_decode_task, loop), (model, out, rng), what="the decoding on a worker",
            where="tilegraph.models.generate", hint=_lost_hint(model, restore), cpu_resource=workers.cpu_resource,
            key="tg-generate")
    except NotPicklable:  # a tokenizer (for stop strings) that does not pickle, say: decode from here
        return None
    finally:
        put_back(restore)
    rng.bit_generator.state = state  # a Generator passed as seed goes on from there, as here
    return done, scores


def _lost_hint(model: CausalLM, restore: list) -> str:
    """What a worker lost while decoding took with it, and how to go on: whether ``restore``
    (:func:`tilegraph._remote.lend_model`) holds all of ``model``'s parameters (this process's
    own, only lent to the workers)."""
    if lent_all(model, restore):
        return ("the model's parameters are this process's own, only lent to the workers: generate "
                "can run again on the workers left")
    return ("the model's parameters that lived on that worker are gone: load the model again (tilegraph.models."
            "from_zarr, tilegraph.io.load_checkpoint) before generating")


def _decode_task(loop: _Loop, model: CausalLM, out: np.ndarray, rng: np.random.Generator,
                 stopped: Callable[[], bool]) -> tuple[np.ndarray, np.ndarray, dict]:
    """The worker's side of :func:`_decode_on_a_worker`: the decoded ids, their scores and the rng's state."""
    return (*loop.run(model, out, rng, None, stopped=stopped), rng.bit_generator.state)
