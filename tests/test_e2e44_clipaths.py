"""Paths and notes of the command line as a user meets them (session 44's leftovers):

- a folder inside an adapted run's checkpoint, as deep as a checkpoint has them, given to a
  command that takes a checkpoint (eval, generate, info, convert, train --init and --resume) is
  named as a folder inside that checkpoint, with the checkpoint to pass: its root, not the adapters
  checkpoint in it. The search looked 3 folders up from the folder as given: a chunk folder of a
  format-1 array in ``adapters/`` (5 levels down) got no hint, and a relative path given inside
  ``adapters/`` was named as inside ``.`` (the adapters checkpoint);
- the note of a run started from a quantized checkpoint names what the user gave, ``--init``,
  ``--set model.init`` or the config's ``[model] init``; it said "model.init" for each.

One 1-step LoRA run of the debug GPT-2 (its last checkpoint holds ``adapters/``) and its int4
copy serve the tests."""

import json
import shutil
from pathlib import Path

import pytest


from test_e2e39_cli import SMALL  # the debug GPT-2 on a little of the stdlib, one worker process
from test_e2e40_cli import _main  # tilegraph ARGS run in a folder: exit status, stdout, stderr

pytestmark = pytest.mark.distributed

LORA = SMALL.replace("steps = 2", "steps = 1") + '[peft]\nmethod = "lora"\ntargets = ["attn.q", "attn.v"]\n'


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml``, ``lora.toml``, ``run`` (a 1-step LoRA run of the latter:
    its checkpoint holds the adapters alone in ``adapters/``) and ``q4``, that checkpoint
    converted to int4."""
    root = tmp_path_factory.mktemp("e2e44")
    (root / "small.toml").write_text(SMALL)
    (root / "lora.toml").write_text(LORA)
    code, _, err = _main(root, "train", "lora.toml", "--out", "run", "--no-progress")
    assert code == 0, err
    code, _, err = _main(root, "convert", "run/checkpoints/step-000001", "q4", "--to", "zarr", "--quantize", "int4")
    assert code == 0, err
    return root


@pytest.fixture
def checkpoint(root, tmp_path) -> Path:
    """A copy of the run's checkpoint, for a test that adds folders to it."""
    return Path(shutil.copytree(root / "run" / "checkpoints" / "step-000001", tmp_path / "step-000001"))


def _array_folders(ck: Path) -> list[Path]:
    """The folders of ``ck``'s arrays (a zarr.json of node_type "array"), the deepest first and,
    of those as deep, the adapters checkpoint's first."""
    arrays = [meta.parent for meta in ck.rglob("zarr.json")
              if json.loads(meta.read_text()).get("node_type") == "array"]
    return sorted(arrays, key=lambda p: (-len(p.relative_to(ck).parts), p.relative_to(ck).parts[0] != "adapters"))


#: each command that takes a checkpoint: its arguments ({folder}: the folder given; {out}: an
#: output that must not be written) and the head of its error
COMMANDS = [(["eval", "{folder}", "--local"], "tilegraph eval"),
            (["generate", "{folder}", "--local", "--prompt", "hi"], "tilegraph generate"),
            (["info", "{folder}"], "tilegraph info"),
            (["convert", "{folder}", "{out}"], "tilegraph convert"),
            (["train", "{config}", "--init", "{folder}", "--out", "{out}"], "tilegraph train --init"),
            (["train", "{config}", "--resume", "{folder}", "--out", "{out}"], "tilegraph train --resume")]
IDS = [head for _, head in COMMANDS]


def _error(root: Path, args: list[str], folder, tmp_path: Path, cwd: Path | None = None) -> str:
    """The one line of error of ``tilegraph ARGS`` given ``folder`` (exit status 2, nothing
    written)."""
    filled = [a.format(folder=folder, out=tmp_path / "out", config=root / "small.toml") for a in args]
    code, out, err = _main(cwd or root, *filled)
    assert code == 2, (out, err)
    assert not (tmp_path / "out").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------ a folder deep inside an adapted run's checkpoint ----
@pytest.mark.parametrize("args, head", COMMANDS, ids=IDS)
def test_the_deepest_array_folder_of_an_adapted_checkpoint_names_its_root(root, tmp_path, args, head):
    """Its deepest array folder, one of the adapters checkpoint's (``adapters/model/<parameter>``,
    as deep as ``optimizer/<state>/<parameter>``): each command names the run's checkpoint to pass,
    not ``adapters/`` (a checkpoint too) nor the folder as "a Zarr group without tilegraph's
    attributes"."""
    ck = root / "run" / "checkpoints" / "step-000001"
    deepest = _array_folders(ck)[0]
    assert deepest.relative_to(ck).parts[:2] == ("adapters", "model"), deepest
    got = _error(root, args, deepest, tmp_path)
    assert got.startswith(f"tilegraph {args[0]}: error: [{head}] a checkpoint folder"), got
    assert got.endswith(f", not a folder inside one: pass {ck}; received: {deepest}, inside the checkpoint {ck}"), got


