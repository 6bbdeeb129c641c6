"""The twins' kernels: HQQ quantization and the twin linear (`quantize.py`), the kernel table with each kernel's
pack / matmul / unpack (`registry.py`, ONNX Runtime's MatMulNBits in `matmulnbits.py`; codes read back from a packed
layout in `codes_from_layout.py`), which kernel a layer runs on (`backends.py`), chosen by timing on this machine
(`choice.py`; the machine's identity in `machine.py`), linears that share one input (`shared_inputs.py`) and the
backbone's own dtype chosen the same way (`backbone_dtype.py`). Nothing here knows of rivers.

`river_hf.kernels` was one module before the subpackages; its names still import from here."""

from .registry import KERNELS, SUPPORTED_NBITS, dequantize, runs, shape_problem  # noqa: F401  (the old module's names)
