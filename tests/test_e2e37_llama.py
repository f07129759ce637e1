"""Llama models and tokenizers from the Hugging Face Hub, tried end to end as a user would (audit
37): each test is a defect found that way, and fails without its fix.

Every model is a tiny LlamaForCausalLM with random weights (tests/hf_helpers.py), every tokenizer a
small one built here in the layout of Llama's ``tokenizer.json``: byte-fallback BPE with "▁" for
spaces, special tokens ``<unk>``, ``<s>``, ``</s>``, and a post-processor that puts ``<s>`` first.
"""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import randomize
from tilegraph import cli, models, peft
from tilegraph.io import BPETokenizer, build_token_file
from tilegraph.io.tokenizers import hf_tokenizer_files

tokenizers = pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

UNK, BOS, EOS = 0, 1, 2
TEXTS = ["Hello wörld 😀", " leading space", "two  spaces", "a\nb\tc", "the lazy dog </s> ok", ""]


def _llama_tokenizer_json(truncation=None, padding=None) -> str:
    """A Llama-style tokenizer.json: <unk> <s> </s>, 256 byte tokens, merges learned from a
    little text, byte fallback, "▁" for spaces, "<s>" put first by the post-processor."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                      tokenizers.normalizers.Replace(" ", "▁")])
    text = ["the quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x + 1\n",
            "Hello world, héllo wörld!"] * 10
    tok.train_from_iterator(text, tokenizers.trainers.BpeTrainer(vocab_size=120, min_frequency=1,
                                                                  show_progress=False))
    j = json.loads(tok.to_str())
    vocab = {"<unk>": UNK, "<s>": BOS, "</s>": EOS, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t, _ in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    j["model"].update(vocab=vocab, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    specials = (("<unk>", UNK), ("<s>", BOS), ("</s>", EOS))
    j["added_tokens"] = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for c, i in specials]
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    j["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}}}
    j["truncation"], j["padding"] = truncation, padding
    return json.dumps(j, ensure_ascii=False)


@pytest.fixture(scope="module")
def llama_json() -> str:
    return _llama_tokenizer_json()


def _hf_tokenizer(path):
    # text that spells "</s>" is that text, as tilegraph encodes it (and the tokenizer_config.json
    # that hf_tokenizer_files writes asks for)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), split_special_tokens=True)


# ------------------------------------------------------------------------------ tokenizers ----
def test_a_llama_tokenizer_encodes_as_hugging_face_does_and_ends_documents(llama_json, tmp_path):
    # Before: encode left out the "<s>" that Llama's post-processor (and so HF's tokenizer(text))
    # puts first, and with three special tokens no end-of-text token was found: token files ran
    # documents together without a boundary, and prompts differed from HF's.
    (tmp_path / "tokenizer.json").write_text(llama_json, encoding="utf-8")
    tok = BPETokenizer.load(tmp_path / "tokenizer.json")
    hf = _hf_tokenizer(tmp_path / "tokenizer.json")
    for text in TEXTS:
        ids = tok.encode(text).tolist()
        assert ids == hf(text)["input_ids"], text
        assert ids[0] == BOS
        assert tok.decode(ids) == text == hf.decode(ids, skip_special_tokens=True), text
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [hf(t)["input_ids"] for t in TEXTS]
    assert (tok.bos_id, tok.eos_id, tok.eos) == (BOS, EOS, "</s>")

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in (("a.txt", "the lazy dog"), ("b.txt", "héllo 😀")):
        (corpus / name).write_text(text, encoding="utf-8")
    build_token_file([corpus], tmp_path / "tokens.bin", tok, patterns=["*.txt"])
    got = np.fromfile(tmp_path / "tokens.bin", dtype=tok.dtype).tolist()
    assert got == [*hf("the lazy dog")["input_ids"], EOS, *hf("héllo 😀")["input_ids"], EOS]


def test_the_end_of_text_token_tokenizer_config_json_names_is_taken(llama_json, tmp_path):
    # A tokenizer with two end markers (Llama 3's <|end_of_text|> and <|eot_id|>, say) says which one
    # it ends documents with in tokenizer_config.json, beside tokenizer.json, as transformers reads it.
    j = json.loads(llama_json)
    eot = len(j["model"]["vocab"])
    j["added_tokens"].append({"id": eot, "content": "<eot>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(j), encoding="utf-8")
    assert BPETokenizer.load(tmp_path / "tokenizer.json").eos_id is None  # two of them: neither guessed
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eot>"}}))
    tok = BPETokenizer.load(tmp_path / "tokenizer.json")
    assert (tok.eos_id, tok.eos) == (eot, "<eot>")
    assert BPETokenizer.load(tmp_path / "tokenizer.json", eos=None).eos_id is None  # asked for none: none
    assert BPETokenizer.load(tmp_path / "tokenizer.json", eos="</s>").eos_id == EOS  # asked by name: that one


def test_truncation_and_padding_stored_in_a_tokenizer_json_are_not_applied(tmp_path):
    # Before: a tokenizer.json saved with truncation cut every document of a token file to its
    # max_length (8 tokens here), and one saved with padding padded every prompt with pad ids;
    # transformers' tokenizer(text) applies neither unless asked to.
    truncation = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    padding = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": UNK,
               "pad_type_id": 0, "pad_token": "<unk>"}
    text = "the quick brown fox jumps over the lazy dog, again and again"
    for name, kw in (("truncated", {"truncation": truncation}), ("padded", {"padding": padding})):
        raw = _llama_tokenizer_json(**kw)
        (tmp_path / f"{name}.json").write_text(raw, encoding="utf-8")
        tok = BPETokenizer.load(tmp_path / f"{name}.json")
        hf = _hf_tokenizer(tmp_path / f"{name}.json")
        for t in (text, "a"):
            assert tok.encode(t).tolist() == hf(t)["input_ids"], (name, t)
        assert len(tok.encode(text)) > 8 and len(tok.encode("a")) < 16
        assert [len(a) for a in tok.encode_batch([text, "a"])] == [len(tok.encode(text)), len(tok.encode("a"))]
        # the tokenizer is still named by the file's own JSON (token files record its hash)
        assert tok.to_str() == tokenizers.Tokenizer.from_str(raw).to_str()
        assert tok.describe()["sha256"] == hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def test_hugging_face_files_of_a_llama_tokenizer_name_its_bos_and_give_its_ids(llama_json, tmp_path):
    # Before: tokenizer_config.json named the end-of-text token as bos_token ("</s>" for "<s>").
    tok = BPETokenizer.from_str(llama_json)
    for source in (tok, tok.describe()):
        folder = tmp_path / ("object" if source is tok else "description")
        folder.mkdir()
        for name, data in hf_tokenizer_files(source, tok.to_str()).items():
            (folder / name).write_bytes(data)
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        assert (hf.bos_token, hf.eos_token, hf.bos_token_id, hf.eos_token_id) == ("<s>", "</s>", BOS, EOS)
        for text in TEXTS:
            assert hf(text)["input_ids"] == tok.encode(text).tolist(), text


# ------------------------------------------------------------------------------ generation ----
@pytest.fixture(scope="module")
def hub_llama(tmp_path_factory, llama_json):
    """A Hub-style Llama folder: config.json, safetensors, generation_config.json and its
    tokenizer (tokenizer.json, tokenizer_config.json as transformers' save_pretrained writes them)."""
    folder = tmp_path_factory.mktemp("hub-llama")
    (folder / "source.json").write_text(llama_json, encoding="utf-8")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "source.json"), bos_token="<s>",
                                               eos_token="</s>", unk_token="<unk>")
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                      rope_theta=500.0, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    randomize(hf, 0.5)
    hf.eval()
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "source.json").unlink()
    return hf, tok, folder


