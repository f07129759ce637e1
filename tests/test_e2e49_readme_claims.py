"""What the README names, checked against the code, so that a renamed flag, config key, module
attribute, keyword argument, bench option or file cannot leave it stale without a failing test.

tests/test_e2e40_readme.py runs the README's Python snippets and tests/test_readme_own_ops.py its
"Your own ops" example; these tests run nothing: they read the README's text and ask the parsers,
the shipped config and the modules whether what it names exists.

- every ``tilegraph ...`` command line of a ```bash block parses with that command's parser (no
  unrecognized argument, no usage error), and every ``--flag`` named inline beside ``tilegraph
  CMD`` is one of CMD's options;
- every ``--flag`` named on its own (`` `--resume` ``, `` `--steps N` ``) is an option of some
  ``tilegraph`` command, of a bench script, or of the few other tools the README shows;
- every ``bench/NAME.py --flag`` is an argument that script defines;
- every ``[section] key`` and ``section.key=`` is a key of the shipped examples/configs/default.toml
  ([model]: also any field of a flavor's model config), and every concrete example value passes the
  CLI's check of that key;
- every ``tg.X`` / ``tilegraph.X`` dotted name resolves, and every keyword argument given to a
  tilegraph callable (``tg.Trainer(..., step_timeout=...)``) is one of its parameters;
- every repository path the README names (``bench/...``, ``tests/...``, ``examples/...``) exists.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEFAULT_TOML = ROOT / "examples" / "configs" / "default.toml"
SECTIONS = ("model", "peft", "data", "train", "output", "runtime")

#: flags of other tools that the README shows beside tilegraph's (jupyter, dask-mpi, dask worker,
#: Slurm, mpiexec)
OTHER_TOOLS_FLAGS = {"--to", "--execute", "--output", "--protocol", "--memory-limit", "--cpus-per-task", "--cpus",
                     "--worker-port", "--scheduler-file", "--nthreads", "--help"}
#: dotted names the README writes on purpose that are no attribute: a misspelt setting it shows
#: refused, and a Dask config file's name
NOT_NAMES = {"tg.config.paralel", "tilegraph.yaml"}
#: (callable, keyword) pairs of other libraries' calls that share a tilegraph name
OTHER_CALLS = {("generate", "do_sample")}


def readme() -> str:
    return README.read_text()


def code_blocks(lang: str) -> list[str]:
    return [code for fence, code in re.findall(r"^ *```(\w*)\n(.*?)^ *```", readme(), re.S | re.M) if fence == lang]


def prose() -> str:
    """The README outside its fenced blocks, each paragraph's lines joined (an inline code span
    may wrap)."""
    return re.sub(r"^ *```.*?^ *```", "", readme(), flags=re.S | re.M).replace("\n", " ")


def inline_spans() -> list[str]:
    return re.findall(r"`([^`]+)`", prose())


# ------------------------------------------------------------------------------- the CLI ----
class _Parser(Exception):
    pass


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    """``tilegraph``'s sub-parsers by command, as ``tilegraph.cli.main`` builds them (caught at
    its first parse, before any command runs)."""
    from tilegraph import cli

    real = argparse.ArgumentParser.parse_known_args

    def catch(self, *args, **kwargs):
        if self.prog == "tilegraph":
            raise _Parser(self)
        return real(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = catch
    try:
        with pytest.raises(_Parser) as caught:
            cli.main(["info"])
    finally:
        argparse.ArgumentParser.parse_known_args = real
    top = caught.value.args[0]
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"train", "eval", "generate", "info", "convert"} <= set(sub.choices)
    return dict(sub.choices)


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def bash_command_lines() -> list[list[str]]:
    """The words after ``tilegraph`` of every command line in the README's ```bash blocks (a
    ``&&`` chain's and an ``mpiexec -n N`` launch's included; comments and line continuations
    handled as a shell does)."""
    lines = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;|\|", line):
                words = shlex.split(part, comments=True)
                while words and (re.fullmatch(r"\w+=\S*", words[0]) or words[0] == "mpiexec"):
                    words = words[3:] if words[0] == "mpiexec" else words[1:]  # VAR=value, mpiexec -n N
                if words[:1] == ["tilegraph"]:
                    lines.append(words[1:])
    return lines


def test_every_tilegraph_command_line_in_a_bash_block_parses(parsers):
    lines = bash_command_lines()
    assert len(lines) >= 9 and {w[0] for w in lines} >= {"train", "generate", "info", "convert"}
    for words in lines:
        parser = parsers[words[0]]
        try:
            _, extras = parser.parse_known_args(words[1:])
        except SystemExit:  # argparse's usage error (its message is on stderr)
            pytest.fail(f"README: `tilegraph {shlex.join(words)}` is refused by its parser")
        assert not extras, f"README: `tilegraph {shlex.join(words)}`: unrecognized arguments {extras}"


def test_every_flag_named_beside_a_tilegraph_command_is_one_of_its_options(parsers):
    named = [(m.group(1), m.group(2)) for span in inline_spans()
             for m in [re.match(r"(?:mpiexec -n \d+ )?tilegraph (\w+)(.*)", span)] if m]
    assert len(named) >= 10
    for command, rest in named:
        assert command in parsers, f"README: `tilegraph {command}{rest}`: no such command"
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
            assert flag in options(parsers[command]), f"README: `tilegraph {command}{rest}`: {command} has no {flag}"


def bench_arguments() -> dict[str, set[str]]:
    return {p.name: set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", p.read_text()))
            for p in (ROOT / "bench").glob("*.py")}


def test_every_flag_named_alone_is_an_option_of_some_tool_shown(parsers):
    known = set().union(*(options(p) for p in parsers.values()), *bench_arguments().values(), OTHER_TOOLS_FLAGS)
    alone = [s for s in inline_spans() if s.startswith("--") and not s.startswith("--tls-*")]
    assert len(alone) >= 40
    for span in alone:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span.split("=")[0] if "=" in span[:8] else span):
            assert flag in known, f"README: `{span}`: {flag} is no option of tilegraph, of a bench script " \
                                  f"or of the other tools the README shows"


def test_every_bench_script_flag_is_one_that_script_defines():
    arguments = bench_arguments()
    uses = [(m.group(1), m.group(2)) for text in inline_spans() + code_blocks("bash")
            for m in re.finditer(r"bench/(\w+\.py)([^`\n]*)", text)]
    uses += [(m.group(1), m.group(2)) for span in inline_spans() for m in [re.match(r"(bench_\w+\.py)(.*)", span)] if m]
    assert len(uses) >= 10
    for script, rest in uses:
        assert script in arguments, f"README: bench/{script}: no such bench script"
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
            assert flag in arguments[script], f"README: `{script}{rest}`: {script} defines no {flag}"


# ---------------------------------------------------------------------------- the config ----
@pytest.fixture(scope="module")
def default_config() -> dict:
    return tomllib.loads(DEFAULT_TOML.read_text())


@pytest.fixture(scope="module")
def model_fields() -> frozenset[str]:
    from tilegraph.cli.config import model_fields
    from tilegraph.models import FLAVORS, config

    return model_fields(FLAVORS, config)


def config_keys_named() -> set[tuple[str, str]]:
    """(section, key) of every `` `[section] key` `` and ``--set section.key=`` the README names
    (in prose: "[train] steps_per_graph", "`[output] checkpoint_keep`")."""
    text, sections = prose(), "|".join(SECTIONS)
    named = set(re.findall(rf"`\[({sections})\] ([a-z_]+)\b", text))
    named |= set(re.findall(rf"`\[({sections})\]` ([a-z_]+)`", text))
    named |= set(re.findall(rf"--set '?({sections})\.([a-z_]+)=", readme().replace("\n", " ")))
    return named


def test_every_config_key_the_readme_names_is_a_key_of_the_shipped_config(default_config, model_fields):
    named = config_keys_named()
    assert len(named) >= 20
    for section, key in sorted(named):
        assert key in default_config[section] or (section == "model" and key in model_fields), \
            f"README names [{section}] {key}: no key of examples/configs/default.toml"


def test_every_config_key_of_the_cli_is_in_the_shipped_config(default_config):
    """The CLI reads the config it ships: load_config(None) is default.toml, key for key, so what
    the README says of default.toml is what `tilegraph train` runs."""
    from tilegraph.cli.config import CONFIG_CHECKS, load_config

    assert load_config(None)[0] == default_config
    assert {name.split(".")[0] for name in CONFIG_CHECKS} <= set(SECTIONS)
    for name in CONFIG_CHECKS:
        section, key = name.split(".")
        assert section == "model" or key in default_config[section], f"the CLI checks {name}, not in default.toml"


def test_every_example_value_the_readme_gives_a_config_key_passes_its_check():
    from tilegraph.cli.config import apply_overrides, load_config, value_problems
    from tilegraph.plotting import has_tensorboard

    text, sections = readme().replace("\n", " "), "|".join(SECTIONS)
    examples = [f"{s}.{k}={v}" for s, k, v in re.findall(rf"`\[({sections})\] ([a-z_]+) = ([^`]+)`", text)]
    examples += re.findall(rf"--set '?((?:{sections})\.[a-z_]+=[^`' ]+)", text)
    concrete = [e for e in examples if not re.fullmatch(r"[A-Z]+|\.\.\.", e.partition("=")[2])]
    assert len(concrete) >= 8
    for pair in concrete:
        if pair.startswith("output.tensorboard=true") and not has_tensorboard():
            continue
        cfg = load_config(None)[0]
        apply_overrides(cfg, [pair])
        assert not value_problems(cfg), f"README's example {pair}: {value_problems(cfg)}"


# ------------------------------------------------------------------------- Python names ----
def resolve(dotted: str):
    """The object a ``tg.X.Y`` / ``tilegraph.X.Y`` name stands for; AttributeError if none."""
    parts = dotted.split(".")
    obj = importlib.import_module("tilegraph")
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(["tilegraph", *parts[1:i + 1]]))
            except ImportError:
                raise AttributeError(f"{'.'.join(parts[:i])} has no {part}") from None
    return obj


def test_every_tilegraph_dotted_name_resolves():
    names = set(re.findall(r"(?<![\w.])((?:tg|tilegraph)(?:\.[A-Za-z_]\w*)+)", readme()))
    assert NOT_NAMES <= names, "an exception of this test left the README: drop it from NOT_NAMES"
    assert len(names) >= 80
    missing = []
    for name in sorted(names - NOT_NAMES):
        try:
            resolve(name)
        except AttributeError as e:
            missing.append(f"{name} ({e})")
    assert not missing, f"README names what tilegraph does not have: {missing}"


def calls(text: str):
    """(callable name, [keywords at the call's top level]) of every ``name(... kw=...)`` in text
    (a code block, or an inline span, where a call may stop unclosed: "`Trainer(perplexity=...`")."""
    for m in re.finditer(r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(", text):
        depth, piece, kws = 1, m.end(), []
        for i in range(m.end(), len(text) + 1):
            c = text[i] if i < len(text) else ")"
            depth += c in "([{"
            depth -= c in ")]}"
            if (c == "," and depth == 1) or depth == 0:
                kw = re.match(r"\s*([a-z_]\w*)\s*=(?!=)", text[piece:i])
                if kw:
                    kws.append(kw.group(1))
                piece = i + 1
            if depth == 0:
                break
        if kws:
            yield m.group(1), kws


def tilegraph_callable(name: str):
    """The tilegraph object a call's name stands for (``tg.``/``tilegraph.``/``models.``/``peft.``
    names, and the bare names of the classes and functions the README uses so), or None."""
    import tilegraph
    import tilegraph.io
    import tilegraph.models
    import tilegraph.nn
    import tilegraph.peft
    import tilegraph.sketch

    head, _, rest = name.partition(".")
    spaces = {"tg": [tilegraph], "tilegraph": [tilegraph], "models": [tilegraph.models], "peft": [tilegraph.peft]}
    bare = [tilegraph, tilegraph.models, tilegraph.peft, tilegraph.io, tilegraph.sketch, tilegraph.nn]
    for space in spaces.get(head, bare if "." not in name else []):
        obj = space
        for part in (rest if head in spaces else name).split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if callable(obj) and getattr(obj, "__module__", "").startswith(("tilegraph", "models", "io", "ops")):
            return obj
    return None


def test_every_keyword_the_readme_passes_a_tilegraph_callable_is_one_of_its_parameters():
    from tilegraph._train import COMPILE_OPTIONS

    checked, wrong = 0, []
    for name, kws in (call for text in code_blocks("python") + inline_spans() for call in calls(text)):
        obj = tilegraph_callable(name)
        if obj is None:
            continue
        params = dict(inspect.signature(obj).parameters)
        varkw = [n for n, p in params.items() if p.kind is p.VAR_KEYWORD]
        if varkw == ["compile_options"]:  # Trainer, TrainStep, EvalStep: the compile options they forward
            params.update(dict.fromkeys(COMPILE_OPTIONS))
        elif varkw:
            continue
        for kw in kws:
            checked += 1
            if kw not in params and (name.split(".")[-1], kw) not in OTHER_CALLS:
                wrong.append(f"{name}(..., {kw}=...)")
    assert checked >= 40
    assert not wrong, f"README passes keywords these do not take: {wrong}"


# ------------------------------------------------------------------------------- files ----
def test_every_repository_path_the_readme_names_exists():
    paths = set(re.findall(r"(?<![\w/.~-])((?:bench|tests|examples|tilegraph|models|ops|io)/[\w./-]*\w)", readme()))
    assert len(paths) >= 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README names files that are not in the repository: {missing}"
