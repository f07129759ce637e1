"""Token datasets: text files -> a memory-mapped token file -> batches read on the workers.

:func:`build_token_file` tokenizes text files (or every matching file under folders, in sorted
order; the records of a JSON Lines or .json file, each a document) into one flat file of
uint16/uint32 ids plus a JSON sidecar ``<file>.json`` (dtype, count, tokenizer, sources and
hashes), a block of a large file at a time. Both are written under temporary names and renamed
only when everything succeeded, so a failure never leaves a partial file nor replaces a good one.

:class:`TokenDataset` opens that file with ``np.memmap`` and splits it into a train and a
validation range. A batch is just the int64 start offsets of its windows
(:meth:`TokenDataset.batch_offsets`, deterministic given the seed and the step); the windows
themselves are read by a tile kernel where the task runs (:meth:`TokenDataset.tensors`), so only
the offsets travel from the client. Every worker must see the token file under the same path.

>>> import tilegraph as tg
>>> from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file
>>> build_token_file(["corpus/"], "corpus.tok", ByteTokenizer())  # doctest: +SKIP
>>> ds = TokenDataset("corpus.tok", seq_len=256, seed=0)  # doctest: +SKIP
>>> step = tg.TrainStep(model, opt, lambda m, off: loss(m, *ds.tensors(off)))  # doctest: +SKIP
>>> for i in range(steps): step(ds.batch_offsets(i, 8))  # doctest: +SKIP
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import io
import json
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np

from tilegraph._config import is_int
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit, kernel, xp_of
from tilegraph._tensor import TileTensor, Tiling

from ._store import user_path
from .tokenizers import SPACE_CUT, ByteTokenizer, Cut, Tokenizer, _char_start

__all__ = ["DEFAULT_PATTERNS", "find_sources", "read_text", "build_token_file", "read_token_meta",
           "TokenDataset"]

#: files picked up from folders when no patterns are given
DEFAULT_PATTERNS = ("*.txt", "*.md", "*.rst", "*.py")
FORMAT = "tilegraph-tokens"
VERSION = 1
_SPLITS = {"train": 0, "val": 1}


# ----------------------------------------------------------------------------------- sources ----
def _as_list(sources) -> list:
    if isinstance(sources, (str, os.PathLike)):
        return [sources]
    return list(sources)


def _check_patterns(patterns, where: str) -> tuple[str, ...]:
    """``patterns`` as a tuple of non-empty relative glob patterns (None and 5 met raw TypeErrors,
    "/abs/*.txt" rglob's NotImplementedError, "" matched nothing and said so as "searched for ")."""
    items = (patterns,) if isinstance(patterns, str) else patterns
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(x, str) and x and not os.path.isabs(x) for x in items):
        raise TileError(where, "patterns must be a list of file name patterns relative to each folder "
                        "(e.g. ['*.txt', '*.md'])", f"{patterns!r:.100}")
    return items


