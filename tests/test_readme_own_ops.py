"""README "Your own ops": its example runs as written and its op's gradient is torch's."""

import re
from pathlib import Path

import numpy as np
import pytest


def _example() -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("\n## Your own ops\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_gives_torchs_gradient(capsys):
    torch = pytest.importorskip("torch")
    namespace = {"__name__": "readme_own_ops"}
    exec(compile(_example(), "README.md (Your own ops)", "exec"), namespace)
    printed = np.array(capsys.readouterr().out.replace("[", " ").replace("]", " ").split(), float)
    w = torch.tensor(np.linspace(-3, 3, 10), requires_grad=True)
    torch.nn.functional.softplus(w).sum().backward()
    np.testing.assert_allclose(printed, w.grad.numpy(), rtol=1e-7)
    # run again (a notebook cell run twice): its kernels are registered again, no error
    exec(compile(_example(), "README.md (Your own ops)", "exec"), namespace)
