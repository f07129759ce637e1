"""Model definitions (GPT-2, Llama) written on tilegraph.nn."""
