"""examples/train_debug_gpt2.ipynb: stored clean, and it runs top to bottom on the CPU (nbclient, as
``jupyter nbconvert --execute`` and Jupyter itself run it: Jupyter's "python3" kernel)."""

from __future__ import annotations

import ast
import html
import json
import re
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "train_debug_gpt2.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "the notebook has code cells"
    for cell in code:
        assert cell["outputs"] == [] and cell["execution_count"] is None, "".join(cell["source"])[:80]
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    # only public API: a user copies these cells into their own notebooks
    assert not [c for c in code if "tilegraph.cli" in "".join(c["source"])]


def test_the_python3_kernel_is_installed():
    """``pip install -e ".[test]"`` brings ipykernel, whose wheel installs the "python3" kernel spec
    into the environment (share/jupyter/kernels): Jupyter finds it in a fresh venv."""
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")  # raises NoSuchKernel when missing
    assert spec.language == "python" and "ipykernel" in " ".join(spec.argv)


def _python3_kernel_for_this_interpreter(root: Path, monkeypatch) -> None:
    """Jupyter's "python3" kernel, found as a user's is (ipykernel's spec, which runs the Python
    that starts it). Only where the machine has another "python3" ahead of it (a kernel of another
    Python in ~/.local/share/jupyter, say) a spec running ``sys.executable`` goes first on
    JUPYTER_PATH, so the kernel sees the packages of this test run."""
    root.mkdir(parents=True)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(root / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(root / "ipython"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    from jupyter_client.kernelspec import NoSuchKernel
    from jupyter_client.manager import KernelManager

    try:
        argv = KernelManager(kernel_name="python3").format_kernel_cmd()  # "python" becomes sys.executable
    except NoSuchKernel:
        argv = [""]
    if argv[0] and Path(argv[0]).resolve() == Path(sys.executable).resolve():
        return
    spec = root / "share" / "kernels" / "python3"
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(root / "share"))


def _widget_text(nb) -> str:
    """The text of the notebook's widgets as they ended (tqdm.auto's bar is one where ipywidgets
    is installed: its text lives in the widget state nbclient stores, not in the outputs)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    values = [w["state"].get("value") for w in state.values()]
    return "\n".join(html.unescape(v).replace("\u2007", " ") for v in values if isinstance(v, str))


def _text(outputs) -> str:
    parts = []
    for out in outputs:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("display_data", "execute_result"):
            parts.append(out["data"].get("text/plain", ""))
            parts.append(out["data"].get("text/html", ""))
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.distributed
def test_notebook_runs_trains_and_samples(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    _python3_kernel_for_this_interpreter(tmp_path / "jupyter", monkeypatch)
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the kernel's tempfile folder

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300, startup_timeout=120,
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = _text(outputs)

    # (1) a clickable dashboard link
    assert re.search(r'<a href="http://127\.0\.0\.1:\d+/status"', text), text[:2000]
    # (4) training ran all its steps and the loss fell well below the uniform guess (ln 257 = 5.55)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert first > 5.0 and last < first - 1.5, (first, last)
    bar = _widget_text(nb) + "\n" + text  # the bar: a widget (ipywidgets) or text
    assert re.search(r"\b(\d+)/\1 \[", bar), f"the progress bar reached its end: {bar[-1000:]}"
    # (5) the loss curve, drawn inline
    assert any("image/png" in o.get("data", {}) for o in outputs)
    # (6) greedy and top-k samples: the prompt continued by decoded text
    for label in ("greedy", "top-k"):
        line = re.search(rf"^{label}: (.*)$", text, re.M)
        assert line, f"no {label} sample in\n{text[-2000:]}"
        sample = ast.literal_eval(line.group(1))
        assert sample.startswith("def ") and len(sample) > len("def ") + 16, sample
    # (7) LoRA on the int4 checkpoint of the model trains a few thousand values and does not diverge
    trained, before, after = re.search(r"LoRA on the int4 base: ([\d,]+) trained values of [\d,]+; "
                                       r"validation loss ([\d.]+) -> ([\d.]+)", text).groups()
    assert 0 < int(trained.replace(",", "")) < 10_000 and float(after) < float(before) + 0.02, (before, after)
    # running it leaves nothing in its working directory, and its temporary folder is gone
    assert list(cwd.iterdir()) == []
    assert not list(tmp.glob("tilegraph-notebook-*"))
