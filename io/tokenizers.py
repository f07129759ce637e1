"""Tokenizers: a built-in byte-level one and byte-level BPE trained offline with ``tokenizers``.

Both turn text into NumPy arrays of token ids in the smallest dtype that holds the vocabulary
(uint16 up to 65,536 ids, uint32 beyond), which is also the dtype of the token files that
:func:`tilegraph.io.build_token_file` writes. A tokenizer describes itself as a small JSON-able dict
(kind, vocabulary size, end-of-text id, a content hash for BPE) that token files record.

The Hugging Face ``tokenizers`` library is imported only when a BPE tokenizer is trained or loaded
(``pip install tilegraph[data]``). BPE tokenizers are saved and loaded as the library's JSON, never
pickled. :func:`hf_tokenizer_files` writes either tokenizer as the ``tokenizer.json`` and
``tokenizer_config.json`` that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads, to the
same ids (the byte tokenizer's JSON is written by hand: no library needed).

>>> from tilegraph.io import ByteTokenizer
>>> tok = ByteTokenizer()
>>> tok.encode("hé").tolist(), tok.decode(tok.encode("hé"))
([104, 195, 169], 'hé')
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import uuid
import warnings
from typing import Iterable, Sequence

import numpy as np

from tilegraph._errors import TileError

from ._store import user_path

__all__ = ["Tokenizer", "ByteTokenizer", "BPETokenizer", "Cut", "as_text", "token_dtype",
           "tokenizer_from_description", "hf_tokenizer_files"]

DEFAULT_EOS = "<|endoftext|>"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a ``vocab_size`` vocabulary fits (ids < 65,536), else uint32."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or not 0 < vocab_size <= 2**32:
        raise TileError("tilegraph.io.token_dtype", "vocabulary size must lie in [1, 2**32]", str(vocab_size))
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def as_text(text, where: str) -> str:
    """``text`` as a str that encodes to UTF-8: a str, or bytes that decode as UTF-8.

    Invalid UTF-8 is an error here rather than a raw Unicode exception later: bytes that do not
    decode, and str holding lone surrogates (what Python makes of non-UTF-8 bytes on a command
    line or in a file read with ``errors="surrogateescape"``).
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TileError(where, "text must be valid UTF-8; these bytes are not",
                            f"{raw[e.start:e.start + 4]!r} at byte {e.start} of {len(raw)} ({e.reason})") from None
    if not isinstance(text, str):
        raise TileError(where, "text must be a str (or UTF-8 bytes)", type(text).__name__)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start:e.end].encode("utf-8", errors="surrogateescape")
        raise TileError(where, "text must be valid UTF-8, but it holds undecodable bytes (lone surrogates)",
                        f"{text[e.start:e.end]!r} (bytes {raw!r}) at character {e.start} of {len(text)}") from None
    return text