def _files_below(root: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The files below folder ``root`` matching one of ``patterns`` (as ``root.rglob(pattern)``
    matches), hidden files and folders left out, resolved and sorted. Links to folders are
    followed (rglob skipped them: a corpus folder of links to others read as empty), each real
    folder once, so a link to a folder above it is no loop."""
    below, seen = set(), set()
    # rglob("**/*.py") is rglob("*.py"); Path.match reads "**" as "*", one folder deep
    globs = [pat[3:] if pat.startswith("**/") and len(pat) > 3 else pat for pat in patterns]
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            f = Path(folder, name)
            if name.startswith(".") or not f.is_file():  # a hidden file, a dangling link, a FIFO
                continue
            rel = f.relative_to(root)
            if any(rel.match(pat) for pat in globs):
                below.add(f.resolve())
    return sorted(below)


def find_sources(sources, patterns: Sequence[str] | str = DEFAULT_PATTERNS, *,
                 where: str = "tilegraph.io.find_sources") -> list[Path]:
    """The files to read: files as given, then for each folder every file below it matching one of
    ``patterns`` (``*.py``, ...), in sorted order; hidden files and folders are skipped, links to
    folders followed. A glob (``"data/**/*.txt"``) that is no existing path stands for the files
    and folders it matches, in sorted order. Raises a TileError for a path that does not exist, a
    glob that matches nothing, or when no file is found."""
    patterns = _check_patterns(patterns, where)
    if not isinstance(sources, (str, os.PathLike)):
        try:
            sources = list(sources)
        except TypeError:  # None, 5: "'NoneType' object is not iterable"
            raise TileError(where, "sources must be a path or a list of paths (text files and folders)",
                            f"{sources!r:.100}") from None
    found: list[Path] = []
    for src in _as_list(sources):
        p = user_path(src, where)
        matched = [p]
        if not p.exists() and glob.has_magic(str(p)):  # "data/**/*.txt": what it matches (as [data] sources)
            matched = [Path(m) for m in sorted(glob.glob(str(p), recursive=True))]
            if not matched:  # (it was "each source must be an existing text file or folder")
                raise TileError(where, "a glob that matches files or folders", f"{str(src)!r} matches nothing")
        for p in matched:
            if p.is_file():
                found.append(p.resolve())
            elif p.is_dir():
                found.extend(_files_below(p, patterns))
            else:
                raise TileError(where, "each source must be an existing text file or folder", str(src))
    unique = list(dict.fromkeys(found))  # a file named twice is read once, first place kept
    if not unique:
        searched = ", ".join(patterns) if patterns else "nothing: patterns is empty"
        raise TileError(where, f"no files found (folders are searched for {searched})",
                        ", ".join(str(s) for s in _as_list(sources)) or "no sources")
    return unique


#: byte order marks of encodings other than UTF-8, longest first (UTF-32's starts like UTF-16's)
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
               (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))
_UTF8_BOM = b"\xef\xbb\xbf"
_NEWLINE = b"\n"


def _read_text(path, where: str, max_bytes: int | None = None) -> tuple[str, bool]:
    """The file's text, at most ``max_bytes`` bytes of it (None: all; the rest never read, and a
    character cut in two left out), and whether it was cut. A leading UTF-8 byte order mark is
    not text (Windows editors write one): it is dropped, not tokenized into the corpus."""
    blocks = _text_blocks(path, where, max_bytes)
    _, cut = next(blocks)
    return "".join(blocks), cut


#: bytes of a file read and encoded at a time by build_token_file (and BPETokenizer.train), where
#: the tokenizer's ``split_at`` allows cutting its text. Small: the tokenizers library's encode
#: holds some 300 bytes a token and slows on long texts (measured on 2 cores, a BPE of about one
#: token a byte: 0.58 MB/s on 64 KB texts, 0.21 on 1 MB ones, 4.8 GB held for 16 MB blocks),
#: and the byte tokenizer went fastest with it too (200 MB in 3.0 s; 4.4 s in 1 MB blocks)
BLOCK_BYTES = 1 << 16


def _cut_point(data: bytearray, start: int, split_at) -> int:
    """Where to cut ``data`` (text read on beyond its end) so that its two parts encode to the
    ids of the whole, as the tokenizer's ``split_at`` ("any", "space") or :class:`Cut` allows;
    ``start``: no such place lies before it (searched already). 0 when there is none."""
    end = len(data)
    if split_at == "any":  # before the last character that starts in the block (it may go on past it)
        return _char_start(data, end - 1) if end else 0
    if split_at == "space":  # before an ASCII whitespace character that follows one that is none
        split_at = SPACE_CUT
    return split_at.last(data, start) if isinstance(split_at, Cut) else 0


def _text_blocks(path, where: str, max_bytes: int | None = None, split_at: str | Cut | None = None):
    """The text of the file at ``path`` (at most ``max_bytes`` bytes of it, a character cut in
    two left out, a leading UTF-8 byte order mark too), in parts cut where ``split_at`` allows
    (see :attr:`tilegraph.io.Tokenizer.split_at` and :attr:`~tilegraph.io.Tokenizer.cut`; None:
    the whole text at once), each about :data:`BLOCK_BYTES` long: a file of gigabytes is never
    held whole. Yields ``(bytes read, cut)`` first (the text's UTF-8 size and whether
    ``max_bytes`` cut it), then each part as a str. A file that is not UTF-8 text is a TileError
    naming the byte (and its line), wherever it lies."""
    if not isinstance(path, (str, os.PathLike)):  # open(None) is a bare TypeError, open(3) reads file descriptor 3
        raise TileError(where, "a readable text file (its path)", f"{type(path).__name__} {path!r:.60}")
    try:
        f = open(path, "rb")
    except OSError as e:  # unreadable, or gone since it was found
        raise TileError(where, "a readable text file", f"{path}: {e.strerror or e}") from None
    with f:
        try:
            head = f.read(4)
            size = os.fstat(f.fileno()).st_size
            if not size and head:  # a file that says it is empty and is not (/proc, some FUSE mounts): small
                f = io.BytesIO(head + f.read())
                size = len(f.getbuffer())
        except OSError as e:
            raise TileError(where, "a readable text file", f"{path}: {e.strerror or e}") from None
        other = next((name for bom, name in _OTHER_BOMS if head.startswith(bom)), None)
        if other is not None:  # its NUL bytes would call it binary
            raise TileError(where, f"expected a UTF-8 text file; this one is {other} (it starts with a {other} byte "
                            "order mark): save it as UTF-8", str(path))
        skip = len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0
        total = max(size - skip, 0)
        cut = max_bytes is not None and total > max_bytes
        n = max_bytes if cut else total
        try:
            if cut:  # a character that the budget cuts in two is left out whole
                f.seek(skip + max(n - 3, 0))
                tail = f.read(n - max(n - 3, 0) + 1)
                if len(tail) > 1 and tail[-1] & 0xC0 == 0x80:
                    lead = _char_start(tail, len(tail) - 1)
                    if tail[lead] >= 0xC0:
                        n -= len(tail) - 1 - lead
            f.seek(skip)
        except OSError as e:
            raise TileError(where, "a readable text file", f"{path}: {e.strerror or e}") from None
        yield n, cut
        block = BLOCK_BYTES
        data, at, left, searched, parts = bytearray(), skip, n, 0, 0  # at: the file's byte at data[0]
        line = 1  # the file's line at data[0]
        while True:
            try:
                more = f.read(min(block, left)) if left else b""
            except OSError as e:
                raise TileError(where, "a readable text file", f"{path}: {e.strerror or e}") from None
            if left and not more:
                raise TileError(where, "a text file that stays as it is while it is read (it became shorter)",
                                f"{path}: {n - left} of {n} bytes read")
            left -= len(more)
            nul = more.find(b"\x00")
            if nul >= 0:  # valid UTF-8, but no text file has NUL bytes: this is a binary file (said at once,
                # a large one not read on to a place to cut)
                raise TileError(where, "expected a UTF-8 text file; this one contains NUL bytes (binary?)",
                                f"{path} (first NUL at byte {at + len(data) + nul})")
            data += more
            stop = len(data) if not left else _cut_point(data, searched, split_at)
            searched = len(data)
            if stop == 0 and left:  # no place to cut yet: read on
                continue
            part = bytes(data[:stop])
            del data[:stop]
            searched -= stop
            try:
                text = part.decode("utf-8")
            except UnicodeDecodeError as e:
                where_in = f"line {line + part.count(_NEWLINE, 0, e.start)}, byte {at + e.start}"
                raise TileError(where, "expected a UTF-8 text file; this one does not decode as UTF-8",
                                f"{path} ({where_in}: {part[e.start:e.start + 4]!r})") from None
            at += stop
            line += part.count(_NEWLINE)
            if text or (not left and not parts):  # an empty file too (a tokenizer may give ids for "": a "<s>")
                parts += 1
                yield text
            if not left:
                return


def read_text(path: Path | str, where: str = "tilegraph.io.read_text") -> str:
    """The file's content as text (without a leading byte order mark); a TileError names the
    file when it is not UTF-8 text or cannot be read."""
    return _read_text(path, where)[0]


#: files read as JSON Lines: one JSON object a line, each a document (its ``text_field``)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: files that hold no text as they are, by their suffix: what to do instead
_NOT_TEXT = {".parquet": "a Parquet file", ".arrow": "an Arrow file (a Hugging Face datasets cache?)",
             ".feather": "an Arrow (Feather) file", ".gz": "a compressed file", ".bz2": "a compressed file",
             ".xz": "a compressed file", ".zst": "a compressed file", ".zip": "a zip archive",
             ".tar": "a tar archive"}


def _check_text_field(text_field, where: str) -> str:
    if not isinstance(text_field, str) or not text_field:
        raise TileError(where, "text_field must be the name of the records' text field (JSON Lines, .json; a "
                        "non-empty str)", f"{text_field!r:.100}")
    return text_field


class _Source:
    """The documents of one source file, read as :func:`build_token_file` tokenizes them: a text
    file is one document (in parts cut where ``split_at`` allows, see :func:`_text_blocks`), a
    JSON Lines file (:data:`JSONL_SUFFIXES`) one document for each record, its ``text_field``, and
    so is a ``.json`` file: a JSON array of records, or JSON Lines (what ``datasets``' ``to_json``
    writes). At most ``budget`` bytes of UTF-8 text (None: all); after :meth:`documents` ran,
    ``nbytes``, ``cut`` (whether the budget cut the text) and ``count`` (documents) describe what
    was read."""

    def __init__(self, path: Path, where: str, budget: int | None, split_at, text_field: str):
        self.path, self.where, self.budget, self.split_at = path, where, budget, split_at
        self.text_field = text_field
        self.json = path.suffix.lower() == ".json"
        self.jsonl = self.json or path.suffix.lower() in JSONL_SUFFIXES  # records, each a document
        self.nbytes, self.cut, self.count = 0, False, 0
        kind = _NOT_TEXT.get(path.suffix.lower())
        if kind is not None:  # "contains NUL bytes (binary?)" or "does not decode" said less
            raise TileError(where, f"UTF-8 text files, JSON Lines files ({', '.join(JSONL_SUFFIXES)}) or .json files "
                            f"of records; this one is {kind}: write its text out as .txt or .jsonl files", str(path))

    def documents(self):
        """``(bytes, parts)`` for each document: its UTF-8 size, and an iterator of its text."""
        if not self.jsonl:
            blocks = _text_blocks(self.path, self.where, self.budget, self.split_at)
            self.nbytes, self.cut = next(blocks)
            self.count = 1
            yield self.nbytes, blocks
            return
        for text in self._records():
            if self.budget is not None and self.nbytes >= self.budget:  # spent on the records before it
                self.cut = True
                return
            raw = text.encode("utf-8")
            if self.budget is not None and self.nbytes + len(raw) > self.budget:
                keep = self.budget - self.nbytes  # the record that reaches the budget is cut there
                raw = raw[:keep].decode("utf-8", errors="ignore").encode("utf-8")  # (a character cut in two: out)
                text, self.cut = raw.decode("utf-8"), True
            self.nbytes += len(raw)
            self.count += 1
            yield len(raw), iter((text,))
            if self.cut:
                return

    @property
    def _kind(self) -> str:
        """What the file must be, as errors say it."""
        return ("a .json file of records: a JSON array of objects ([{\"text\": ...}, ...]) or JSON Lines (one "
                "object a line)" if self.json else "a JSON Lines file: one JSON object a line")

    def _text_of(self, record, at: str) -> str:
        """The text of one record (a JSON object: its ``text_field``), checked."""
        field, where = self.text_field, self.where
        if not isinstance(record, dict):
            raise TileError(where, self._kind, f"{at}: a JSON {type(record).__name__}")
        if field not in record:
            keys = ", ".join(map(repr, list(record)[:8])) + (", ..." if len(record) > 8 else "")
            raise TileError(where, f"each record to hold its text in the field {field!r} (text_field names "
                            "the field)", f"{at}: a record with {keys or 'no keys'}")
        text = record[field]
        if not isinstance(text, str):
            raise TileError(where, f"the records' {field!r} to be a string",
                            f"{at}: {type(text).__name__} {text!r:.60}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800"), which no UTF-8 spells
            raise TileError(where, f"the records' {field!r} to be valid Unicode text",
                            f"{at}: a lone surrogate {text[e.start:e.end]!r} at character {e.start}") from None
        return text

    def _records(self):
        path, where = self.path, self.where
        try:
            f = open(path, "rb")
        except OSError as e:
            raise TileError(where, f"a readable {'.json' if self.json else 'JSON Lines'} file",
                            f"{path}: {e.strerror or e}") from None
        with f:
            head = f.read(4)
            other = next((name for bom, name in _OTHER_BOMS if head.startswith(bom)), None)
            if other is not None:
                raise TileError(where, f"expected a UTF-8 {'.json' if self.json else 'JSON Lines'} file; this one is "
                                f"{other} (it starts with a {other} byte order mark): save it as UTF-8", str(path))
            f.seek(len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0)
            if self.json:
                start = f.tell()
                first = _first_byte(f)
                f.seek(start)
                if first == b"[":
                    yield from self._array(f)
                    return
                if first not in (b"{", b""):  # "": an empty file, no record
                    shown = first.decode("latin-1")
                    raise TileError(where, self._kind + ": write other text out as a .txt file",
                                    f"{path}: it starts with {shown!r}" + (" (a JSON value that is no record)"
                                                                           if first in b'"-0123456789tfn' else ""))
            yield from self._lines(f)

    def _lines(self, f):
        path, where = self.path, self.where
        for number, line in enumerate(f, 1):
            if not line.strip():  # a blank line (the last one's newline, say) is no record
                continue
            at = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except UnicodeDecodeError as e:
                raise TileError(where, f"{self._kind}, in UTF-8; this line does not decode as UTF-8",
                                f"{at} (byte {e.start} of the line: {line[e.start:e.start + 4]!r})") from None
            except ValueError as e:  # json.JSONDecodeError
                if self.json and line.strip() == b"{":  # a JSON object written over several lines
                    raise TileError(where, self._kind, f"{at}: one JSON object over several lines, no array of "
                                    "records") from None
                raise TileError(where, self._kind, f"{at}: {e}") from None
            except RecursionError:
                raise TileError(where, self._kind, f"{at}: nested too deep") from None
            yield self._text_of(record, at)

    def _array(self, f):
        """The texts of the records of a JSON array, read a block at a time (a record at a time
        held, not the file)."""
        path, where = self.path, self.where
        utf8, decoder = codecs.getincrementaldecoder("utf-8")(), json.JSONDecoder()
        buf, pos, line, done, read = "", 0, 1, False, f.tell()  # line: the file's line at buf[pos]; read: bytes

        def more(need: int) -> bool:  # read on until buf holds need characters past pos, or the file ends
            nonlocal buf, pos, done, read
            if pos > len(buf) // 2:
                buf, pos = buf[pos:], 0
            while not done and len(buf) - pos < need:
                block = f.read(max(BLOCK_BYTES, need))
                try:
                    buf += utf8.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    raise TileError(where, f"{self._kind}, in UTF-8; this one does not decode as UTF-8",
                                    f"{path} (byte {read + e.start})") from None
                read += len(block)
                done = not block
            return len(buf) - pos >= need

        def skip_space():
            nonlocal pos, line
            while True:
                end = pos
                while end < len(buf) and buf[end] in " \t\r\n":
                    end += 1
                line += buf.count("\n", pos, end)
                pos = end
                if pos < len(buf) or not more(1):
                    return

        def fail(what: str, n: int):
            raise TileError(where, self._kind, f"{path}, record {n} (line {line}): {what}")

        more(1)
        skip_space()
        pos += 1  # the "["
        n = 0
        while True:
            skip_space()
            if pos >= len(buf):
                fail("the file ends inside the array (truncated?)", n + 1)
            if buf[pos] == "]" and n == 0:
                pos += 1
                break
            n += 1
            if buf[pos] != "{":  # a number at the end of a block would be read short: said by its first character
                kind = {"[": "array", '"': "string", "t": "boolean", "f": "boolean", "n": "null"}.get(buf[pos],
                                                                                                  "number")
                fail(f"a JSON {kind}" if buf[pos] in '["tfn-0123456789' else f"not JSON ({buf[pos:pos + 10]!r})", n)
            need = BLOCK_BYTES
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    break
                except ValueError as e:
                    if done:  # the whole rest of the file is read: no whole object
                        fail(f"{e.msg} (line {line + buf.count(chr(10), pos, e.pos)} of the file)"
                             if e.pos < len(buf) else "the file ends inside this record (truncated?)", n)
                    more(len(buf) - pos + need)  # a record longer than what was read: read on (twice as far each time)
                    need *= 2
                except RecursionError:
                    fail("nested too deep", n)
            at = f"{path}, record {n} (line {line})"
            line += buf.count("\n", pos, end)
            pos = end
            yield self._text_of(record, at)
            skip_space()
            if pos < len(buf) and buf[pos] == ",":
                pos += 1
                continue
            if pos < len(buf) and buf[pos] == "]":
                pos += 1
                break
            fail("expected ',' or ']' after it" + (f", found {buf[pos:pos + 10]!r}" if pos < len(buf) else
                                                   " (the file ends: truncated?)"), n)
        skip_space()
        if pos < len(buf):
            raise TileError(where, self._kind, f"{path}, line {line}: text after the array ({buf[pos:pos + 10]!r})")


def _first_byte(f) -> bytes:
    """The first byte of the rest of file ``f`` that is no JSON whitespace (b"" at its end)."""
    while True:
        block = f.read(BLOCK_BYTES)
        if not block:
            return b""
        rest = block.lstrip(b" \t\r\n")
        if rest:
            return rest[:1]


# -------------------------------------------------------------------------------- token file ----
class _Read:
    """The text that build_token_file gives its tokenizer, as it passes: hashed and counted."""

    def __init__(self, src_hash):
        self.hash, self.chars = src_hash, 0

    def through(self, parts):
        for text in parts:
            self.hash.update(text.encode("utf-8"))
            self.chars += len(text)
            yield text


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def build_token_file(sources, out_path: str | os.PathLike, tokenizer: Tokenizer | None = None, *,
                     patterns: Sequence[str] | str = DEFAULT_PATTERNS, append_eos: bool = True,
                     max_bytes: int | None = None, text_field: str = "text") -> dict:
    """Tokenize text ``sources`` (files or folders, see :func:`find_sources`) into ``out_path``: a
    flat file of ``tokenizer.dtype`` ids, and ``out_path + ".json"`` describing it. Files are
    concatenated in order, each followed by the end-of-text token when the tokenizer has one and
    ``append_eos``. Returns the sidecar's content.

    A JSON Lines file (``.jsonl``, ``.ndjson``) holds one document a line: the field
    ``text_field`` of each record (a JSON object), each followed by the end-of-text token (its
    sidecar entry counts them: ``"documents"``). A ``.json`` file holds records too: a JSON array
    of them (read a record at a time), or JSON Lines (what ``datasets``' ``to_json`` writes); one
    that holds anything else is refused. Parquet, Arrow and compressed files are refused by name.
    A text file is read and tokenized a block at a time where the tokenizer allows it
    (:attr:`~tilegraph.io.Tokenizer.split_at`: the byte tokenizer, byte-level BPE; or its
    :attr:`~tilegraph.io.Tokenizer.cut`: Llama's and Qwen's tokenizer.json files among others),
    to the same ids: a file of gigabytes is never held in memory whole.

    ``max_bytes`` (None: no limit) reads at most that much UTF-8 text: the file (or record) that
    reaches it is cut there (at a character boundary; its sidecar entry says ``"cut": true``) and
    the files after it are not read (the sidecar's ``"files_left_out"`` counts them).

    Nothing is written under the final names unless every file was read and tokenized: an empty
    corpus, a file that is not UTF-8 text, or a missing path raises a TileError and leaves any
    existing token file as it was.
    """
    where = "tilegraph.io.build_token_file"
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if isinstance(tokenizer, type) or not all(hasattr(tokenizer, a) for a in ("encode", "vocab_size", "eos_id",
                                                                               "describe", "dtype")):
        shown = f"the class {tokenizer.__name__} (not an instance)" if isinstance(tokenizer, type) \
            else f"{type(tokenizer).__name__} {tokenizer!r:.60}"
        raise TileError(where, "tokenizer must be a tokenizer object, e.g. ByteTokenizer(eos=True) or "
                        "BPETokenizer.load(path) (None: ByteTokenizer())", shown)
    out = user_path(out_path, where)
    if not out.parent.is_dir():
        raise TileError(where, "the output's parent folder must exist", str(out))
    if out.is_dir():
        raise TileError(where, "the output must be a file path, not a folder", str(out))
    if not isinstance(append_eos, (bool, np.bool_)):  # append_eos="no" is true: end-of-text tokens, silently
        raise TileError(where, "append_eos must be True or False", f"{append_eos!r:.100}")
    if max_bytes is not None and not is_int(max_bytes, 1):
        raise TileError(where, "max_bytes must be None or an int >= 1", repr(max_bytes))
    text_field = _check_text_field(text_field, where)
    files = find_sources(sources, patterns, where=where)
    written = {out.resolve(), _meta_path(out).resolve()}
    clash = [str(f) for f in files if f in written]
    if clash:  # it was replaced by the token file, the text lost
        raise TileError(where, "the output must not be one of the sources (the token file would replace it)",
                        f"{out} among the sources ({clash[0]})")
    dtype = tokenizer.dtype
    eos = tokenizer.eos_id if append_eos else None
    # where a text may be cut: anywhere split_at allows (each part encoded alone), else where the
    # tokenizer's cut allows, the parts given to its encode_parts (which knows the first from the
    # others: a Llama tokenizer's "<s>" once); a tokenizer with neither gets each text whole
    split_at = getattr(tokenizer, "split_at", None)
    encode_parts = getattr(tokenizer, "encode_parts", None)
    if split_at not in ("any", "space"):
        split_at = getattr(tokenizer, "cut", None) if callable(encode_parts) else None
        split_at = split_at if isinstance(split_at, Cut) else None
    if not callable(encode_parts):
        def encode_parts(parts):
            return (tokenizer.encode(text) for text in parts)
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp_data = out.with_name(f".{out.name}.{tag}.tmp")
    tmp_meta = out.with_name(f".{out.name}.json.{tag}.tmp")
    src_hash, tok_hash = hashlib.sha256(), hashlib.sha256()
    listing, count, read_bytes = [], 0, 0
    read = _Read(src_hash)
    try:
        with open(tmp_data, "wb") as f:
            for path in files:
                if max_bytes is not None and read_bytes >= max_bytes:
                    break
                # only the rest of the budget is read (a 10 GB file under max_bytes=1e6: 1 MB of it),
                # a character cut in two left out whole; a block at a time where the tokenizer's ids
                # allow cutting the text (its split_at), so a file of gigabytes is never held whole
                source = _Source(path, where, None if max_bytes is None else max_bytes - read_bytes,
                                 split_at, text_field)
                tokens = 0
                for nbytes, parts in source.documents():
                    src_hash.update(nbytes.to_bytes(8, "little"))
                    for ids in encode_parts(read.through(parts)):
                        ids = np.asarray(ids)
                        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
                            raise TileError(where, f"the tokenizer produced ids outside [0, {tokenizer.vocab_size})",
                                            f"{path}: {int(ids.min())}..{int(ids.max())}")
                        buf = ids.astype(dtype, copy=False).tobytes()
                        del ids
                        f.write(buf)
                        tok_hash.update(buf)
                        tokens += len(buf) // dtype.itemsize
                    if eos is not None:  # after each document
                        buf = np.array([eos], dtype).tobytes()
                        f.write(buf)
                        tok_hash.update(buf)
                        tokens += 1
                cut = source.cut
                entry = {"path": str(path), "bytes": source.nbytes, "tokens": tokens}
                if source.jsonl:
                    entry["documents"] = source.count
                if cut:
                    entry["cut"] = True
                listing.append(entry)
                count += tokens
                read_bytes += source.nbytes
                if cut:  # the budget is spent, even where a character cut in two left a byte or two of it
                    break
            f.flush()
            os.fsync(f.fileno())
        if read.chars == 0:
            shown = ", ".join(str(p) for p in files[:5]) + (", ..." if len(files) > 5 else "")
            # (the paths first: the command line takes a received that is no path for a missing one)
            raise TileError(where, "the corpus is empty: every file found has no text",
                            f"{shown} ({len(files)} file{'s' if len(files) > 1 else ''}, no text in "
                            f"{'any' if len(files) > 1 else 'it'})")
        meta = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.name, "count": count,
            "vocab_size": tokenizer.vocab_size, "eos_id": eos, "tokenizer": tokenizer.describe(),
            "sources": listing, "sources_sha256": src_hash.hexdigest(), "tokens_sha256": tok_hash.hexdigest(),
        }
        if any("documents" in entry for entry in listing):
            meta["text_field"] = text_field
        if max_bytes is not None:
            meta["max_bytes"] = int(max_bytes)
            meta["files_left_out"] = len(files) - len(listing)
        with open(tmp_meta, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        # data first: a reader that finds the new sidecar also finds the new data (and checks the size)
        os.replace(tmp_data, out)
        os.replace(tmp_meta, _meta_path(out))
    finally:
        tmp_data.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
    return meta


def read_token_meta(path: str | os.PathLike, *, verify: bool = False) -> dict:
    """The sidecar of a token file, checked against the file's size (and its hash if ``verify``)."""
    where = "tilegraph.io.read_token_meta"
    path = user_path(path, where)
    meta_path = _meta_path(path)
    if not path.is_file() or not meta_path.is_file():
        raise TileError(where, "expected a token file and its .json sidecar (see build_token_file)",
                        f"{path} ({'found' if path.is_file() else 'missing'}), "
                        f"{meta_path} ({'found' if meta_path.is_file() else 'missing'})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TileError(where, "the sidecar is not valid JSON", f"{meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TileError(where, f"the sidecar does not describe a token file (format {FORMAT!r})", str(meta_path))
    if meta.get("version") != VERSION or meta.get("dtype") not in ("uint16", "uint32"):
        raise TileError(where, f"unsupported token file (version {VERSION}, dtype uint16/uint32)",
                        f"version {meta.get('version')}, dtype {meta.get('dtype')}")
    # a hand-edited or damaged sidecar met a KeyError or int()'s ValueError here or in TokenDataset
    if not is_int(meta.get("count"), 0) or not is_int(meta.get("vocab_size"), 1):
        raise TileError(where, "the sidecar must give the token count (an int >= 0) and vocab_size (an int >= 1); "
                        "build the token file again (build_token_file)",
                        f"{meta_path}: count {meta.get('count')!r:.40}, vocab_size {meta.get('vocab_size')!r:.40}")
    size = path.stat().st_size
    want = int(meta["count"]) * np.dtype(meta["dtype"]).itemsize
    if size != want:
        raise TileError(where, f"token file size does not match its sidecar ({meta['count']} x {meta['dtype']} "
                        f"= {want} bytes)", f"{size} bytes in {path}")
    if verify:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        if h.hexdigest() != meta.get("tokens_sha256"):
            raise TileError(where, "token file content does not match the hash in its sidecar", str(path))
    return meta


# ------------------------------------------------------------------------- worker-side kernel ----
# Memory maps opened by this process, by path; reopened when the file was replaced.
_OPEN: dict[str, tuple[tuple, np.memmap]] = {}
_OPEN_LOCK = threading.Lock()


def _open_tokens(path: str, dtype: str, count: int) -> np.memmap:
    where = "tilegraph.io.TokenDataset"
    try:
        st = os.stat(path)
    except OSError as e:
        raise TileError(where, "token file not readable where this task runs (every worker must see it "
                        "under the same path)", f"{path}: {e.strerror}") from None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    want = count * np.dtype(dtype).itemsize
    with _OPEN_LOCK:
        hit = _OPEN.get(path)
        # the map of the file as it is, opened for this dataset's count and dtype: a dataset opened on
        # the file before it was built again read the new file's tokens (or an IndexError past its
        # end) once another dataset had opened the new one
        if hit is not None and hit[0] == stamp and hit[1].dtype == dtype and hit[1].shape == (count,):
            return hit[1]
        if st.st_size != want or (hit is not None and hit[0] == stamp):  # (the same size: another dtype)
            now = f", now {hit[1].shape[0]} {hit[1].dtype} tokens" if st.st_size == want else ""
            raise TileError(where, f"token file changed since the dataset opened it (expected {want} bytes: "
                            f"{count} {dtype} tokens)", f"{st.st_size} bytes in {path}{now}")
        mm = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        _OPEN[path] = (stamp, mm)
        return mm


def _read_windows(offsets, *, path, dtype, count, lo, hi, seq_len, start, length):
    """Columns ``[start, start + length)`` of the inputs and targets of the windows at ``offsets``:
    inputs ``tokens[o + start : o + start + length]``, targets shifted by one, both int64."""
    off = np.asarray(offsets.get() if hasattr(offsets, "get") else offsets).astype(np.int64, copy=False)
    bad = (off < lo) | (off > hi - seq_len - 1)
    if bad.any():
        first = int(off[np.argmax(bad)])
        raise TileError("tilegraph.io.TokenDataset", f"window offsets must lie in [{lo}, {hi - seq_len - 1}] "
                        f"(windows of {seq_len + 1} tokens inside the split)", str(first))
    tokens = _open_tokens(path, dtype, count)
    cols = np.arange(start, start + length + 1, dtype=np.int64)
    win = np.array(tokens[off[:, None] + cols[None, :]], dtype=np.int64)  # (b, length + 1), a plain ndarray
    return np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:])


def _windows_xp(offsets, **params):
    x, y = _read_windows(offsets, **params)
    xp = xp_of(offsets)  # a task placed on a GPU gets CuPy tiles back
    return (x, y) if xp is np else (xp.asarray(x), xp.asarray(y))


def _windows_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    b, n = out_shapes[0]
    read = b * (n + 1) * np.dtype(params["dtype"]).itemsize
    return Cost(0.0, float(read + 2 * b * n * 8 + b * 8))


# Workers that unpickle a task naming this kernel import this module (Kernel.module) to register it.
_windows_k = kernel("token_windows", cost=_windows_cost)(_windows_xp)


# ---------------------------------------------------------------------------------- dataset ----
class TokenDataset:
    """Windows of ``seq_len + 1`` tokens from one split of a token file.

    The first ``1 - val_fraction`` of the tokens are the "train" split, the rest the "val" split;
    a window never crosses the boundary. ``batch_offsets(step, b)`` draws ``b`` window starts
    uniformly from the split, the same for the same ``(seed, split, step)``.

    >>> ds = TokenDataset("corpus.tok", seq_len=128, split="val")  # doctest: +SKIP
    >>> x, y = ds.read(ds.batch_offsets(0, 4))  # (4, 128) int64 each, y is x shifted by one  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, *, split: str = "train",
                 val_fraction: float = 0.1, seed: int = 0):
        where = "tilegraph.io.TokenDataset"
        if split not in _SPLITS:
            raise TileError(where, "split must be 'train' or 'val'", repr(split))
        # the types first: int() would make seq_len=8.5 a window of 8 and fail on None with a bare TypeError
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float, np.integer, np.floating)) \
                or not 0.0 <= val_fraction < 1.0:
            raise TileError(where, "val_fraction must be a number in [0, 1)", repr(val_fraction))
        if not is_int(seq_len, 1):
            raise TileError(where, "seq_len must be an int >= 1", repr(seq_len))
        if not is_int(seed, 0):
            raise TileError(where, "seed must be an int >= 0", repr(seed))
        self.path = user_path(path, where).resolve()
        self.meta = read_token_meta(self.path)
        self.seq_len, self.split, self.seed = int(seq_len), split, int(seed)
        self.val_fraction = float(val_fraction)
        self.dtype = np.dtype(self.meta["dtype"])
        self.count = int(self.meta["count"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.boundary = self.count - int(self.count * self.val_fraction)  # first validation token
        self.lo, self.hi = (0, self.boundary) if split == "train" else (self.boundary, self.count)
        if self.hi - self.lo < self.seq_len + 1:
            raise TileError(where, f"the {split} split must hold at least one window of seq_len + 1 = "
                            f"{self.seq_len + 1} tokens", f"{self.hi - self.lo} tokens ({self.count} in "
                            f"{self.path.name}, val_fraction={val_fraction})")
        self.tokens = _open_tokens(str(self.path), self.dtype.name, self.count)

    @property
    def num_windows(self) -> int:
        """How many distinct window starts the split has."""
        return self.hi - self.lo - self.seq_len

    @property
    def _params(self) -> dict:
        # everything a worker needs to read a window; an absolute path, so the worker's cwd is irrelevant
        return dict(path=str(self.path), dtype=self.dtype.name, count=self.count, lo=self.lo, hi=self.hi,
                    seq_len=self.seq_len)

    def batch_offsets(self, step: int, batch_size: int) -> np.ndarray:
        """Start offsets (int64, shape ``(batch_size,)``) of the windows of batch ``step``."""
        if not is_int(step, 0) or not is_int(batch_size, 1):
            raise TileError("tilegraph.io.TokenDataset.batch_offsets",
                            "step must be an int >= 0 and batch_size an int >= 1",
                            f"step={step!r}, batch_size={batch_size!r}")
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], int(step)])
        return self.lo + rng.integers(0, self.num_windows, size=int(batch_size), dtype=np.int64)

    @property
    def num_eval_windows(self) -> int:
        """How many consecutive, non-overlapping windows fit in the split (what a full validation
        pass reads: each token but the split's last few is a target once)."""
        return (self.hi - self.lo - 1) // self.seq_len

    def eval_offsets(self, batch_size: int, max_batches: int | None = None) -> list[np.ndarray]:
        """Batches of ``batch_size`` window offsets for a validation pass, spread evenly over the
        whole split; the same windows on every call, so the losses of successive evaluations are
        comparable.

        The split is cut into ``n = num_eval_windows`` consecutive, non-overlapping windows, and
        ``k`` of them are read, ``k`` the most whole batches that fit in ``n`` and in
        ``max_batches`` (None: no limit): window ``floor((i + 0.5) * n / k)`` for ``i < k``, one
        from the middle of each of ``k`` equal stretches of the split, in order. A short
        validation pass thus sees the whole split rather than its start, and a full one
        (``k == n``) reads every window.

        For a split of 100 windows of 64 tokens, 2 batches of 2 are windows 12, 37, 62 and 87:

        >>> ds = TokenDataset("corpus.tok", seq_len=64, split="val")  # doctest: +SKIP
        >>> [(b - ds.lo).tolist() for b in ds.eval_offsets(2, max_batches=2)]  # doctest: +SKIP
        [[768, 2368], [3968, 5568]]
        """
        where = "tilegraph.io.TokenDataset.eval_offsets"
        if not is_int(batch_size, 1) or not (max_batches is None or is_int(max_batches, 1)):
            raise TileError(where, "batch_size must be an int >= 1 and max_batches None or an int >= 1",
                            f"batch_size={batch_size!r}, max_batches={max_batches!r}")
        total = self.num_eval_windows
        if total < batch_size:
            raise TileError(where, f"the {self.split} split must hold at least batch_size={batch_size} windows of "
                            f"seq_len + 1 = {self.seq_len + 1} tokens", f"{total} window(s) in its "
                            f"{self.hi - self.lo} tokens ({self.path.name})")
        n = total // batch_size if max_batches is None else min(total // batch_size, max_batches)
        k = n * batch_size
        i = np.arange(k, dtype=np.int64)
        picked = (2 * i + 1) * total // (2 * k)  # the middle of stretch i; every window when k == total
        starts = self.lo + picked * self.seq_len
        return [starts[i * batch_size:(i + 1) * batch_size] for i in range(n)]

    def read(self, offsets) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets ``(b, seq_len)`` int64 of the windows at ``offsets``, read here."""
        off = np.asarray(offsets).reshape(-1)
        if off.size and off.dtype.kind not in "iu":  # astype(int64) would silently read window 0 for 0.5
            raise TileError("tilegraph.io.TokenDataset.read", "offsets must be integers (batch_offsets gives them)",
                            f"{off.dtype} array, e.g. {off[0]!r}")
        return _read_windows(off, **self._params, start=0, length=self.seq_len)

    def tensors(self, offsets: TileTensor, seq_tile: int | None = None) -> tuple[TileTensor, TileTensor]:
        """Inputs and targets ``(b, seq_len)`` int64 TileTensors read where the tasks run.

        ``offsets`` is a 1-d integer TileTensor (a TrainStep batch input); the results are tiled
        like it along the batch and by ``seq_tile`` (None: one tile) along the sequence. Each tile
        pair is one kernel that takes only its offsets tile.
        """
        where = "tilegraph.io.TokenDataset.tensors"
        if not isinstance(offsets, TileTensor):
            raise TileError(where, "offsets must be a TileTensor (wrap a batch with tg.from_numpy)",
                            type(offsets).__name__)
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
            raise TileError(where, "offsets must be a 1-d integer tensor", f"{offsets.ndim}-d {offsets.dtype}")
        seq = Tiling.from_sizes((self.seq_len,), (seq_tile,), where=where).chunks[0]
        tiling = Tiling(offsets.chunks + (seq,))
        starts = tiling.offsets(1)
        gx = np.empty(tiling.grid, dtype=object)
        gy = np.empty(tiling.grid, dtype=object)
        params = self._params
        for i, b in enumerate(offsets.chunks[0]):
            for j, n in enumerate(seq):
                gx[i, j], gy[i, j] = emit(_windows_k, [offsets.grid[i]], [((b, n), np.int64)] * 2,
                                          op="token_windows", **params, start=starts[j], length=n)
        return TileTensor(tiling, np.int64, gx), TileTensor(tiling, np.int64, gy)

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.path)!r}, seq_len={self.seq_len}, split={self.split!r}, "
                f"tokens [{self.lo}, {self.hi}) of {self.count})")


#: the windows a TokenDataset's repr names (its path may hold anything)
_REPR_WINDOWS = re.compile(r"seq_len=(\d+),.* tokens \[(\d+), (\d+)\) of (\d+)\)$")


def described_windows(described: str) -> tuple[int, int, int, int] | None:
    """``(seq_len, lo, hi, count)`` of the TokenDataset ``described`` by its repr (what a
    checkpoint's ``trainer_state`` records of the data its run read: its split's tokens [lo, hi)
    of the file's count); None where it describes none."""
    found = _REPR_WINDOWS.search(described)
    return tuple(int(g) for g in found.groups()) if found else None


#: folders of the standard library left out of :func:`stdlib_files` (its test suites hold
#: deliberately odd files; site-packages is not the standard library)
STDLIB_SKIP = frozenset({"site-packages", "test", "tests", "idle_test"})


def _stdlib_walk(folder: Path):
    """The files below ``folder`` in the order ``sorted(folder.rglob("*"))`` gives them (each
    folder's entries by name, a subfolder's files at its place), folders named in STDLIB_SKIP
    and links to folders left out, as rglob leaves links out. rglob walked site-packages too,
    which lies inside the standard library's folder: about 23,000 entries on a machine with
    torch, 1.1 s of `tilegraph train`'s start on a quiet machine, for the 234 files of its corpus."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:  # unreadable: rglob skips it too
        return
    for entry in entries:
        if entry.name in STDLIB_SKIP:
            continue
        try:
            is_dir = entry.is_dir() and not entry.is_symlink()
        except OSError:
            continue
        if is_dir:
            yield from _stdlib_walk(Path(entry.path))
        else:
            yield Path(entry.path)


def stdlib_files(patterns: Sequence[str] | str = "*.py", max_bytes: int | None = None) -> list[Path]:
    """The Python standard library's own source files: a corpus every Python installation has.

    Sorted, test suites and site-packages left out, UTF-8 files without NUL bytes only, taken in
    order until they hold ``max_bytes`` (None: all).

    >>> files = stdlib_files("*.py", max_bytes=100_000)
    >>> all(f.suffix == ".py" for f in files) and 0 < len(files) < 100
    True
    """
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    below = list(_stdlib_walk(root))  # once for every pattern
    files, total = [], 0
    for pattern in _as_list(patterns):
        glob = pattern[3:] if pattern.startswith("**/") and len(pattern) > 3 else pattern  # as rglob reads it
        for path in below:
            size = _text_size(path) if path.relative_to(root).match(glob) else None
            if size is None:
                continue
            files.append(path)
            total += size
            if max_bytes is not None and total >= max_bytes:
                return files
    return files


def _text_size(path: Path) -> int | None:
    """The bytes of ``path`` when it is a readable UTF-8 text file without NUL bytes, else None."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if b"\x00" in data else len(data)
