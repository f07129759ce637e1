"""examples/train_debug_gpt2.ipynb: stored clean, and it runs top to bottom on the CPU (nbclient)."""

from __future__ import annotations

import ast
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


def _python3_kernel_for_this_interpreter(root: Path, monkeypatch) -> None:
    """A "python3" kernelspec that runs ``sys.executable``, found first on JUPYTER_PATH: the kernel
    then sees the packages of this test run, whatever kernels the machine has (or lacks)."""
    spec = root / "share" / "kernels" / "python3"
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(root / "share"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(root / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(root / "ipython"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")


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
    assert re.search(r"\b(\d+)/\1 \[", text), "the progress bar reached its end"
    # (5) the loss curve, drawn inline
    assert any("image/png" in o.get("data", {}) for o in outputs)
    # (6) greedy and top-k samples: the prompt continued by decoded text
    for label in ("greedy", "top-k"):
        line = re.search(rf"^{label}: (.*)$", text, re.M)
        assert line, f"no {label} sample in\n{text[-2000:]}"
        sample = ast.literal_eval(line.group(1))
        assert sample.startswith("def ") and len(sample) > len("def ") + 16, sample
    # running it leaves nothing in its working directory, and its temporary folder is gone
    assert list(cwd.iterdir()) == []
    assert not list(tmp.glob("tilegraph-notebook-*"))