class Tokenizer:
    """What token files need from a tokenizer: ``encode``, ``decode``, ``vocab_size``, ``eos_id``
    (None when there is no end-of-text token) and ``describe()``."""

    vocab_size: int
    eos_id: int | None
    #: the id that starts every encoded text (a Llama tokenizer's "<s>"), None when there is none
    bos_id: int | None = None
    #: where a long text may be cut and its parts encoded one by one, to the ids of the whole
    #: (what lets :func:`~tilegraph.io.build_token_file` read a file of gigabytes a block at a
    #: time): "any" (at any character), "space" (before an ASCII whitespace character that
    #: follows a character that is none), None (nowhere: the text is encoded whole)
    split_at: str | None = None
    #: where a long text may be cut when its parts go to :meth:`encode_parts`, which encodes the
    #: first part, the others and the end of the text each as the whole text's ids have them (a
    #: Llama tokenizer's "<s>" once, before the first): a :class:`Cut`, or None (nowhere but
    #: where ``split_at`` allows)
    cut: "Cut | None" = None

    def encode_parts(self, parts: Iterable[str]):
        """The ids of the text that ``parts`` make, an array a part: together those of
        ``encode("".join(parts))``, where the text was cut where :attr:`split_at` or :attr:`cut`
        allows. Here each part is encoded alone (what ``split_at`` promises)."""
        for part in parts:
            yield self.encode(part)

    @property
    def dtype(self) -> np.dtype:
        """Dtype of encoded ids and of token files made with this tokenizer."""
        return token_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, ids) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """Token ids are the UTF-8 bytes of the text (vocabulary 256), plus id 256 as an end-of-text
    token when ``eos=True``. Lossless for any text: ``decode(encode(s)) == s``.

    ``decode`` drops the end-of-text token and replaces bytes that do not form UTF-8 (a window cut
    inside a multi-byte character) with U+FFFD rather than failing.
    """

    kind = "byte"
    split_at = "any"  # each byte is its token

    def __init__(self, eos: bool = False):
        if not isinstance(eos, (bool, np.bool_)):  # eos="no" is a true str: a 257th id, silently
            raise TileError("tilegraph.io.ByteTokenizer", "eos must be True or False", f"{eos!r:.100}")
        self.eos_id = 256 if eos else None
        self.vocab_size = 257 if eos else 256

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of ``text`` (a str, or bytes that are UTF-8)."""
        try:
            raw = text.encode("utf-8")
        except (AttributeError, UnicodeEncodeError):  # bytes, or lone surrogates: as_text says which
            raw = as_text(text, "tilegraph.io.ByteTokenizer.encode").encode("utf-8")
        return np.frombuffer(raw, dtype=np.uint8).astype(self.dtype)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":  # astype(uint8) would make 65.7 an "A" and fail on "a"
            raise TileError("tilegraph.io.ByteTokenizer.decode", "token ids must be integers",
                            f"{ids.dtype} array, e.g. {ids[0]!r}")
        if self.eos_id is not None:
            ids = ids[ids != self.eos_id]
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise TileError("tilegraph.io.ByteTokenizer.decode", "byte token ids must lie in [0, 256)",
                            f"{int(ids.min())}..{int(ids.max())}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def __repr__(self) -> str:
        return f"ByteTokenizer(eos={self.eos_id is not None})"


@functools.cache
def _library_takes_lone_surrogates() -> bool:
    """Whether this tokenizers library encodes a str holding lone surrogates (0.15 to 0.20.0 at
    least did, as the bytes of U+FFFD, without a word) where later ones (0.20.3 on) refuse it with
    a TypeError, which :func:`as_text` turns into the error that names them."""
    hf = _hf()
    try:
        hf.Tokenizer(hf.models.BPE()).encode("\udcff")
    except TypeError:  # refused as it reached the library
        return False
    except Exception:  # (taken, then the empty model's own error)
        return True
    return True


def _no_lone_surrogates(text, where: str):
    """``text`` as given; a str holding lone surrogates is :func:`as_text`'s TileError where this
    tokenizers library would encode it silently (bytes and the rest: the library's TypeError)."""
    if isinstance(text, str) and not text.isascii() and _library_takes_lone_surrogates():
        as_text(text, where)
    return text


def _hf():
    try:
        import tokenizers
    except ImportError:
        raise TileError("tilegraph.io.BPETokenizer", "BPE tokenizers need the 'tokenizers' package "
                        "(pip install 'tilegraph[data]')", "ImportError") from None
    return tokenizers


def _broken(e: Exception) -> TileError:
    """The ``tokenizers`` library's error on a text it could not encode (it raises a bare
    Exception, e.g. "Unk token `<unk>` not found in the vocabulary": the tokenizer's JSON names
    an unknown-token its vocabulary lacks) as one naming the tokenizer."""
    return TileError("tilegraph.io.BPETokenizer.encode", "a tokenizer that can encode any text (a broken "
                     "tokenizer JSON: its model names a token its vocabulary lacks?)", str(e)[:300])


def _check_eos(where: str, eos) -> None:
    """The end-of-text token's text: a non-empty str, or None (an int made the library raise a
    TypeError, and "" became a token that no text ever spells)."""
    if eos is not None and not (isinstance(eos, str) and eos):
        raise TileError(where, "eos must be the end-of-text token's text (a non-empty str) or None", f"{eos!r:.100}")


#: what the text of an end-of-text token holds (<|endoftext|>, <|eot|>, </s>, [EOS], <end>, ...)
_END_MARK = re.compile(r"end|eos|eot|</s>", re.IGNORECASE)


def _only_special_token(tokenizer) -> str | None:
    """The text of the tokenizer's only special token that reads as an end marker, other than its
    model's unknown token: what :meth:`BPETokenizer.train` makes of ``eos="<|eot|>"``, and a
    Llama tokenizer's "</s>" beside its "<unk>" and "<s>" (which left its token files without
    document ends); a lone "<pad>" is not taken for one, nor one of two end markers; else None."""
    decoder = getattr(tokenizer, "get_added_tokens_decoder", None)
    if decoder is None:
        return None
    unk = getattr(getattr(tokenizer, "model", None), "unk_token", None)
    ends = [t.content for t in decoder().values()
            if getattr(t, "special", False) and t.content != unk and _END_MARK.search(t.content)]
    return ends[0] if len(ends) == 1 else None


def tokenizer_config_eos(path) -> str | None:
    """``eos_token`` of a Hugging Face ``tokenizer_config.json`` (a str, or an object with its
    ``content``), which names a tokenizer's end-of-text token beside its ``tokenizer.json``; None
    when the file is absent, unreadable or names none."""
    try:
        if path.stat().st_size > 16 * 2**20:  # a real one is a few kB (with a chat template, some 100)
            return None
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _added_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after every single text (a Llama
    tokenizer's ``[<s>]`` and ``[]``; none for GPT-2's, or one :meth:`BPETokenizer.train` made),
    as Hugging Face's ``tokenizer(text)`` adds them."""
    try:
        enc = tokenizer.encode("a", add_special_tokens=True)
        plain = len(tokenizer.encode("a", add_special_tokens=False).ids)
    except Exception:  # a broken model (encode names it) or an object that is not a Tokenizer
        return [], []
    ids, mask = enc.ids, enc.special_tokens_mask
    lead = next((i for i, m in enumerate(mask) if not m), len(ids))
    if len(ids) - plain < lead:  # not a prefix and suffix around the text's own ids
        return [], []
    return list(ids[:lead]), list(ids[lead + plain:])


def _splits_at_spaces(json_text: str) -> bool:
    """Whether the tokenizer JSON ``json_text`` encodes a text cut before a whitespace character
    that follows one that is none, part by part, to the ids of the whole: GPT-2's byte-level
    pre-tokenizer (what :meth:`BPETokenizer.train` makes, a Hub GPT-2's) splits every text there
    (no piece of its pattern runs from a character that is no whitespace over whitespace, and none
    looks back), and BPE merges only inside a piece. Not so, and False, with a normalizer (one may
    look across the cut), another pre-tokenizer (a Llama tokenizer's prepends a space to every
    text), BPE dropout (random ids), or an added token that is not special (matched in the text
    before the pieces are made; the special ones are encoded as text)."""
    try:
        spec = json.loads(json_text)
    except (TypeError, ValueError, RecursionError):
        return False
    if not isinstance(spec, dict):
        return False
    pre, model = spec.get("pre_tokenizer"), spec.get("model")
    return (spec.get("normalizer") is None and isinstance(pre, dict) and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space", True) and pre.get("use_regex", True) is True
            and isinstance(model, dict) and model.get("type", "BPE") == "BPE" and not model.get("dropout")
            and all(isinstance(t, dict) and t.get("special") for t in spec.get("added_tokens") or []))


#: ASCII whitespace (what every regular expression's \\s matches), as a str and as a byte class
_ASCII_SPACE = " \t\n\r\x0b\x0c"
_SPACE_BYTES = b" \t\n\r\x0b\x0c"


def _char_start(data, i: int) -> int:
    """The start of the UTF-8 character that holds byte ``i`` of ``data`` (at most 3 back)."""
    j = i
    while j > max(0, i - 3) and data[j] & 0xC0 == 0x80:
        j -= 1
    return j


def _utf8_length(lead: int) -> int:
    """The bytes of the UTF-8 character whose first byte is ``lead``."""
    return 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


class Cut:
    """Where a text may be cut for :meth:`Tokenizer.encode_parts` (see :attr:`Tokenizer.cut`):
    before a character of ``before`` (ASCII whitespace) that follows a character that is no
    whitespace, nor one of ``not_after[that character]``; where ``lines``, also after a line end
    (\\r or \\n) before a character that is no whitespace; never where a text of ``avoid`` (an
    added token the tokenizer finds in the text) touches the cut.

    :meth:`last` finds such a place in UTF-8 bytes, as :func:`~tilegraph.io.build_token_file`
    reads a file a block at a time.
    """

    def __init__(self, before: str, not_after: dict | None = None, lines: bool = False, avoid: Sequence[str] = ()):
        self.before, self.lines = before, bool(lines)
        self.not_after = {c: frozenset(v) for c, v in (not_after or {}).items()}
        self.avoid = tuple(sorted({a.encode("utf-8") for a in avoid if a}, key=len, reverse=True))
        alts = []
        if before:
            alts.append(b"[^" + re.escape(_SPACE_BYTES) + b"](?=[" + re.escape(before.encode()) + b"])")
        if lines:
            alts.append(b"[\r\n](?=[^" + re.escape(_SPACE_BYTES) + b"])")
        self._candidates = re.compile(b"|".join(alts)) if alts else None
        self._avoid = re.compile(b"(?=(" + b"|".join(map(re.escape, self.avoid)) + b"))") if self.avoid else None
        self._longest = len(self.avoid[0]) if self.avoid else 0
        #: bytes after a place that deciding it may read
        self.reach = max(self._longest, 4)

    def allows(self, data, p: int) -> bool | None:
        """Whether the text whose UTF-8 bytes ``data`` begin may be cut before byte ``p``; None
        when that depends on bytes after the end of ``data``."""
        n = len(data)
        if not 0 < p < n:
            return False
        c, prev = data[p], data[p - 1]
        if c < 0x80 and chr(c) in self.before and prev not in _SPACE_BYTES:
            i = _char_start(data, p - 1)
            try:
                x = bytes(data[i:p]).decode("utf-8")
            except UnicodeDecodeError:  # not text (said where the block is decoded)
                return False
            if len(x) != 1 or x.isspace() or x in self.not_after.get(chr(c), ()):
                return False
        elif self.lines and prev in b"\r\n" and c not in _SPACE_BYTES:
            m = _utf8_length(c)
            if p + m > n:
                return None
            try:
                y = bytes(data[p:p + m]).decode("utf-8")
            except UnicodeDecodeError:
                return False
            if y.isspace():  # a no-break space, U+2028, ...
                return False
        else:
            return False
        if self._avoid is not None:
            if p + self._longest > n:
                return None
            for m in self._avoid.finditer(data, max(p - self._longest, 0), p + self._longest):
                if m.start() <= p <= m.start() + len(m.group(1)):
                    return False
        return True

    def last(self, data, start: int = 0) -> int:
        """The last place to cut ``data`` (UTF-8 bytes of a text that goes on past their end),
        searched from the end; ``start``: none lies more than :attr:`reach` bytes before it
        (searched already). 0 when there is none."""
        if self._candidates is None:
            return 0
        first, hi = max(start - self.reach - 1, 0), len(data)
        while hi > first:
            lo = max(hi - 65536, first)
            for m in reversed(list(self._candidates.finditer(data, lo, hi))):
                if self.allows(data, m.end()):
                    return m.end()
            hi = lo + 1 if lo > first else first  # the windows overlap by a byte: no pair is missed
        return 0

    def __repr__(self) -> str:
        return (f"Cut(before={self.before!r}" + (", lines=True" if self.lines else "")
                + (f", not_after={ {c: ''.join(sorted(v)) for c, v in self.not_after.items() if v} !r}"
                   if any(self.not_after.values()) else "")
                + (f", avoid={[a.decode() for a in self.avoid]!r}" if self.avoid else "") + ")")


#: the cut that GPT-2's byte-level pre-tokenizer allows (its pattern's pieces never run from a
#: character that is no whitespace over whitespace): ``split_at = "space"``
SPACE_CUT = Cut(_ASCII_SPACE)

#: Split patterns (of a Split pre-tokenizer followed by a ByteLevel one without its own pattern)
#: and the places where their pieces always end, whatever the text: (``before``, ``lines``) of a
#: :class:`Cut`. GPT-2's pattern: before any whitespace that follows a character that is none.
#: Llama 3's (GPT-4's) and Qwen 2's: a piece of punctuation takes the line ends after it ("!\\n"),
#: so before a space or tab only, and after a line end before a character that is no whitespace
#: (no piece runs from a line end over one). None of them looks back.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PATTERNS = {
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+": (_ASCII_SPACE, False),
    _LLAMA3_PATTERN: (" \t\x0b\x0c", True),
    _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"): (" \t\x0b\x0c", True),  # Qwen 2's: a digit a piece
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
#: normalizers that map each character alone (a space stays a starter that nothing composes with)
_PER_CHAR = ("NFC", "NFD", "NFKC", "NFKD", "Lowercase")
_POST_PROCESSORS = ("ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing")


def _steps(node, key: str) -> list | None:
    """The steps of a normalizer, pre-tokenizer or post-processor of a tokenizer JSON (a
    Sequence's, in order; none for null); None where one is not a JSON object."""
    if node is None:
        return []
    if not isinstance(node, dict):
        return None
    if node.get("type") != "Sequence":
        return [node]
    out = []
    for sub in node.get(key) or []:
        got = _steps(sub, key)
        if got is None:
            return None
        out += got
    return out


def _without_prepend(node):
    """A normalizer as ``node``, its Prepend steps left out (what a text's later parts get)."""
    if isinstance(node, dict) and node.get("type") == "Prepend":
        return None
    if isinstance(node, dict) and node.get("type") == "Sequence":
        kept = [s for s in (_without_prepend(s) for s in node.get("normalizers") or []) if s is not None]
        return {**node, "normalizers": kept} if kept else None
    return node


def _cut_plan(spec: dict) -> tuple[Cut, dict] | None:
    """Where a text may be cut for the tokenizer JSON ``spec`` (a dict), each part encoded alone
    without the special tokens its post-processor adds, the first by the tokenizer, the others by
    the tokenizer of the JSON returned beside the :class:`Cut` (a Prepend normalizer, a Metaspace
    or ByteLevel prefix left out), to the ids of the whole; None where it cannot be said.

    A piece that the pre-tokenizer makes is encoded alone, so a text may be cut where pieces always
    end (:data:`_SPLIT_PATTERNS`; a Metaspace pre-tokenizer that splits: before each space). With no
    pre-tokenizer (Llama 2's "legacy" tokenizer.json: its normalizer prepends "▁" and makes spaces
    "▁") or one that does not split, BPE merges over the whole text, and a text may be cut between
    two characters that no token of the vocabulary holds side by side: no merge joins them. Per
    character normalizers (NFC, Lowercase) keep the pieces; other normalizers, pre-tokenizers and
    models (Unigram, WordPiece, BPE dropout) are not analysed: None. An added token that is not
    special (found in the text first; the special ones are encoded as text) must not touch a cut."""
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" or model.get("dropout"):
        return None
    added = spec.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("content"), str)
                                              and t["content"] for t in added):
        return None
    plain = [t for t in added if not t.get("special")]
    avoid = [t["content"] for t in plain]
    norms = _steps(spec.get("normalizer"), "normalizers")
    pres = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    posts = _steps(spec.get("post_processor"), "processors")
    if norms is None or pres is None or posts is None or any(p.get("type") not in _POST_PROCESSORS for p in posts):
        return None
    replaces, per_char = [], False
    for step in norms:
        kind, pattern, content = step.get("type"), step.get("pattern"), step.get("content")
        if kind == "Prepend" and isinstance(step.get("prepend"), str):
            continue
        if kind in _PER_CHAR:
            per_char = True
        elif (kind == "Replace" and isinstance(pattern, dict) and isinstance(pattern.get("String"), str)
              and len(pattern["String"]) == 1 and isinstance(content, str) and content):
            replaces.append((pattern["String"], content))
        else:
            return None
    if norms and any(t.get("normalized", True) for t in plain):  # found in the normalized text: not analysed
        return None
    cont = json.loads(json.dumps(spec))
    cont["normalizer"] = _without_prepend(spec.get("normalizer"))
    cont["truncation"] = cont["padding"] = None
    kinds = [p.get("type") for p in pres]
    space_as = None  # what a Metaspace pre-tokenizer makes of a space, where it does not split there
    if kinds == ["ByteLevel"] and pres[0].get("use_regex", True) is not False:
        if pres[0].get("add_prefix_space"):  # a space before each text and each part between added tokens
            if plain:
                return None
            cont["pre_tokenizer"] = {**pres[0], "add_prefix_space": False}
        before, lines = _ASCII_SPACE, False
    elif (kinds == ["Split", "ByteLevel"] and isinstance(pres[0].get("pattern"), dict)
          and pres[0]["pattern"].get("Regex") in _SPLIT_PATTERNS and pres[0].get("behavior") == "Isolated"
          and not pres[0].get("invert") and pres[1].get("use_regex") is False
          and not pres[1].get("add_prefix_space")):
        before, lines = _SPLIT_PATTERNS[pres[0]["pattern"]["Regex"]]
    elif kinds == ["Metaspace"] and isinstance(pres[0].get("replacement"), str) and len(pres[0]["replacement"]) == 1:
        meta = pres[0]
        scheme = meta.get("prepend_scheme") or ("always" if meta.get("add_prefix_space", True) else "never")
        if scheme not in ("first", "never", "always") or (scheme == "always" and plain):
            return None
        cont["pre_tokenizer"] = {**meta, "prepend_scheme": "never",
                                 **({"add_prefix_space": False} if "add_prefix_space" in meta else {})}
        if meta.get("split", True):  # pieces start at each "▁" (a space)
            before, lines = " ", False
        else:
            space_as = meta["replacement"]
    elif kinds:
        return None
    if space_as is None and kinds:  # a pre-tokenizer that cuts the text into pieces at `before`
        if replaces:  # (one that made a space "▁" would not split there)
            return None
        return Cut(before, lines=lines, avoid=avoid), cont
    # BPE over the whole text: a cut between two characters no token holds side by side
    vocab, merges = model.get("vocab"), model.get("merges")
    if (per_char or not isinstance(vocab, dict) or not isinstance(merges, list) or model.get("ignore_merges")
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    for merge in merges:  # byte tokens (a byte fallback's) that merge: not analysed
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        if not isinstance(pair, (list, tuple)) or any(not isinstance(t, str) or _BYTE_TOKEN.fullmatch(t) for t in pair):
            return None

    def seen(ch: str) -> str:  # a character as the model sees it
        for pattern, content in replaces:
            ch = ch.replace(pattern, content)
        return ch if space_as is None else ch.replace(" ", space_as)

    inside: dict[str, set] = {}  # character -> the characters before it inside a token
    for token in vocab:
        if isinstance(token, str):
            for a, b in zip(token, token[1:]):
                inside.setdefault(b, set()).add(a)
    patterns = {p for p, _ in replaces} | ({" "} if space_as is not None else set())
    before, not_after = "", {}
    for c in _ASCII_SPACE:
        head = seen(c)[0]
        if head not in vocab and model.get("fuse_unk") and not model.get("byte_fallback"):
            continue  # an unknown character beside another: one unknown token
        joined = inside.get(head, set())
        before += c
        not_after[c] = {x for x in joined | patterns if seen(x) and seen(x)[-1] in joined}
    return Cut(before, not_after, avoid=avoid), cont


#: a text that holds what a cut may fall beside: the probe :meth:`BPETokenizer.encode_parts` is
#: checked on before it cuts a file (a plan that does not hold is not used)
_PROBE = ("Hello wörld.  Two\tthree\n\nfour 12345 678, 日本語のテキスト。\n中文，很好。\r\nx  y ▁z ▁ é\u0301 it's "
          "'ll <s> </s> <|endoftext|> ½ ① \u00a0a\u3000b\x0b\x0cc!\n\n\tdef f(x):\n    return x + 1\n")


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenization, no unknown tokens) from Hugging Face
    ``tokenizers``. Train it once with :meth:`train`, :meth:`save` it as JSON, :meth:`load` it
    when building token files. Round trips are exact: ``decode(encode(s)) == s``.

    Any ``tokenizer.json`` of the library loads (a Llama tokenizer's byte-fallback BPE too), and
    encodes as Hugging Face's ``tokenizer(text)`` does: with the special tokens its post-processor
    adds (a Llama tokenizer's "<s>" first: :attr:`bos_id`), and without the truncation or padding
    the file may have stored (transformers applies neither unless asked to).

    >>> tok = BPETokenizer.train(["corpus/"], vocab_size=1024)  # doctest: +SKIP
    >>> tok.save("bpe.json"); BPETokenizer.load("bpe.json").encode("def f(x):")  # doctest: +SKIP
    """

    kind = "bpe"

    def __init__(self, tokenizer, eos: str | None = DEFAULT_EOS):
        # Text that spells a special token ("<|endoftext|>" in a corpus about tokenizers) is
        # encoded as the text it is: matched as the special token, it became the end-of-text id,
        # a document boundary inside a document, and decode dropped it. Not part of the JSON, so
        # the tokenizer's hash (recorded in token files) is unchanged.
        where = "tilegraph.io.BPETokenizer"
        if not callable(getattr(tokenizer, "token_to_id", None)):  # a path: BPETokenizer.load takes that
            raise TileError(where, "tokenizer must be a tokenizers.Tokenizer (a JSON file: BPETokenizer.load(path))",
                            f"{tokenizer!r:.100}")
        _check_eos(where, eos)
        # the JSON as given (its hash names the tokenizer in token files), before the settings below
        self._json = tokenizer.to_str() if callable(getattr(tokenizer, "to_str", None)) else None
        if hasattr(tokenizer, "encode_special_tokens"):
            tokenizer.encode_special_tokens = True
        # a truncation or padding stored in the JSON (a tokenizer saved after a call that asked for
        # it) cut every document of a token file to its max_length, or padded a prompt with pad ids
        if getattr(tokenizer, "truncation", None) is not None:
            tokenizer.no_truncation()
        if getattr(tokenizer, "padding", None) is not None:
            tokenizer.no_padding()
        eos_id = tokenizer.token_to_id(eos) if eos is not None else None
        if eos is not None and eos_id is None:
            if eos != DEFAULT_EOS:  # asked for by name: without it no document would end
                raise TileError(where, "the end-of-text token eos must be in the "
                                "tokenizer's vocabulary (eos=None: none)", repr(eos))
            # the default one, absent: the tokenizer's one special token (train(eos="<|eot|>"), saved
            # and loaded: its token files had no end-of-text token, silently); else none
            eos = _only_special_token(tokenizer)
            eos_id = tokenizer.token_to_id(eos) if eos is not None else None
        self._tok = tokenizer
        self.eos = eos
        self.eos_id = eos_id
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        lead, trail = _added_ids(tokenizer)
        self.bos_id = lead[0] if len(lead) == 1 else None
        self.split_at = "space" if not lead and not trail and _splits_at_spaces(self.to_str()) else None
        self._plan, self._planned = None, False  # see _block_plan: worked out when a file is first cut

    @property
    def cut(self) -> Cut | None:
        """Where a long text may be cut for :meth:`encode_parts` (None: nowhere, the text is
        encoded whole); see :func:`_cut_plan` for the tokenizers it is worked out for (GPT-2's,
        Llama 2's, 3's, Qwen 2's tokenizer.json among them)."""
        plan = self._block_plan()
        return None if plan is None else plan[0]

    def _block_plan(self):
        """``(cut, the tokenizer of a text's later parts, the ids before a text, those after it)``,
        or None; worked out once, and checked on a probe text cut at every place it allows."""
        if self._planned:
            return self._plan
        self._planned = True
        try:
            spec = json.loads(self.to_str())
            found = _cut_plan(spec) if isinstance(spec, dict) else None
            if found is None:
                return None
            cont = _hf().Tokenizer.from_str(json.dumps(found[1]))
        except Exception:  # JSON the library reads and this does not (or the other way round): encoded whole
            return None
        if hasattr(cont, "encode_special_tokens"):
            cont.encode_special_tokens = True
        plan = (found[0], cont, *_added_ids(self._tok))
        if self._holds(plan):
            self._plan = plan
        return self._plan

    def _holds(self, plan) -> bool:
        """Whether the probe text cut at each place ``plan`` allows, and at all of them, encodes to
        the ids of the whole."""
        cut = plan[0]
        text = _PROBE + " ".join(a.decode("utf-8") for a in cut.avoid) + " end."
        data = text.encode("utf-8")
        at = [p for p in range(1, len(data)) if cut.allows(data, p)]
        try:
            whole = self.encode(text).tolist()
            for cuts in [[p] for p in at] + [at]:
                bounds = [0, *cuts, len(data)]
                parts = [data[a:b].decode("utf-8") for a, b in zip(bounds, bounds[1:])]
                if [i for ids in self._encode_parts(plan, parts) for i in ids.tolist()] != whole:
                    return False
        except (TileError, UnicodeDecodeError):
            return False
        return True

    def _encode_parts(self, plan, parts):
        _, cont, lead, trail = plan
        tok, first = self._tok, True
        for part in parts:
            try:
                ids = tok.encode(_no_lone_surrogates(part, "tilegraph.io.BPETokenizer.encode_parts"),
                                 add_special_tokens=False).ids
            except TypeError:  # bytes, lone surrogates: as_text says which
                ids = self._encode(as_text(part, "tilegraph.io.BPETokenizer.encode_parts"), tok)
            except Exception as e:
                raise _broken(e) from None
            if first:
                ids, tok, first = lead + ids, cont, False
            yield np.asarray(ids, dtype=self.dtype)
        if first:  # no part at all: the empty text's ids
            yield self.encode("")
        elif trail:
            yield np.asarray(trail, dtype=self.dtype)

    def encode_parts(self, parts: Iterable[str]):
        """The ids of the text that ``parts`` make, an array a part, together those of
        ``encode("".join(parts))`` where the text was cut at places :attr:`cut` allows (or
        :attr:`split_at`): the ids before a text (a Llama tokenizer's "<s>") come once, before
        the first part, and the later parts are encoded without the prefix a text gets (the "▁"
        before a Llama 2 text)."""
        plan = None if self.split_at is not None else self._block_plan()
        if plan is None:
            yield from super().encode_parts(parts)
        else:
            yield from self._encode_parts(plan, parts)

    @classmethod
    def train(cls, files: Sequence[str | os.PathLike] | str | os.PathLike, vocab_size: int, *,
              min_frequency: int = 2, eos: str | None = DEFAULT_EOS,
              patterns: Sequence[str] | None = None, text_field: str = "text") -> "BPETokenizer":
        """Learn merges from text ``files`` (files or folders, found as by
        :func:`~tilegraph.io.build_token_file`; a JSON Lines file's documents are its records'
        ``text_field``) until the vocabulary has ``vocab_size`` ids: 256 byte tokens, the
        end-of-text token ``eos`` (None: none) and the merges."""
        from tilegraph.io.data import DEFAULT_PATTERNS, _check_text_field, _Source, find_sources

        where = "tilegraph.io.BPETokenizer.train"
        _check_eos(where, eos)
        n_fixed = 256 + (eos is not None)
        # "300" and 300.0 met raw TypeErrors, min_frequency=-1 an OverflowError, inside the library
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
            raise TileError(where, "vocab_size must be an int", f"{vocab_size!r:.100}")
        if isinstance(min_frequency, bool) or not isinstance(min_frequency, (int, np.integer)) or min_frequency < 0:
            raise TileError(where, "min_frequency must be an int >= 0", f"{min_frequency!r:.100}")
        if vocab_size < n_fixed:
            raise TileError(where, f"vocab_size must be at least {n_fixed} (256 bytes"
                            + (" + the end-of-text token)" if eos is not None else ")"), str(vocab_size))
        _check_text_field(text_field, where)
        hf = _hf()
        paths = find_sources(files, DEFAULT_PATTERNS if patterns is None else patterns, where=where)
        tok = hf.Tokenizer(hf.models.BPE())
        # no prefix space: the text is reproduced exactly, leading space or not
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
            special_tokens=[eos] if eos is not None else [],
            initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
        # a block of text at a time, cut before spaces (the pieces the pre-tokenizer counts are those
        # of the whole): a file of gigabytes is never held whole
        texts = (text for p in paths for _, parts in _Source(p, where, None, "space", text_field).documents()
                 for text in parts)
        tok.train_from_iterator(texts, trainer=trainer)
        got = tok.get_vocab_size(with_added_tokens=True)
        if got < vocab_size:  # the text ran out of pairs to merge (min_frequency): said, not silently smaller
            warnings.warn(f"[{where}] the text gave only {got} of the vocab_size={vocab_size} ids asked for "
                          f"(no pair seen min_frequency={min_frequency} times is left to merge): more text, "
                          "or a smaller vocab_size", stacklevel=2)
        return cls(tok, eos=eos)

    @classmethod
    def from_str(cls, json_text: str, eos: str | None = DEFAULT_EOS, *,
                 where: str = "tilegraph.io.BPETokenizer.from_str", source: str = "the JSON text") -> "BPETokenizer":
        """A tokenizer from the library's JSON (``source`` names where it came from in errors)."""
        hf = _hf()
        try:
            tok = hf.Tokenizer.from_str(json_text)
        except Exception as e:  # the library raises plain Exceptions for malformed or truncated JSON
            what = ("a tokenizers JSON file; this one ends early (truncated?)" if "EOF while parsing" in str(e)
                    else "a tokenizers JSON file")
            try:  # valid JSON of another kind: the library's message names a JSON syntax error it lacks
                parsed = json.loads(json_text)
            except (ValueError, RecursionError):  # not JSON (or nested past Python's limit)
                parsed = e
            if parsed is not e and not (isinstance(parsed, dict) and "model" in parsed):
                if isinstance(parsed, dict):
                    kind = (f"an object with keys {', '.join(map(repr, list(parsed)[:5]))}"
                            + (", ..." if len(parsed) > 5 else "")) if parsed else "an empty object"
                else:  # the JSON name of the value's type
                    kind = "a JSON " + {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
                        type(parsed), "number")
                raise TileError(where, "expected a tokenizers JSON file (an object with 'model', 'normalizer', "
                                "'pre_tokenizer', ...); this one is JSON but not a tokenizer",
                                f"{source}: {kind[:300]}") from None
            raise TileError(where, f"expected {what}", f"{source}: {str(e)[:300]}") from None
        return cls(tok, eos=eos)

    @classmethod
    def load(cls, path: str | os.PathLike, eos: str | None = DEFAULT_EOS) -> "BPETokenizer":
        """A tokenizer saved by :meth:`save` (or any ``tokenizers`` JSON file: a Hub model's
        ``tokenizer.json``). ``eos`` is the end-of-text token's text (None: none); the default,
        when the file lacks it, falls back to the ``eos_token`` of the ``tokenizer_config.json``
        beside the file (a Hub folder's, as transformers reads it), then to the file's only special
        token that reads as an end marker (the ``eos`` that :meth:`train` was given, Llama's
        "</s>"), else to none."""
        from tilegraph.io.data import read_text

        where = "tilegraph.io.BPETokenizer.load"
        path = user_path(path, where)
        if not path.is_file():
            raise TileError(where, "expected a tokenizer JSON file", str(path))
        text = read_text(path, where)
        tok = cls.from_str(text, eos=eos, where=where, source=str(path))
        if eos == DEFAULT_EOS and tok.eos_id is None:  # the default one absent: the folder's, as transformers reads it
            named = tokenizer_config_eos(path.parent / "tokenizer_config.json")
            if named is not None and tok._tok.token_to_id(named) is not None:
                return cls.from_str(text, eos=named, where=where, source=str(path))
        return tok

    def to_str(self) -> str:
        return self._tok.to_str() if self._json is None else self._json

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as JSON (to a temporary name, then renamed)."""
        where = "tilegraph.io.BPETokenizer.save"
        path = user_path(path, where)
        if path.name in ("", "..") or path.is_dir():  # os.replace onto a folder fails with a bare OSError
            raise TileError(where, "the path of a file to write, not a folder", str(path))
        if not path.parent.is_dir():
            raise TileError(where, "the parent folder must exist", str(path))
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_text(self.to_str(), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of ``text`` (a str, or bytes that are UTF-8)."""
        try:
            # with the post-processor's special tokens, as HF's tokenizer(text)
            ids = self._tok.encode(_no_lone_surrogates(text, "tilegraph.io.BPETokenizer.encode")).ids
        except TypeError:  # the library's answer to bytes and to lone surrogates alike: as_text says which
            ids = self._encode(as_text(text, "tilegraph.io.BPETokenizer.encode"))
        except Exception as e:  # the library's bare Exception: a model whose unk_token the vocabulary lacks
            raise _broken(e) from None
        return np.asarray(ids, dtype=self.dtype)

    def _encode(self, text: str, tok=None) -> list[int]:
        try:
            if tok is not None:  # a part of a text (encode_parts)
                return tok.encode(text, add_special_tokens=False).ids
            return self._tok.encode(text).ids
        except Exception as e:
            raise _broken(e) from None

    def encode_batch(self, texts: Iterable[str | bytes]) -> list[np.ndarray]:
        """Several texts at once (the library spreads them over threads)."""
        if isinstance(texts, (str, bytes, bytearray, memoryview)):  # else encoded one character each
            raise TileError("tilegraph.io.BPETokenizer.encode_batch", "texts must be a list of texts (one text: "
                            "encode)", f"{texts!r:.100}")
        texts = [_no_lone_surrogates(t, "tilegraph.io.BPETokenizer.encode_batch") for t in texts]
        try:
            encoded = self._tok.encode_batch(texts)
        except TypeError:  # bytes or lone surrogates somewhere: as_text names the first
            texts = [as_text(t, "tilegraph.io.BPETokenizer.encode_batch") for t in texts]
            encoded = self._tok.encode_batch(texts)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encoded]

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise TileError("tilegraph.io.BPETokenizer.decode", "token ids must be integers",
                            f"{ids.dtype} array, e.g. {ids[0]!r}")
        # the library raised an OverflowError on -1 and dropped ids past its vocabulary silently
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise TileError("tilegraph.io.BPETokenizer.decode", f"token ids must lie in [0, {self.vocab_size})",
                            f"{int(ids.min())}..{int(ids.max())}")
        return self._tok.decode(ids.tolist(), skip_special_tokens=True)

    def describe(self) -> dict:
        digest = hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id, "eos": self.eos,
                "sha256": digest}

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eos={self.eos!r})"


