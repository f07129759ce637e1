"""`tilegraph train`'s config as a new user meets it (session 41's audit of the config file and
`--set`): each mistake below was a bare or misleading message, or went through unread.

- a YAML or JSON file given as the config said only tomllib's "Expected '=' after a key" or
  "Invalid statement": it names the format it reads as, and that tilegraph reads TOML;
- a key or section given twice said "Cannot overwrite a value" / "Cannot declare ('train',) twice":
  it says a key or section is given twice;
- a key above the first section (`steps = 5`) was "unknown [steps]", a section; a key in the wrong
  section (`[train] seq_len`, `--set train.seq_len=`, `[model] lr`) got no hint, or a wrong one:
  each names the section that holds it;
- an unknown key with no close name (`[train] foo = 1`) was "unknown train.foo" beside the list of
  sections: it lists its section's keys;
- `--set 'data.sources=[a.txt,b.txt]'` (strings unquoted in a TOML list) was "must be a
  non-empty list of strings, not '[a.txt,b.txt]'": it shows the quoting that works;
- `--set train.lr=.001` (a number Python reads and TOML does not) was "must be a number > 0, not
  '.001'": it is the number;
- `--set output.tensorboard=True` / `runtime.mpi=yes` / `model.recompute=1`, and `lr = "1e-3"`
  or `sources = "data/*.txt"` in a file, said what the key wants but not why the value missed:
  TOML's spelling is named;
- a config saved "UTF-8 with BOM" (Notepad) was "Invalid statement (at line 1, column 1)": the
  BOM is named;
- `[model] vocab_size = "Tokenizer"` (or "auto") was "[tilegraph.models.GPT2Config] vocab_size
  must be a positive int": it names "tokenizer", the one word it takes;
- `--set train.lr= 1e-3` (a space after '=') took 1e-3 for the config file: "an existing TOML
  config file; received: 1e-3" now says a --set value may have come apart.

No cluster starts: every case fails before any work (the configs are read in this process)."""

import re

import pytest

from tilegraph._errors import TileError
from tilegraph.cli import main
from tilegraph.cli.config import apply_overrides, build_model, check_config, load_config, make_tokenizer


def _job(tmp_path, text: str | None = None, sets=(), name: str = "my.toml"):
    """Read a config (``text`` written to ``name``) and ``--set`` pairs as `tilegraph train` does,
    up to the model; the TileError's text, or None where all is well."""
    path = None
    if text is not None:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
    try:
        cfg, source = load_config(None if path is None else str(path))
        apply_overrides(cfg, list(sets))
        check_config(cfg, source)
        build_model(cfg["model"], make_tokenizer(cfg["data"]["tokenizer"]), 0, cfg["data"]["seq_len"])
    except TileError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name, text, looks", [
    ("my.toml", "train:\n  steps: 10\n  lr: 0.001\n", "YAML"),
    ("my.yaml", "---\ntrain: {steps: 10}\n", "YAML"),
    ("my.toml", "[train]\nsteps: 5\n", "YAML"),  # INI-style "key: value" under a TOML header
    ("my.json", '{"train": {"steps": 10}}', "JSON"),
    ("my.toml", '{"train": {"steps": 10}}', "JSON"),
])
def test_a_config_in_another_format_is_named_so(tmp_path, name, text, looks):
    err = _job(tmp_path, text, name=name)
    assert err.startswith(f"[tilegraph train] a valid TOML config file (it reads as {looks}: tilegraph train "
                          "reads TOML only, [section] headers and key = value lines"), err
    assert f"received: {tmp_path / name}: " in err


