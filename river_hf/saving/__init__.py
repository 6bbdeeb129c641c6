"""Saved rivers: the twins stored beside a checkpoint and read back without HQQ, and
`from_pretrained(..., quantization_config=RiverQuantConfig(...))` through transformers' quantizer registry.

- `twin_files.py`: the twins file (portable HQQ codes and what they were made from) and saving it;
- `twin_loading.py`: reading it back and giving each layer the twin that fits;
- `packed_cache.py`: each machine's packed layout of a file's twins, kept so the next load packs nothing;
- `integrity.py`: checksums, digests and sampled fingerprints;
- `hf_quantizer.py`: the "river" quantization method.
"""
