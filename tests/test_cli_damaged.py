"""``tilegraph convert`` and ``tilegraph generate`` on a damaged Zarr checkpoint, as users meet
one: a truncated chunk file, a flipped byte (its CRC32C no longer matches), a chunk file, an
array's folder or its zarr.json gone, an array's or the checkpoint's zarr.json that is not JSON,
the checkpoint's zarr.json gone, a save that never finished, and a folder or file that is no
checkpoint at all. Each command exits with status 2 and one error line (no traceback) naming the
checkpoint and the array or file and what is wrong with it; convert leaves no destination (nor a
half-written or temporary one) behind, and never touches a destination that already exists.

The library's side of these (``load_checkpoint``, ``from_zarr``): test_zarr_checkpoint.py and
test_zarr_checkpoint_gaps.py; ``tilegraph info`` on damaged checkpoints:
test_cli_checkpoint_details.py."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_cli import _cli  # runs `python -m tilegraph.cli` in a subprocess

#: the array the damages below hit (exact float32; its chunk files c.I.J, each with its CRC32C)
ARRAY = "model/wte.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A small checkpoint as `tilegraph train` leaves one: the debug GPT-2 sized for the byte
    tokenizer, with the tokenizer's files (so generate needs no --tokenizer)."""
    import tilegraph as tg
    from tilegraph import models
    from tilegraph.cli import tokenizer_files
    from tilegraph.io import ByteTokenizer

    tok = ByteTokenizer(eos=True)
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=tok.vocab_size)
    return tg.io.save_checkpoint(tmp_path_factory.mktemp("good") / "ck", models.build(cfg, seed=0), step=3,
                                 files=tokenizer_files(tok))


def _chunk(ck: Path) -> Path:
    chunks = sorted((ck / ARRAY).glob("c.*"))
    assert chunks, list((ck / ARRAY).iterdir())
    return chunks[0]


# each damage: (what it does to the checkpoint folder, a pattern the error line must hold; {ck}: the
# checkpoint's path, {chunk}: the damaged chunk file's name)
def _truncate(ck: Path) -> None:
    chunk = _chunk(ck)
    chunk.write_bytes(chunk.read_bytes()[:100])


def _flip_a_byte(ck: Path) -> None:
    chunk = _chunk(ck)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the size is right: only the checksum tells
    chunk.write_bytes(bytes(data))


def _remove_a_chunk(ck: Path) -> None:
    _chunk(ck).unlink()


def _remove_the_array(ck: Path) -> None:
    shutil.rmtree(ck / ARRAY)


def _remove_the_arrays_zarr_json(ck: Path) -> None:
    (ck / ARRAY / "zarr.json").unlink()


def _garble_the_arrays_zarr_json(ck: Path) -> None:
    (ck / ARRAY / "zarr.json").write_text('{"shape": [257, 32], "data_ty')  # cut short


def _remove_the_zarr_json(ck: Path) -> None:
    (ck / "zarr.json").unlink()


def _garble_the_zarr_json(ck: Path) -> None:
    (ck / "zarr.json").write_bytes((ck / "zarr.json").read_bytes()[:-40])  # a copy cut short


def _unfinished(ck: Path) -> None:
    meta = json.loads((ck / "zarr.json").read_text())
    meta["attributes"]["tilegraph"]["complete"] = False  # as in the temporary folder of a killed save
    (ck / "zarr.json").write_text(json.dumps(meta))


def _no_checkpoint(ck: Path) -> None:
    shutil.rmtree(ck)
    ck.mkdir()
    (ck / "notes.txt").write_text("not a checkpoint\n")


def _a_file(ck: Path) -> None:
    shutil.rmtree(ck)
    ck.write_text("not a checkpoint\n")


