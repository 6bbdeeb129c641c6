"""river_hf: seamless token-level early exit (River-LLM) for HuggingFace decoder-only LLMs."""