def tokenizer_from_description(desc: dict, bpe_path: str | os.PathLike | None = None) -> Tokenizer:
    """Rebuild the tokenizer a token file recorded: byte tokenizers from the description alone,
    BPE from ``bpe_path``, checked against the recorded hash."""
    where = "tilegraph.io.tokenizer_from_description"
    if not isinstance(desc, dict):
        raise TileError(where, "a tokenizer description is a JSON object with a 'kind'", type(desc).__name__)
    kind = desc.get("kind")
    if kind == "byte":
        return ByteTokenizer(eos=desc.get("eos_id") is not None)
    if kind == "bpe":
        if bpe_path is None:
            raise TileError(where, "a BPE token file needs the tokenizer's JSON file (bpe_path)", "None")
        tok = BPETokenizer.load(bpe_path, eos=desc.get("eos"))
        if tok.describe()["sha256"] != desc.get("sha256"):
            raise TileError(where, "the tokenizer file differs from the one the token file was built with",
                            str(bpe_path))
        return tok
    raise TileError(where, "unknown tokenizer kind (expected 'byte' or 'bpe')", repr(kind)[:100])


# ------------------------------------------------------------------- Hugging Face's files ----
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table, which the ``tokenizers`` library's ByteLevel pre-tokenizer
    and decoder use: each byte as a printable character (the printable Latin-1 ones as
    themselves, the others from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


def _byte_tokenizer_json(eos_id: int | None) -> str:
    """The byte tokenizer as the ``tokenizers`` library's JSON: a byte-level BPE model without
    merges whose vocabulary gives each byte its value as id (every text is its UTF-8 bytes, one
    token each), and the end-of-text id as the special token ``<|endoftext|>``."""
    chars = _byte_chars()
    added = [] if eos_id is None else [{"id": eos_id, "content": DEFAULT_EOS, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True}]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "vocab": {chars[b]: b for b in range(256)}, "merges": []}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                       "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
                       "decoder": byte_level, "model": model}, ensure_ascii=False)


