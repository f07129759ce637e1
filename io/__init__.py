"""Checkpoints, quantizers, Hugging Face import/export, datasets."""

from .data import TokenDataset, build_token_file, find_sources, read_text, read_token_meta
from .tokenizers import BPETokenizer, ByteTokenizer, Tokenizer, token_dtype, tokenizer_from_description
from .safetensors import load_file, open_checkpoint, save_file
from .hf import load_hf, save_hf, to_hf_state
from .quantize import (KashinNotConverged, QuantizedArray, default_method, dequantize, kashin_decompose,
                       kashin_reconstruct, quantize)
from .zarr import Checkpoint, CheckpointError, CheckpointManager, is_checkpoint, load_checkpoint, save_checkpoint