DAMAGES = {
    "truncated-chunk": (_truncate, r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] array 'model/wte\.weight': a chunk "
                                   r"failed its checksum \(truncated or extended: not the size its shape makes\); "
                                   r"received: {chunk}: 100 bytes, expected \d+"),
    "flipped-byte": (_flip_a_byte, r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] array 'model/wte\.weight': a chunk "
                                   r"failed its checksum \(corrupted: its bytes do not give the CRC32C stored after "
                                   r"them\); received: {chunk}: CRC32C [0-9a-f]{{8}} of its bytes, [0-9a-f]{{8}} stored"),
    "missing-chunk": (_remove_a_chunk, r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] array 'model/wte\.weight': a "
                                       r"chunk is missing; received: {chunk} \(no file {ck}/model/wte\.weight/{chunk}\)"),
    "missing-array": (_remove_the_array, r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] every array the checkpoint "
                                         r"lists; received: missing: model/wte\.weight$"),
    "missing-array-zarr-json": (_remove_the_arrays_zarr_json,
                                r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] every array the checkpoint lists; "
                                r"received: missing: model/wte\.weight/zarr\.json$"),
    "array-zarr-json-not-json": (_garble_the_arrays_zarr_json,
                                 r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] a readable zarr\.json \(a JSON object\) "
                                 r"for every array the checkpoint lists; received: model/wte\.weight/zarr\.json: "
                                 r"JSONDecodeError: "),
    "missing-zarr-json": (_remove_the_zarr_json,
                          r"a tilegraph checkpoint \(zarr\.json\) or a Hugging Face folder \(config\.json\); "
                          r"received: {ck} holds neither \(its model/ or optimizer/ folder holds a checkpoint's "
                          r"arrays, but zarr\.json, the checkpoint's index of them, is missing: a damaged or partly "
                          r"copied checkpoint\)$"),
    "zarr-json-not-json": (_garble_the_zarr_json, r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] a readable zarr\.json; "
                                                  r"received: {ck}/zarr\.json: (Unterminated|Expecting)"),
    "unfinished-save": (_unfinished, r"\[tilegraph\.io\.load_checkpoint\({ck}\)\] a complete checkpoint; this one is "
                                     r"a save that did not finish .*; received: {ck}$"),
    "not-a-checkpoint": (_no_checkpoint, r"a tilegraph checkpoint \(zarr\.json\) or a Hugging Face folder "
                                         r"\(config\.json\); received: {ck} holds neither$"),
    "a-file": (_a_file, r"a tilegraph checkpoint folder \(zarr\.json\) or a Hugging Face folder \(config\.json\); "
                        r"received: {ck} is a file, not a folder$"),
}


def _damaged(good: Path, tmp_path: Path, damage: str) -> tuple[Path, re.Pattern]:
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    chunk = _chunk(ck).name
    DAMAGES[damage][0](ck)
    return ck, re.compile(DAMAGES[damage][1].format(ck=re.escape(str(ck)), chunk=re.escape(chunk)))


def _one_error_line(run: subprocess.CompletedProcess, command: str, pattern: re.Pattern) -> None:
    assert run.returncode == 2, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr[-3000:]  # one line, whatever else would be said
    assert lines[0].startswith(f"tilegraph {command}: error: "), lines[0]
    assert pattern.search(lines[0]), (pattern.pattern, lines[0])
    assert run.stdout == "", run.stdout[-2000:]  # nothing claimed done


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: (size, modification time in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_undamaged_checkpoint_converts_and_generates(good, tmp_path):
    """The baseline of the tests below: the same checkpoint, undamaged, works with both commands."""
    out = tmp_path / "out"
    conv = _cli("convert", str(good), str(out / "hf"), cwd=tmp_path)
    assert conv.returncode == 0 and (out / "hf" / "config.json").is_file(), conv.stderr[-3000:]
    gen = _cli("generate", str(good), "--prompt", "ab", "--max-new-tokens", "3", "--local", "--ids", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.splitlines()[-1].split()[:2] == [str(ord("a")), str(ord("b"))], gen.stdout


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_one_error_line_for_convert_and_generate(good, tmp_path, damage):
    ck, pattern = _damaged(good, tmp_path, damage)
    before = _listing(ck) if ck.is_dir() else None
    out = tmp_path / "out"  # the destination's folder: nothing may appear in it
    out.mkdir()
    conv = _cli("convert", str(ck), str(out / "hf"), cwd=tmp_path)
    _one_error_line(conv, "convert", pattern)
    assert list(out.iterdir()) == []  # no destination, no temporary folder beside it
    # generate as a user runs it (the embedded cluster: the load fails before it starts)
    gen = _cli("generate", str(ck), "--prompt", "def ", "--max-new-tokens", "4", cwd=tmp_path)
    _one_error_line(gen, "generate", pattern)
    if before is not None:
        assert _listing(ck) == before  # the damaged checkpoint itself: read, never changed


@pytest.mark.parametrize("damage", ["truncated-chunk", "flipped-byte", "array-zarr-json-not-json"])
def test_converting_a_damaged_checkpoint_to_zarr_writes_nothing(good, tmp_path, damage):
    """``--to zarr`` (a user rewriting the checkpoint, hoping to repair it): refused as the load
    fails, before anything is written; no finished, half-written or temporary checkpoint is left."""
    ck, pattern = _damaged(good, tmp_path, damage)
    out = tmp_path / "out"
    out.mkdir()
    run = _cli("convert", str(ck), str(out / "copy"), "--to", "zarr", cwd=tmp_path)
    _one_error_line(run, "convert", pattern)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("damage", ["flipped-byte", "missing-zarr-json"])
def test_convert_of_a_damaged_checkpoint_never_touches_an_existing_destination(good, tmp_path, damage):
    ck, _ = _damaged(good, tmp_path, damage)
    dst = tmp_path / "dst"
    shutil.copytree(good, dst)  # a destination that holds something of value
    before = _listing(dst)
    run = _cli("convert", str(ck), str(dst), cwd=tmp_path)
    pattern = re.compile(r"a destination that does not exist yet \(nothing is overwritten\); received: "
                         + re.escape(f"{dst} exists") + "$")
    _one_error_line(run, "convert", pattern)
    assert _listing(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "dst"]  # no temporary folder beside it
