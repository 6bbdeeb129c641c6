"""Saved rivers: the twins stored beside a checkpoint and read back without HQQ (`twin_files.py`), and
`from_pretrained(..., quantization_config=RiverQuantConfig(...))` through transformers' quantizer registry
(`hf_quantizer.py`)."""