@pytest.mark.parametrize("args, head", COMMANDS, ids=IDS)
def test_a_chunk_folder_five_levels_down_names_the_checkpoint(root, checkpoint, tmp_path, args, head):
    """A format-1 array keeps its chunks in folders (``c/<i>/<j>``): under an array of
    ``adapters/`` that is 5 levels below the checkpoint, where the search (3 levels) found none
    and the commands said "a tilegraph checkpoint (zarr.json) or a Hugging Face folder ... holds
    neither" or "holds none (no zarr.json)"."""
    deepest = _array_folders(checkpoint)[0]
    chunks = deepest / "c" / "0"
    chunks.mkdir(parents=True)
    assert len(chunks.relative_to(checkpoint).parts) == 5
    got = _error(root, args, chunks, tmp_path)
    assert got.startswith(f"tilegraph {args[0]}: error: [{head}] a checkpoint folder"), got
    assert f"not a folder inside one: pass {checkpoint}; received: {chunks}, inside the checkpoint {checkpoint}" \
        in got, got


def test_a_relative_path_given_inside_the_adapters_names_the_checkpoint_not_dot(root, tmp_path):
    """``tilegraph info model/<parameter>`` in ``CHECKPOINT/adapters``: the search stopped at ``.``
    and said "pass ." (the adapters checkpoint, which info names as adapters alone)."""
    ck = root / "run" / "checkpoints" / "step-000001"
    name = _array_folders(ck)[0].name
    for args, _ in COMMANDS:
        got = _error(root, args, f"model/{name}", tmp_path, cwd=ck / "adapters")
        assert f"pass {ck}; received: model/{name}, inside the checkpoint {ck}" in got, got
    # below the working directory the checkpoint is named as the user named the folder: relative
    got = _error(root, ["info", "{folder}"], f"run/checkpoints/step-000001/adapters/model/{name}", tmp_path)
    assert "pass run/checkpoints/step-000001; received:" in got, got


def test_a_checkpoint_and_its_adapters_are_not_inside_one(root):
    from tilegraph.cli.runs import enclosing_checkpoint

    ck = root / "run" / "checkpoints" / "step-000001"
    assert enclosing_checkpoint(ck) is None and enclosing_checkpoint(ck / "adapters") is None
    assert enclosing_checkpoint(root / "run") is None and enclosing_checkpoint(root) is None
    for folder in _array_folders(ck):  # each array folder, the adapters' too: the run's checkpoint
        assert enclosing_checkpoint(folder) == ck, folder
    for folder in _array_folders(root / "q4"):  # the quantized tiles too (model/<parameter>/<tile>)
        assert enclosing_checkpoint(folder) == root / "q4", folder


# --------------------------------------------------------------------- the quantized-init note ----
def _note(err: str) -> str:
    notes = [line for line in err.splitlines() if "is a quantized checkpoint" in line]
    assert len(notes) == 1, err
    return notes[0]


@pytest.mark.parametrize("given, named", [
    (["--init", "q4"], "tilegraph train --init: note: q4 is a quantized checkpoint"),
    (["--set", 'model.init="q4"'], "tilegraph train --set model.init: note: q4 is a quantized checkpoint"),
])
def test_the_quantized_init_note_names_the_flag_the_user_gave(root, tmp_path, given, named):
    """It said "tilegraph train model.init: note: ..." for --init too, a setting the user never wrote."""
    code, _, err = _main(root, "train", "small.toml", *given, "--out", tmp_path / "run", "--steps", "1",
                         "--no-progress")
    assert code == 0, err
    assert _note(err).startswith(f"{named} (int4: 14 of its 36 arrays): the run starts from its dequantized "
                                 "weights"), err


def test_the_quantized_init_note_names_the_configs_model_init(root, tmp_path):
    """[model] init = "q4" in the job's config (LoRA on it: the base stays int4)."""
    (tmp_path / "job.toml").write_text(LORA.replace('vocab_size = "tokenizer"\n', 'init = "q4"\n'))
    code, _, err = _main(root, "train", tmp_path / "job.toml", "--out", tmp_path / "run", "--no-progress")
    assert code == 0, err
    assert _note(err).startswith(f"tilegraph train [model] init (in {tmp_path / 'job.toml'}): note: q4 is a "
                                 "quantized checkpoint (int4: 14 of its 36 arrays)"), err
    assert "Linear weights stay quantized and frozen" in _note(err)


def test_init_source_names_each_way_of_giving_init():
    from tilegraph.cli.train import init_source

    assert init_source({"model.init": "--init q4"}) == "--init"
    assert init_source({"model.init": "--set model.init=q4"}) == "--set model.init"
    assert init_source({"model.init": "job.toml"}) == "[model] init (in job.toml)"
    assert init_source({}) == "--resume (the base its run recorded)"
