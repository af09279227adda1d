"""GGUF files (llama.cpp's format) as Octavo checkpoints: the config from
the metadata (config.py), the tensors under their Hugging Face names
(names.py, tensors.py). The tokenizer is read without torch, in
octavo/checkpoint/gguf_vocab.py."""
