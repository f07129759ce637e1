"""Checkpoints, quantizers, Hugging Face import/export, datasets."""
