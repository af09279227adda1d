"""Checkpoint files read without torch: GGUF metadata and vocabularies,
SentencePiece models, and which tokenizer files a model path holds. The
package-root tokenizer and the model loader both read through here."""