def _bos_text(json_text: str) -> str | None:
    """The text of the id the post-processor of the tokenizer JSON ``json_text`` puts first (see
    :attr:`BPETokenizer.bos_id`); None where it puts none, or the JSON does not load."""
    try:
        tok = _hf().Tokenizer.from_str(json_text)
    except Exception:  # the tokenizers package missing (a TileError), or JSON it does not read
        return None
    lead, _ = _added_ids(tok)
    return tok.id_to_token(lead[0]) if len(lead) == 1 else None


def hf_tokenizer_files(tokenizer, bpe_json: str | bytes | None = None) -> dict[str, bytes]:
    """The files that make a folder load in Hugging Face as ``tokenizer`` (a :class:`ByteTokenizer`
    or :class:`BPETokenizer`, or the description one recorded: ``describe()``, the
    ``tilegraph_tokenizer.json`` of a checkpoint, with ``bpe_json``, the BPE tokenizer's JSON, for
    kind "bpe"): ``tokenizer.json``, the ``tokenizers`` library's format, and
    ``tokenizer_config.json``. ``transformers.AutoTokenizer.from_pretrained(folder)`` (and
    ``tokenizers.Tokenizer.from_file``) then encodes any text to the ids tilegraph's tokenizer
    gives (the special tokens a BPE tokenizer's post-processor adds included, a Llama tokenizer's
    "<s>", which is then ``bos_token``) and decodes them back: the end-of-text token is the special
    token ``eos_token`` of the same id, and text spelling it is encoded as text, as tilegraph does
    (``split_special_tokens``).

    >>> files = hf_tokenizer_files(ByteTokenizer(eos=True))
    >>> sorted(files), json.loads(files["tokenizer_config.json"])["eos_token"]
    (['tokenizer.json', 'tokenizer_config.json'], '<|endoftext|>')
    """
    where = "tilegraph.io.hf_tokenizer_files"
    bos = None  # the text of the id a BPE tokenizer's post-processor puts first (a Llama tokenizer's "<s>")
    if isinstance(tokenizer, (ByteTokenizer, BPETokenizer)):
        desc = tokenizer.describe()
        if isinstance(tokenizer, BPETokenizer):
            bpe_json = tokenizer.to_str()
            bos = None if tokenizer.bos_id is None else tokenizer._tok.id_to_token(tokenizer.bos_id)
    elif isinstance(tokenizer, dict):
        desc = tokenizer
    else:
        raise TileError(where, "a ByteTokenizer, a BPETokenizer or a tokenizer's description (a dict: describe())",
                        type(tokenizer).__name__)
    kind, eos_id = desc.get("kind"), desc.get("eos_id")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int) or eos_id < 0):
        raise TileError(where, "a description whose eos_id is an int >= 0 or None", repr(eos_id)[:100])
    if kind == "byte":
        if eos_id not in (None, 256):
            raise TileError(where, "a byte tokenizer's eos_id to be 256 or None", repr(eos_id))
        text, eos = _byte_tokenizer_json(eos_id), DEFAULT_EOS if eos_id is not None else None
    elif kind == "bpe":
        if bpe_json is None:
            raise TileError(where, "the BPE tokenizer's JSON (bpe_json) with a description of kind 'bpe'", "None")
        text = bpe_json.decode("utf-8") if isinstance(bpe_json, (bytes, bytearray)) else str(bpe_json)
        eos = desc.get("eos") if eos_id is not None else None
        if eos is not None and not isinstance(eos, str):
            raise TileError(where, "a description whose eos is the end-of-text token's text (a str)", repr(eos)[:100])
        if not isinstance(tokenizer, BPETokenizer):
            bos = _bos_text(text)
    else:
        raise TileError(where, "a tokenizer of kind 'byte' or 'bpe'", repr(kind)[:100])
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False,  # decode gives the text back as it was
              "split_special_tokens": True,  # "<|endoftext|>" in a text is that text (BPETokenizer's encode_special_tokens)
              "model_input_names": ["input_ids", "attention_mask"]}
    if eos is not None:
        config.update(bos_token=eos, eos_token=eos)  # (the checkpoint's config names its id for both)
    if bos is not None:
        config["bos_token"] = bos
    return {"tokenizer.json": text.encode("utf-8"), "tokenizer_config.json": json.dumps(config, indent=1).encode()}
