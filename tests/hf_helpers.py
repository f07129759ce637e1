"""Tiny Hugging Face models with random weights, saved once per test module (test-only helpers).

Norm gains and biases are randomized too, so that a wrong name map cannot hide behind HF's
ones/zeros initialisation.
"""

from __future__ import annotations

from typing import Callable


def randomize(model, scale: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("ln" in name or "norm" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def hf_model_cache(tmp_path_factory, make_config: Callable, scale: float,
                   save_kwargs: Callable[[str], dict] = lambda arch: {}):
    """``get(arch) -> (HF model in eval mode, folder it was saved to)``, each built once.
    ``arch`` names starting with "gpt2" are GPT2LMHeadModel, the others LlamaForCausalLM."""
    import torch
    import transformers

    cache = {}

    def get(arch):
        if arch not in cache:
            torch.manual_seed(0)
            cls = transformers.GPT2LMHeadModel if arch.startswith("gpt2") else transformers.LlamaForCausalLM
            model = cls(make_config(arch))
            randomize(model, scale)
            model.eval()
            folder = tmp_path_factory.mktemp(arch)
            model.save_pretrained(folder, **save_kwargs(arch))
            cache[arch] = model, folder
        return cache[arch]

    return get