def test_a_config_in_another_format_from_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("train:\n  steps: 10\n")
    assert main(["train", "my.yaml", "--out", "run", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "(it reads as YAML: tilegraph train reads TOML only" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_toml_syntax_error_gets_no_format_hint(tmp_path):
    err = _job(tmp_path, "[train]\nsteps = \n")
    assert err.startswith("[tilegraph train] a valid TOML config file; received:"), err


@pytest.mark.parametrize("text, line", [
    ("[train]\nsteps = 1\nsteps = 2\n", 3),
    ("[train]\nsteps = 1\n[data]\nseq_len = 32\n[train]\nlr = 1e-3\n", 5),
])
def test_a_key_or_section_given_twice_is_named_so(tmp_path, text, line):
    err = _job(tmp_path, text)
    assert f"(at line {line}, column" in err
    assert err.endswith("(a key given twice in one section, or a section twice: keep one)"), err


def test_a_key_outside_any_section_names_its_section(tmp_path):
    err = _job(tmp_path, "steps = 5\n[train]\nlr = 1e-3\n")
    assert "received: unknown steps = 5 outside any section (a key of [train]: train.steps) in " in err, err
    assert "[steps]" not in err


@pytest.mark.parametrize("text, sets, hint", [
    ("[train]\nseq_len = 32\n", (), "unknown train.seq_len (a key of [data]: data.seq_len) in "),
    ("[data]\nlr = 1e-3\n", (), "unknown data.lr (a key of [train]: train.lr) in "),
    ("[train]\nn_layers = 2\n", (), "unknown train.n_layers (a key of [model]: model.n_layers) in "),
    # a close name in its own section still comes first
    ("[train]\nwarmpu = 2\n", (), "unknown train.warmpu (did you mean warmup?) in "),
    (None, ("train.seq_len=32",), "with a known key (a key of [data]: data.seq_len); received: 'train.seq_len=32'"),
    (None, ("lr=1e-3",), "with a known key (a key of [train]: train.lr); received: 'lr=1e-3'"),
    (None, ("train.stepz=3",), "with a known key (did you mean train.steps?); received: 'train.stepz=3'"),
    ("[model]\nlr = 1\nn_layer = 2\n", (), "received: unknown lr (a key of [train]: train.lr), n_layer (did you mean "
                                          "n_layers?)"),
    (None, ("model.dropout=0.1",), "received: unknown dropout (a key of [peft]: peft.dropout)"),
])
def test_a_key_in_the_wrong_section_names_the_right_one(tmp_path, text, sets, hint):
    err = _job(tmp_path, text, sets)
    assert err is not None and hint in err, err


@pytest.mark.parametrize("value, shown", [
    ("[a.txt,b.txt]", '["a.txt", "b.txt"]'),
    ("a.txt,b.txt", '["a.txt", "b.txt"]'),
    ("data/x.txt", '["data/x.txt"]'),
    ("['a.txt', b.txt]", '["a.txt", "b.txt"]'),
])
def test_set_of_a_list_without_quotes_shows_the_quoting_that_works(tmp_path, value, shown):
    err = _job(tmp_path, sets=(f"data.sources={value}",))
    assert err == ("[tilegraph train --set] data.sources=LIST: a TOML list of strings, each in double quotes, the "
                   f"whole in single quotes for the shell, e.g. --set 'data.sources={shown}'; received: "
                   f"{'data.sources=' + value!r}"), err


def test_set_of_a_quoted_list_and_of_strings_with_spaces_and_equals(tmp_path):
    cfg, _ = load_config(None)
    apply_overrides(cfg, ['data.sources=["a b.txt", "c=d.txt"]', "output.dir=my runs/x=1",
                          "runtime.address=tcp://h:1?a=b", "peft.targets=['attn.q']"])
    assert cfg["data"]["sources"] == ["a b.txt", "c=d.txt"]
    assert cfg["output"]["dir"] == "my runs/x=1" and cfg["runtime"]["address"] == "tcp://h:1?a=b"
    assert cfg["peft"]["targets"] == ["attn.q"]


@pytest.mark.parametrize("text, want", [(".001", 0.001), ("5.", 5.0), ("-.5e-2", -0.005), ("1e-3", 1e-3),
                                        ("1_000", 1000), ("+3", 3)])
def test_set_of_a_number_python_writes(text, want):
    cfg, _ = load_config(None)
    apply_overrides(cfg, [f"train.lr={text}"])
    assert cfg["train"]["lr"] == want and type(cfg["train"]["lr"]) is type(want)


@pytest.mark.parametrize("sets, text, message", [
    (("output.tensorboard=True",), None, "output.tensorboard must be false, or true with TensorBoard installed"),
    (("runtime.mpi=yes",), None, "runtime.mpi must be true or false, not 'yes'"),
    (("model.recompute=1",), None, "model.recompute must be true or false, not 1"),
    ((), "[output]\ntensorboard = 'false'\n", "not 'false'"),
])
def test_a_boolean_spelt_otherwise_names_tomls_spelling(tmp_path, sets, text, message):
    err = _job(tmp_path, text, sets)
    assert message in err and "(TOML writes a boolean as true or false, lowercase and unquoted)" in err, err


@pytest.mark.parametrize("text, message", [
    ("[train]\nlr = '1e-3'\n", "train.lr must be a number > 0, not '1e-3' (a string: write the number without "
                               "quotes, 1e-3)"),
    ("[train]\nsteps = \"10\"\n", "train.steps must be an integer >= 1, not '10' (a string: write the number "
                                  "without quotes, 10)"),
])
def test_a_quoted_number_is_named_a_string(tmp_path, text, message):
    err = _job(tmp_path, text)
    assert message in err, err


@pytest.mark.parametrize("text", ["[train]\nlr = 'fast'\n", "[train]\nlr = 'inf'\n",
                                  "[train]\nrestart_on_failure = true\n"])
def test_no_hint_where_none_fits(tmp_path, text):
    err = _job(tmp_path, text)
    assert not re.search(r"TOML writes|without quotes", err), err


def test_an_empty_or_comment_only_config_is_the_default_job(tmp_path):
    default, _ = load_config(None)
    for text in ("", "# nothing yet\n\n"):
        (tmp_path / "e.toml").write_text(text)
        assert load_config(str(tmp_path / "e.toml"))[0] == default


def test_unicode_paths_survive(tmp_path):
    folder = tmp_path / "données été"
    folder.mkdir()
    (folder / "my.toml").write_text('[output]\ndir = "runs/ünï cødé"\n[data]\nsources = ["текст/*.txt"]\n',
                                    encoding="utf-8")
    cfg, source = load_config(str(folder / "my.toml"))
    check_config(cfg, source)
    assert cfg["output"]["dir"] == "runs/ünï cødé" and cfg["data"]["sources"] == ["текст/*.txt"]
    assert source == str(folder / "my.toml")


@pytest.mark.parametrize("text, message", [
    ('[data]\nsources = "data/*.txt"\n',
     'data.sources must be a non-empty list of strings, not \'data/*.txt\' (a string: write a list, ["data/*.txt"])'),
    ('[peft]\ntargets = "attn.q"\n', 'peft.targets must be a non-empty list of strings, not \'attn.q\' (a string: '
                                     'write a list, ["attn.q"])'),
])
def test_one_string_where_a_list_goes_shows_the_list(tmp_path, text, message):
    err = _job(tmp_path, text)
    assert message in err, err


def test_model_key_hint_names_a_close_field_or_the_keys_section():
    from tilegraph.cli.config import model_key_hint

    fields = ("dim", "n_layers", "n_heads", "vocab_size")
    assert model_key_hint("n_layer", fields) == " (did you mean n_layers?)"
    assert model_key_hint("lr", fields) == " (a key of [train]: train.lr)"
    assert model_key_hint("rank", fields) == " (a key of [peft]: peft.rank)"
    assert model_key_hint("zzz", fields) == ""


def test_a_config_with_a_byte_order_mark_is_named_so(tmp_path):
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    with pytest.raises(TileError) as e:
        load_config(str(tmp_path / "bom.toml"))
    assert str(e.value) == ('[tilegraph train] a TOML config file in UTF-8 without a byte-order mark (an editor\'s '
                            '"UTF-8 with BOM": save it as plain UTF-8); received: '
                            f'{tmp_path / "bom.toml"} (begins with a BOM)')


def test_a_set_value_after_a_space_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", "train.lr=", "1e-3", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert ("an existing TOML config file; received: 1e-3 (no such file: a value of --set after a space? write --set "
            "SECTION.KEY=VALUE as one word)") in err, err
    assert main(["train", "nothere.toml", "--out", "run"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("received: nothere.toml")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["Tokenizer", "auto", "50257"])
def test_a_vocab_size_word_names_the_one_it_takes(tmp_path, value):
    err = _job(tmp_path, f"[model]\nvocab_size = {value!r}\n")
    assert err == ('[tilegraph train [model]] vocab_size: an integer >= the tokenizer\'s 257, or "tokenizer" (the '
                   f"tokenizer's own); received: vocab_size = {value!r}"), err


def test_an_unknown_key_without_a_close_name_lists_its_sections_keys(tmp_path):
    err = _job(tmp_path, "[output]\nbar = 2\n[train]\nwarmpu = 3\n")
    assert ("received: unknown output.bar ([output] has dir, checkpoint_every, checkpoint_keep, tensorboard), "
            "train.warmpu (did you mean warmup?) in ") in err, err


# --- with the proposed patches of train.py, runs.py and finetune.py (session 41, config audit) ---

def test_a_set_and_its_flag_that_disagree_are_refused(tmp_path, capsys, monkeypatch):
    """`--set train.steps=500 --steps 5` ran 5 steps without a word: one of the two is a slip."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", "train.steps=500", "--steps", "5", "--out", "run", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("[tilegraph train --set] one value per key: a --set and the flag that sets the same key agree, or only "
            "one of them is given; received: --set train.steps=500 and --steps 5") in err, err
    assert not (tmp_path / "run").exists()


def test_a_set_and_its_flag_that_agree_pass():
    from tilegraph.cli.train import check_overridden

    cfg, _ = load_config(None)
    apply_overrides(cfg, ["train.lr=1e-3", "train.steps=5"])
    check_overridden(cfg, ["train.lr=1e-3", "train.steps=5"], {"train.lr": ("--lr", 0.001), "train.steps": ("--steps", 5)})


def test_the_resume_command_repeats_the_runs_set_pairs():
    """`continue with tilegraph train my.toml --resume CK` left out the run's --set pairs: the
    resumed run took the config's model.recompute, [runtime] and [output] without a word."""
    import shlex

    from tilegraph.cli.runs import resume_command

    command = resume_command("my runs/c.toml", "r/checkpoints/step-000002",
                             ["model.recompute=true", 'data.sources=["a b.txt"]', "model.init=base"])
    assert shlex.split(command) == ["tilegraph", "train", "my runs/c.toml", "--set", "model.recompute=true", "--set",
                                    'data.sources=["a b.txt"]', "--resume", "r/checkpoints/step-000002"]
    assert resume_command(None, "ck") == "tilegraph train --resume ck"


def test_init_model_keys_get_the_hint_build_model_gives():
    from tilegraph import models
    from tilegraph.cli.finetune import architecture_disagreements

    model = models.build(models.config("gpt2-debug"))
    problems = dict(architecture_disagreements(model, {"n_layer": 2, "lr": 1}, "ck", None))
    assert problems["n_layer"].endswith("(did you mean n_layers?)") and problems["lr"].endswith("(a key of [train]: train.lr)")