def test_tilegraph_generate_on_a_hub_llama_gives_transformers_tokens(hub_llama, capsys):
    # Before: the prompt lacked the "<s>" transformers' tokenizer puts first, so greedy decoding
    # took other tokens than model.generate(**tokenizer(prompt)) from the first one on.
    hf, tok, folder = hub_llama
    prompt = "Hello world"
    enc = tok(prompt, return_tensors="pt")
    want = hf.generate(**enc, max_new_tokens=10, do_sample=False, min_new_tokens=10)[0].tolist()
    assert cli.main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "10", "--local", "--ids"]) == 0
    out = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert [int(i) for i in out[1].split()] == want
    assert out[0] == tok.decode(want, skip_special_tokens=True)


# ----------------------------------------------------------------------- Hugging Face folders ----
def _tiny_llama(folder, **config):
    kw = dict(vocab_size=53, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16, rope_theta=321.0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kw, **config}))
    randomize(hf, 0.3)
    hf.eval()
    hf.save_pretrained(folder)
    return hf


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def test_hidden_act_swish_is_silu_and_loads(tmp_path):
    # Before: refused as a feature tilegraph lacks; transformers' ACT2FN maps "swish" to SiLU too.
    hf = _tiny_llama(tmp_path / "hf", hidden_act="swish")
    ids = np.random.default_rng(0).integers(0, 53, (2, 9))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert _rel(models.from_hf(tmp_path / "hf")(ids).numpy(), want) < 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(tg.TileError, match=r"received: hidden_act='gelu' \(supported: 'silu'\)"):
        models.from_hf(tmp_path / "hf")


