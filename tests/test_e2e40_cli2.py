"""Command-line leftovers of session 40's first audit, as a user meets them:

- `tilegraph train --resume CK` whose tilegraph_data.json is damaged (not JSON, or not an object)
  read the job's own [data] instead of the run's text without a word (the default corpus, all of
  it, then refused as "the [data] sources its checkpoint records ... hold other text now"): it is
  refused naming the file and what is wrong, before any text is read; a job that names its
  [data] sources gets one warning line and its text is checked against the run's tokens;
- `tilegraph convert` to a destination that cannot be written, and eval/convert/generate of a
  Hugging Face folder without safetensors, named the Python API ("[tilegraph.io.save_checkpoint(
  ...)]", "[tilegraph.models.GPT2.to_hf(...)]", "[tilegraph.io.safetensors.open_checkpoint(...)]")
  and said "earlier checkpoints are untouched" of a folder convert makes new;
- a quantized Hugging Face folder (config.json's quantization_config: GPTQ, AWQ, bitsandbytes)
  failed in eval, generate, convert and train --init as 40 "missing"/"unexpected" tensors: each
  refuses it as what it is, and says how to get float weights, before any work.

One 2-step run on a text file of its own serves the tests."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_e2e39_cli import SMALL  # the debug GPT-2 on a little text, one worker process
from test_e2e40_cli import _error, _main

pytestmark = pytest.mark.distributed

CK = "run/checkpoints/step-000002"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml``, ``mine.txt`` and ``run``, a 2-step run of small.toml on
    mine.txt (named on the command line: the config names no sources)."""
    root = tmp_path_factory.mktemp("e2e40cli2")
    (root / "small.toml").write_text(SMALL)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = np.random.default_rng(0)
    (root / "mine.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(3000)))
    code, _, err = _main(root, "train", "small.toml", "--out", "run", "--no-progress",
                         "--set", 'data.sources=["mine.txt"]')
    assert code == 0, err
    return root


# ---------------------------------------------------------------- --resume, damaged data record ----
@pytest.mark.parametrize("text, problem", [("{bad", "Expecting property name"),
                                           ('"x"', "str, not a JSON object")])
def test_a_resume_refuses_a_damaged_data_record_before_reading_any_text(root, tmp_path, text, problem):
    """Without [data] sources, the resumed run read the default corpus (the standard library) in
    place of the run's mine.txt, then was refused as the run's recorded sources having "other
    text now"; with the config that started it (which names no sources) the same."""
    ck = tmp_path / "ck"
    shutil.copytree(root / CK, ck)
    (ck / "tilegraph_data.json").write_text(text)
    want = ("tilegraph train: error: [tilegraph train --resume] a readable tilegraph_data.json in the checkpoint: a "
            "resumed run reads the text of the run it continues, which it records; put the run's record back (the "
            "same file of another of its checkpoints), or name that text: [data] sources in the job's config, or "
            "--set 'data.sources=[\"PATH\"]' (its tokens are checked against the run's); received: "
            f"{ck}/tilegraph_data.json: ")
    for config in ([], ["small.toml"]):
        err = _error(root, "train", *config, "--resume", ck, "--out", tmp_path / "r", "--steps", 1, "--no-progress")
        assert err.startswith(want) and problem in err, err
        assert not (tmp_path / "r").exists()  # refused before the output folder (and any text)


def test_a_resume_that_names_its_sources_warns_of_a_damaged_data_record(root, tmp_path):
    """A job that names the run's text goes on, saying that the record was not read; its tokens
    are checked against the run's (other text is refused as before)."""
    ck = tmp_path / "ck"
    shutil.copytree(root / CK, ck)
    (ck / "tilegraph_data.json").write_text("{bad")
    code, out, err = _main(root, "train", "small.toml", "--resume", ck, "--out", tmp_path / "r", "--steps", 1,
                           "--no-progress", "--set", 'data.sources=["mine.txt"]')
    assert code == 0, err
    assert re.search(rf"^tilegraph train: warning: {re.escape(str(ck))}/tilegraph_data\.json: Expecting property "
                     r"name .*: not read; the resumed run reads the \[data\] sources the job names \(--set "
                     r"data\.sources=\[\"mine\.txt\"\]\), checked against the run's tokens$", err, re.M), err
    assert "step-000003" in out
    # the record it writes is the job's, readable again
    record = json.loads((tmp_path / "r" / "checkpoints" / "step-000003" / "tilegraph_data.json").read_text())
    assert record["sources"] == [str(root / "mine.txt")] and record["tokens"] == json.loads(
        (root / CK / "tilegraph_data.json").read_text())["tokens"]
    # other text named is refused by its tokens, as with a readable record
    code, _, err = _main(root, "train", "small.toml", "--resume", ck, "--out", tmp_path / "r2", "--steps", 1,
                         "--no-progress", "--set", 'data.sources=["small.toml"]')
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "tilegraph train: error: [tilegraph train --resume] the text of the run it continues ("), err


