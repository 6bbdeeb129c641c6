"""Loading a model and its tokenizer (`models.py`: the packaged SmolLM2, a hub id, a local folder or a .gguf file;
prompts and chat messages to inputs), with a GGUF converted once and cached (`gguf.py`)."""
