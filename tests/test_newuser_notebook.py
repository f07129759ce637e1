"""tilegraph from Jupyter, as the README's notebook user meets it: defects found by running
examples/train_debug_gpt2.ipynb and then as a user would (cells run again, interrupted, the
connect cell run twice, the loss plot shown inline, other notebook front ends)."""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.runtime import current_runtime

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "train_debug_gpt2.ipynb"
PNG = b"\x89PNG\r\n\x1a\n"
RECORDS = [{"run": "a", "step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 41)]


@pytest.fixture
def closing():
    """Runtimes and clusters a test starts, closed after it whatever it asserted."""
    opened: list = []
    yield opened
    for thing in reversed(opened):
        try:
            thing.close()
        except Exception:
            pass


# -- connect ---------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_connect_interrupted_while_the_cluster_starts_leaves_no_cluster_running(monkeypatch, closing):
    """The stop button (SIGINT) while ``tg.connect()`` started the embedded cluster: Dask's
    start was cut half-way and nothing closed it, so a worker process ran on until the kernel
    ended (failing then in Dask's atexit with "AssertionError: Status.running"), and running the
    cell again started a second cluster beside it. Now the interrupt waits for the start, the
    cluster is closed and the KeyboardInterrupt raised."""
    import distributed

    started = []

    class StopPressed(distributed.SpecCluster):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
            closing.append(self)
            os.kill(os.getpid(), signal.SIGINT)  # the stop button, the moment the workers are up
            time.sleep(0.5)  # where Python raises the KeyboardInterrupt when nothing holds it back

    monkeypatch.setattr(distributed, "SpecCluster", StopPressed)
    before = current_runtime()
    with pytest.raises(KeyboardInterrupt):
        tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True)
    assert started and started[0].status.name == "closed", started[0].status
    assert current_runtime() is before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again


@pytest.mark.distributed
def test_connect_again_warns_that_the_earlier_cluster_still_runs(closing):
    """A notebook's connect cell run twice silently started a second embedded cluster on the
    same cores, leaving the first running with the model's parameters on it (the next cells then
    failed: "held by another runtime"). Now the second call warns, naming the first."""
    first = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True)
    closing.append(first)
    with pytest.warns(UserWarning, match=r"\[tilegraph.connect\] the embedded cluster of an earlier tg.connect\(\) "
                                         r"is still running \(<tilegraph.Runtime tcp://127.0.0.1:\d+ 1 worker>\)"
                                         r".*close it first \(rt.close\(\)\).*once rt names the new one: rt.close\(\), "
                                         r"then tg.current_runtime\(\).close\(\) closes the earlier one"):
        second = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True)
    closing.append(second)
    second.close()  # the advice, when `rt` was rebound to the second cluster
    assert tg.current_runtime() is first
    tg.current_runtime().close()
    assert first.closed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none open: connecting again is quiet
        third = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True)
        closing.append(third)


# -- the loss plot, inline -------------------------------------------------------------------------
def test_plot_training_shows_inline_without_matplotlib_inline():
    """``plot_training(...)`` as a cell's value in a fresh kernel (no ``%matplotlib inline``, no
    pyplot import) showed the text "<Figure size 700x500 with 2 Axes>" and no image: the Figure,
    made without pyplot, had no formatter. IPython's formatter now finds its PNG."""
    from IPython.core.formatters import DisplayFormatter

    from tilegraph.plotting import plot_training

    data, _ = DisplayFormatter().format(plot_training(RECORDS, vocab_size=257))
    assert data["text/plain"].startswith("<Figure size 700x500 with 2 Axes>")
    assert data["image/png"][:8] == PNG


def test_trainer_plot_without_log_dir_returns_the_figure(local_scheduler, tmp_path):
    """``trainer.plot()`` in a notebook, for a Trainer without a ``log_dir`` (the notebook's):
    it drew nothing and returned None, where the README says it "draws it at any time". It
    returns the Figure now (shown inline); with a log_dir it still writes loss.png."""
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    x = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)

    def mse(m, a, b):
        d = m(a) - b
        return (d * d).mean()

    trainer = tg.Trainer(model, opt, lambda i: (x, np.tanh(x[:, :2])), loss_fn=mse, batch_size=32, progress=False,
                         batch_tiles=[(16, 8), (16, None)])
    trainer.fit(3)
    fig = trainer.plot()
    assert fig is not None and fig._repr_png_()[:8] == PNG
    assert [len(line.get_xdata()) for line in fig.axes[0].lines] == [3]  # the three steps
    assert trainer.plot(tmp_path / "loss.png") == tmp_path / "loss.png"  # a path: written, as before
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG


# -- the progress bar ------------------------------------------------------------------------------
def test_progress_bar_in_a_subclass_of_jupyters_shell(monkeypatch):
    """Google Colab's kernel shell is a subclass of ipykernel's ZMQInteractiveShell named
    "Shell": the Trainer took it for no notebook (it compared the class's exact name), and with
    stderr not a terminal showed plain progress lines every 10 s instead of the bar."""
    import IPython

    from tilegraph import _progress as progress  # (the Trainer's progress display)

    class ZMQInteractiveShell:  # stands for ipykernel.zmqshell.ZMQInteractiveShell
        pass

    class Shell(ZMQInteractiveShell):  # google.colab._shell.Shell
        pass

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    monkeypatch.setattr(sys, "stderr", open(os.devnull, "w"))  # not a terminal, as in a kernel
    try:
        assert progress._in_jupyter()
        bar = progress._progress(5, True)
        assert not isinstance(bar, progress._ProgressLines)
        bar.close()
    finally:
        sys.stderr.close()


# -- the notebook itself ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_notebook_cells_run_again(tmp_path, monkeypatch):
    """Cells run again, as a notebook user does: the LoRA cell failed the second time with
    "[tilegraph.io.save_checkpoint(...)] the checkpoint folder must not exist yet". Runs the
    notebook's cells in a kernel with the LoRA cell twice (training cell left out: the LoRA cell
    needs only the model)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from test_notebook import _python3_kernel_for_this_interpreter

    _python3_kernel_for_this_interpreter(tmp_path / "jupyter", monkeypatch)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = {i: c for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    lora = next(i for i, c in code.items() if "peft.from_quantized" in c.source)
    before = [i for i in code if i < lora and "trainer.fit" not in code[i].source
              and "plot_training" not in code[i].source]
    order = before + [lora, lora] + [i for i in code if i > lora]
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300, startup_timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for i in order:
            cell = code[i]
            client.execute_cell(cell, i)  # raises CellExecutionError with the cell's traceback
            errors = [o for o in cell.outputs if o["output_type"] == "error"]
            assert not errors, (i, errors)
    out = "".join(o.get("text", "") for o in code[lora].outputs)
    assert "LoRA on the int4 base" in out, out

