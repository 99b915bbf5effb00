"""Reading GGUF model files: the header, the typed model description, and test-model generation."""
