"""The README's Python snippets, run as a newcomer pastes them (small sizes: gpt2-debug, a few
steps, no cluster). Each one that broke was found so:

- "Models, Hugging Face weights, generation" used ``transformers`` without importing it
  (NameError), and padded a batch of prompts with a tokenizer that has no pad token (GPT-2's, and
  the ``tokenizer.json`` tilegraph writes beside a checkpoint): transformers' ValueError "Asking to
  pad but the tokenizer does not have a padding token";
- "Checkpoints (Zarr)" restored into ``opt2``, which it never made: made over the saved model's
  parameters (the natural guess), ``restore_optimizer(opt2, ck.model)`` refuses it ("every
  optimizer parameter must belong to the model"), so the snippet makes it over the loaded model's.

The "Training" snippet ran as written; its test keeps it so, and every ```python block at least
compiles. (The "Your own ops" snippet is tests/test_readme_own_ops.py's.) The README also said a
second ``apply_lora`` keeps the adapters its targets meet with a warning, where a target that
meets only adapted layers is refused: its test pins both.
"""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import ByteTokenizer
from tilegraph.io.tokenizers import hf_tokenizer_files

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python(heading: str, index: int = 0) -> str:
    """The ``index``-th ```python block of the README section under ``## heading``."""
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def test_every_readme_python_block_compiles():
    blocks = re.findall(r"^( *)```python\n(.*?)^ *```", README.read_text(), re.S | re.M)
    assert len(blocks) >= 10
    for _, code in blocks:
        compile(textwrap.dedent(code), "README.md", "exec")


def run_snippet(code: str, namespace: dict, name: str) -> dict:
    namespace.setdefault("__name__", "readme_snippet")
    exec(compile(code, f"README.md ({name})", "exec"), namespace)
    return namespace


@pytest.fixture
def byte_gpt2_folder(tmp_path) -> Path:
    """A Hugging Face folder as `tilegraph convert` writes one: the debug GPT-2 over the byte
    tokenizer's 257 ids, with that tokenizer's tokenizer.json (which, as GPT-2's, has no pad
    token)."""
    folder = tmp_path / "hf-folder"
    config = dataclasses.replace(models.GPT2Config.flavor("debug"), vocab_size=257)
    models.build(config, seed=0).to_hf(folder)
    for name, data in hf_tokenizer_files(ByteTokenizer(eos=True)).items():
        (folder / name).write_bytes(data)
    assert "pad_token" not in json.loads((folder / "tokenizer_config.json").read_text())
    return folder


def test_the_models_snippet_runs_as_written_and_pads_as_each_prompt_alone(byte_gpt2_folder, tmp_path):
    pytest.importorskip("transformers")
    code = readme_python("Models, Hugging Face weights, generation")
    assert code.count('"path/to/hf-folder"') == 2 and code.count('"out/"') == 1
    code = code.replace('"path/to/hf-folder"', repr(str(byte_gpt2_folder))).replace('"out/"', repr(str(tmp_path / "out")))
    ns = run_snippet(code, {}, "Models")   # before: NameError: name 'transformers' is not defined

    assert ns["logits"].shape == (1, 4, 257)
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "model.safetensors").exists()
    ids, mask, out, scores = ns["enc"]["input_ids"], ns["enc"]["attention_mask"], ns["out"], ns["scores"]
    P = ids.shape[1]
    assert out.shape == (2, P + 16) and scores.shape == (2, 16)
    np.testing.assert_array_equal(out[:, :P], ids)  # the ids come back as given
    # each row continues its prompt as if generated alone, the padding never read
    model = ns["model"]
    for row in range(2):
        alone = ids[row][mask[row].astype(bool)][None]
        np.testing.assert_array_equal(out[row, P:], models.generate(model, alone, 16)[0, alone.shape[1]:])
    assert np.all(scores <= 0) and np.all(np.isfinite(scores))


def test_the_checkpoint_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-3, 50, 1000))
    saved = {name: p.numpy() for name, p in model.named_parameters()}
    # before: NameError for opt2; made over `model` before the snippet rebinds it, restore_optimizer
    # refused it ("every optimizer parameter must belong to the model")
    ns = run_snippet(readme_python("Checkpoints (Zarr)"), {"tg": tg, "model": model, "opt": opt}, "Checkpoints")

    ck, loaded, small = ns["ck"], ns["model"], ns["small"]
    assert ck.metadata == {"note": "baseline"}
    assert ns["opt2"].schedule(1) == pytest.approx(opt.schedule(1))  # the checkpoint's schedule, restored
    for name, p in loaded.named_parameters():
        np.testing.assert_array_equal(p.numpy(), saved[name])
    small_params = dict(small.named_parameters())
    np.testing.assert_array_equal(small_params["ln_f.weight"].numpy(), saved["ln_f.weight"])  # norms stay exact
    w, q = saved["blocks.0.mlp.fc1.weight"], small_params["blocks.0.mlp.fc1.weight"].numpy()
    assert 0 < np.linalg.norm(q - w) / np.linalg.norm(w) < 0.2  # int4, loaded dequantized


def test_the_training_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "readme.md").write_text(README.read_text())  # ~200 KB of text
    code = readme_python("Training")
    assert code.count("trainer.fit(1000)") == 1
    code = code.replace("trainer.fit(1000)", "trainer.fit(3)")   # 3 of its 1000 steps
    ns = run_snippet(code, {"tg": tg, "models": models, "rt": None}, "Training")

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in steps)
    assert steps[0]["loss"] == pytest.approx(np.log(ns["tok"].vocab_size), rel=0.1)  # a fresh model: about uniform
    assert (tmp_path / "run" / "loss.png").exists()


def test_a_second_apply_lora_keeps_the_adapters_there_and_refuses_a_target_of_adapted_layers_only():
    """README "Adapters (LoRA)", Targets: a second apply_lora adapts the matched layers without an
    adapter, keeps (with a warning) those with one; a target matching only adapted layers is
    refused, naming them (the README said only the first half)."""
    from tilegraph import peft

    model = peft.apply_lora(models.build("gpt2-debug"), ["attn.q"], rank=2)
    with pytest.warns(UserWarning, match=r"keep it as it is.*blocks\.0\.attn\.q \(LoRALinear, rank 2\)"):
        peft.apply_lora(model, ["attn.*"], rank=4)
    ranks = {name: m.rank for name, m in model.named_modules() if isinstance(m, tg.nn.LoRALinear)}
    assert ranks == {f"blocks.{b}.attn.{p}": (2 if p == "q" else 4) for b in (0, 1) for p in "qkvo"}

    model = peft.apply_lora(models.build("gpt2-debug"), ["attn.q"], rank=2)
    with pytest.raises(tg.TileError, match=r"'attn\.q' matches only layers with an adapter already: blocks\.0\.attn\.q"):
        peft.apply_lora(model, ["attn.q", "attn.v"], rank=4)
    assert not any(isinstance(m, tg.nn.LoRALinear) for name, m in model.named_modules() if name.endswith("attn.v"))