# ----------------------------------------------------------- errors named by the command ----
def test_convert_to_a_destination_it_cannot_write_is_named_by_the_command(root, tmp_path):
    """They named the Python API and said "earlier checkpoints are untouched" (the Zarr writer)
    or "(File exists) ... received: DST" of a file where a folder must be (the HF writer)."""
    (tmp_path / "afile").write_text("x")
    for to in ("zarr", "hf"):
        assert _error(root, "convert", CK, tmp_path / "afile" / "x", "--to", to) == (
            "tilegraph convert: error: [tilegraph convert] a destination that can be made: a file stands where a "
            f"folder above it must be (nothing was written); received: {tmp_path}/afile/x: {tmp_path}/afile is a file")
        what = "checkpoint" if to == "zarr" else "Hugging Face folder"
        err = _error(root, "convert", CK, "/proc/nope", "--to", to)
        assert re.fullmatch(rf"tilegraph convert: error: \[tilegraph convert\] could not write the {what} \(.+\); "
                            r"nothing was written \(/proc/nope was not made\); received: /proc(/nope)?", err), err
        assert not Path("/proc/nope").exists()


@pytest.mark.parametrize("command", ["eval", "generate", "convert"])
def test_a_hugging_face_folder_without_safetensors_is_named_by_the_command(root, tmp_path, command):
    """It was "[tilegraph.io.safetensors.open_checkpoint(FOLDER)] expected a .safetensors file or
    a folder with ...; received: none found"."""
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(_hf_folder(tmp_path) / "config.json", folder)
    args = {"eval": ["--local"], "generate": ["--local", "--prompt", "hi"], "convert": [tmp_path / "out"]}[command]
    assert _error(root, command, folder, *args) == (
        f"tilegraph {command}: error: [tilegraph {command}] a Hugging Face folder with its weights: model.safetensors, "
        f"or shards with model.safetensors.index.json, beside config.json; received: {folder} holds no safetensors file")


# ----------------------------------------------------------- quantized Hugging Face folders ----
def _hf_folder(tmp_path: Path) -> Path:
    """A gpt2-debug Hugging Face folder (float32) in ``tmp_path``."""
    import tilegraph as tg

    folder = tmp_path / "float"
    if not folder.exists():
        tg.models.build("gpt2-debug").to_hf(folder)
    return folder


def _quantized(tmp_path: Path, quantization: dict) -> Path:
    """The gpt2-debug folder as a GPTQ tool leaves it: config.json's ``quantization_config``, each
    block's Linear weight replaced by packed int32 qweight/qzeros, float16 scales and g_idx."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "gptq"
    shutil.copytree(_hf_folder(tmp_path), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization}))
    tensors = load_file(folder / "model.safetensors")
    for name in [k for k in tensors if ".h." in k and k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]:
        w, base = tensors.pop(name), name.removesuffix(".weight")
        tensors[f"{base}.qweight"] = np.zeros((w.shape[0] // 8, w.shape[1]), np.int32)
        tensors[f"{base}.qzeros"] = np.zeros((w.shape[0] // 32, w.shape[1] // 8), np.int32)
        tensors[f"{base}.scales"] = np.ones((w.shape[0] // 32, w.shape[1]), np.float16)
        tensors[f"{base}.g_idx"] = (np.arange(w.shape[0]) // 32).astype(np.int32)
    save_file(tensors, folder / "model.safetensors")
    return folder


QUANTIZED = ("a Hugging Face folder of float weights (float32, float16 or bfloat16): this one is quantized, its Linear "
             "weights packed integers under other names (qweight, qzeros, scales, ...), which tilegraph does not read; "
             "dequantize it with the tool that quantized it (GPTQ, AWQ, bitsandbytes) and save the float weights with "
             "save_pretrained, or start from the float model it was quantized from (`tilegraph convert FOLDER NEW --to "
             "zarr --quantize int4` quantizes that in tilegraph's own format); received: ")


@pytest.mark.parametrize("quantization, how", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}, "quant_method 'gptq', bits 4"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     "quant_method 'bitsandbytes', load_in_4bit True, bnb_4bit_quant_type 'nf4'")])
def test_a_quantized_hugging_face_folder_is_refused_as_one_by_every_command(root, tmp_path, quantization, how):
    """eval, generate, convert and train --init failed with "[tilegraph.models.from_hf(FOLDER)]
    the checkpoint does not match the gpt2 model (40 problems); received: missing: ...;
    unexpected: ...qweight; ..." (and made no output, as now)."""
    folder = _quantized(tmp_path, quantization)
    received = f"{folder}: config.json quantization_config ({how})"
    for command, args in (("eval", ["--local"]), ("generate", ["--local", "--prompt", "hi"]),
                          ("convert", [tmp_path / "out"])):
        assert _error(root, command, folder, *args) == (
            f"tilegraph {command}: error: [tilegraph {command}] {QUANTIZED}{received}")
    assert _error(root, "train", "small.toml", "--init", folder, "--out", tmp_path / "r", "--steps", 1,
                  "--no-progress") == f"tilegraph train: error: [tilegraph train --init] {QUANTIZED}{received}"
    assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()
    # its float original converts (the check reads config.json alone)
    code, _, err = _main(root, "convert", _hf_folder(tmp_path), tmp_path / "z", "--to", "zarr")
    assert code == 0, err
