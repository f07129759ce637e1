"""convert, generate, eval and info: a destination inside the source, --seed with greedy
decoding, the command named in a --tokenizer error, valid JSON that is no tokenizer, a Hugging
Face folder with a broken config.json, and SIGTERM closing the cluster (exit 143)."""

import os
import signal
import subprocess
import sys
import time


from test_cli_inputs import _main as _one_line, ckpt  # noqa: F401  (in-process; a debug GPT-2's folders)


def _main(capsys, *args):
    """The one line of error of ``tilegraph ARGS`` (exit status 2), without its line end."""
    return _one_line(capsys, *args).strip()


def _listing(folder):
    return sorted((str(p), p.stat().st_size) for p in folder.rglob("*"))


def test_convert_refuses_a_destination_inside_the_source(ckpt, capsys):
    for src, dst in (("zarr", "zarr/sub"), ("hf", "hf/inner.zarr"), ("zarr", "zarr/model/../new")):
        before = _listing(ckpt / src)
        err = _main(capsys, "convert", str(ckpt / src), str(ckpt / dst))
        assert (f"[tilegraph convert] a destination outside the source folder (and not holding it); received: "
                f"{ckpt / dst}, inside {ckpt / src}") in err, err
        assert _listing(ckpt / src) == before


def test_generate_refuses_a_seed_with_greedy_decoding(ckpt, capsys):
    from tilegraph.cli import main

    hf = str(ckpt / "hf")
    err = _main(capsys, "generate", hf, "--tokenizer", "byte", "--local", "--seed", "5")
    assert "no --seed either) takes no --top-k" in err and err.endswith(
        "received: --seed 5 (greedy: the default strategy without --top-k or --top-p)"), err
    err = _main(capsys, "generate", hf, "--tokenizer", "byte", "--strategy", "greedy", "--seed", "0")
    assert err.endswith("received: --seed 0 with --strategy greedy"), err
    ids = []  # sampling without --seed draws as with --seed 0 (the default)
    for seed in ([], ["--seed", "0"]):
        assert main(["generate", hf, "--tokenizer", "byte", "--local", "--top-k", "50", "--max-new-tokens", "8",
                     "--ids", *seed]) == 0
        ids.append(capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1])
    assert ids[0] == ids[1]


def test_a_bad_tokenizer_file_is_named_with_the_command(ckpt, capsys, tmp_path):
    (tmp_path / "notjson.txt").write_text("hello\n")
    (tmp_path / "wrong.json").write_text('{"a": 1}')
    for command in ("eval", "generate"):
        err = _main(capsys, command, str(ckpt / "zarr"), "--tokenizer", str(tmp_path / "notjson.txt"))
        assert err.startswith(f"tilegraph {command}: error: [tilegraph {command} --tokenizer] "), err
        err = _main(capsys, command, str(ckpt / "zarr"), "--tokenizer", str(tmp_path / "wrong.json"))
        assert err.endswith(f"this one is JSON but not a tokenizer; received: {tmp_path / 'wrong.json'}: an object "
                            "with keys 'a'"), err


def test_info_names_a_broken_config_json_and_suggests_no_convert(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{bad")
    err = _main(capsys, "info", str(tmp_path / "hf"))
    assert "config.json, which describes its model, must be a JSON object" in err and "convert" not in err, err
    assert err.endswith(f"received: {tmp_path / 'hf' / 'config.json'}: Expecting property name enclosed in double "
                        "quotes: line 1 column 2 (char 1)"), err


def test_run_stoppable_returns_128_plus_the_signal_and_restores_the_handlers(capfd):
    from tilegraph.cli.signals import run_stoppable

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    def work(sig):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends
        return 0

    assert run_stoppable("tilegraph eval", lambda: work(signal.SIGTERM)) == 143
    assert run_stoppable("tilegraph eval", lambda: work(signal.SIGINT)) == 130
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    err = capfd.readouterr().err
    assert "tilegraph eval: SIGTERM: stopping" in err and "tilegraph eval: SIGINT: stopping" in err


def test_a_stop_that_lands_in_a_finalizer_is_raised_again_when_it_returns(capfd):
    # CI, stop 55: SIGTERM reached `tilegraph eval` while a Dask future's finalizer ran; Python
    # printed the Stopped as "Exception ignored in" and the eval ran on to exit 0
    from tilegraph.cli.signals import run_stoppable

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer

    def work():
        Finalized()  # dropped at once: its __del__ runs
        end = time.monotonic() + 5
        while time.monotonic() < end:
            time.sleep(0.01)
        return 0

    hook = sys.unraisablehook
    start = time.monotonic()
    assert run_stoppable("tilegraph eval", work) == 143
    assert time.monotonic() - start < 4
    assert sys.unraisablehook is hook
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and err.count("SIGTERM: stopping") == 1, err


def test_a_stop_swallowed_by_the_work_still_exits_with_the_signal(capfd):
    from tilegraph.cli.signals import run_stoppable

    def work():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except BaseException:  # (code that swallows everything)
            pass
        return 0

    assert run_stoppable("tilegraph eval", work) == 130
    assert "SIGINT: stopping" in capfd.readouterr().err


def test_sigterm_during_eval_closes_the_cluster_and_exits_143(ckpt, tmp_path):
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 20000)
    proc = subprocess.Popen([sys.executable, "-m", "tilegraph.cli", "eval", str(ckpt / "zarr"), "--tokenizer", "byte",
                             "--data", str(tmp_path / "text.txt"), "--batches", "2000"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout.readline().startswith("tilegraph eval: ")  # printed before the cluster starts
        time.sleep(4)  # the cluster up, evaluating
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, (proc.returncode, err)
    assert "loss" not in out and "tilegraph eval: SIGTERM: stopping" in err and "leaked" not in err, err