def test_a_folder_of_pytorch_bin_weights_is_named_as_such(tmp_path):
    # Before: "expected a .safetensors file or a folder with ...; received: none found", beside the
    # pytorch_model.bin it did not mention (older Hub checkpoints hold only those).
    hf = _tiny_llama(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(tg.TileError, match=r"from_hf\(.*hf\)\] safetensors weights .*PyTorch's \.bin files are "
                                           r"pickles, which tilegraph does not read: transformers writes safetensors "
                                           r"with .*save_pretrained\(new_folder\); received: pytorch_model.bin in "):
        models.from_hf(tmp_path / "hf")


def test_to_hf_of_an_adapted_model_says_the_adapters_are_left_out(tmp_path):
    # Before: a LoRA fine-tuned model written with to_hf was its untrained base, without a word.
    hf = _tiny_llama(tmp_path / "hf")
    model = peft.apply_lora(models.from_hf(tmp_path / "hf"), ["q_proj", "v_proj"], rank=2, alpha=4)
    with pytest.warns(UserWarning, match=r"to_hf\(.*out\)\] the folder holds the base weights, without the model's "
                                         r"4 adapted layers' adapters \(blocks.0.attn.q, blocks.0.attn.v, "
                                         r"blocks.1.attn.q and 1 more\): .*save_adapters.*merge_lora"):
        model.to_hf(tmp_path / "out")
    ids = np.random.default_rng(0).integers(0, 53, (1, 6))
    with torch.no_grad():  # the base, as the warning says
        assert _rel(_hf_logits(tmp_path / "out", ids), hf(torch.tensor(ids)).logits.numpy()) < 1e-6
    peft.merge_lora(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to_hf(tmp_path / "merged")  # nothing left out: no warning


def _hf_logits(folder, ids) -> np.ndarray:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    _tiny_llama(folder)
    return folder


@pytest.mark.parametrize("change, message", [
    # before: "received: rope_type='llama3'", not which of the two objects holding it said so
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"received: rope_type='llama3' \(in config.json's "
                                                                r"rope_scaling\)"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"received: rope_type='dynamic' \(in config.json's rope_parameters\)"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"received: rope_type='linear' \(in config.json's "
                                                          r"rope_scaling\)"),
    ({"attention_bias": True}, r"received: attention_bias=True \(supported: False\)"),
    ({"mlp_bias": True}, r"received: mlp_bias=True \(supported: False\)"),
    ({"head_dim": 16}, r"received: head_dim=16 \(supported: hidden_size / num_attention_heads = 8\)"),
    ({"model_type": "mistral"}, r"unsupported model_type; supported: gpt2, llama; received: 'mistral'"),
    ({"model_type": "qwen2"}, r"unsupported model_type; supported: gpt2, llama; received: 'qwen2'"),
])
def test_llama_configs_tilegraph_cannot_run_are_refused_naming_the_field(llama_folder, tmp_path, change, message):
    config = json.loads((llama_folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "model.safetensors").symlink_to(llama_folder / "model.safetensors")
    with pytest.raises(tg.TileError, match=message):
        models.from_hf(tmp_path)
