"""Could inductor write the twins' GEMVs inside a captured step, instead of calling the int8/int4 kernels?

A captured decode step calls `aten._weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` as opaque kernels. Written
instead as a dequantizing reduction, `(x[:, None, :].float() * W_q.float()).sum(-1) * scale` (8-bit, per row) or the
same over two nibbles a byte with a scale and zero per group of 64 (4-bit), inductor generates the GEMV itself and can
fuse it with its neighbours. This times both forms in one compiled graph of SmolLM2's twin layers (22 layers: the
q/k/v stack 576->960, o 576->576, the gate/up stack 576->3072, down 1536->576; the inputs chained as in a layer),
ms per graph call, median of 5 rounds, against the same layers in bf16:

    python benchmarks/scripts/inductor_gemv.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-avx2 \
        python benchmarks/scripts/inductor_gemv.py                  # the same under AVX2 dispatch
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._dynamo

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N) of one layer's four GEMVs
HIDDEN, INTERMEDIATE, GROUP = 576, 1536, 64


def layer_weights(k: int, n: int) -> dict:
    codes4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale4, zero4 = torch.rand(n, k // GROUP) * 0.01, torch.rand(n, k // GROUP) * 8
    grouped = codes4.view(n, k // GROUP, 2, GROUP // 2)  # a byte holds column j (low) and j + 32 (high) of a group
    return {"int8": torch.randint(-128, 128, (n, k), dtype=torch.int8),
            "scale": torch.rand(n, dtype=torch.bfloat16) * 0.01, "shift": torch.rand(n, dtype=torch.bfloat16) * 0.01,
            "bf16": ((codes4.float().view(n, -1, GROUP) - zero4[..., None]) * scale4[..., None]).view(n, k).bfloat16(),
            "int4pack": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4, 8),
            "scales_and_zeros": torch.stack([scale4, scale4 * (8 - zero4)], -1).transpose(0, 1).contiguous().bfloat16(),
            "nibbles": (grouped[:, :, 0] | grouped[:, :, 1] << 4).to(torch.uint8).reshape(n, k // 2),
            "scale4": scale4.bfloat16(), "scaled_zero4": (scale4 * zero4).bfloat16()}


def bf16(x, w):
    return torch.nn.functional.linear(x, w["bf16"])


def int8pack(x, w):
    y = torch.ops.aten._weight_int8pack_mm(x, w["int8"], w["scale"])
    return torch.addcmul(y, x.sum(-1, keepdim=True), w["shift"])


def int8_reduction(x, w):
    y = (x.float()[:, None, :] * w["int8"].float()).sum(-1)
    return (y * w["scale"].float() + x.float().sum(-1, keepdim=True) * w["shift"].float()).to(x.dtype)


def int4pack(x, w):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w["int4pack"], GROUP, w["scales_and_zeros"])


def int4_reduction(x, w):
    nibbles = w["nibbles"]
    n, groups = nibbles.shape[0], nibbles.shape[1] * 2 // GROUP
    packed = nibbles.view(n, groups, GROUP // 2)
    codes = torch.stack([packed & 15, packed >> 4], 2).float()  # [N, groups, 2, GROUP / 2]
    xg = x.float().view(groups, 2, GROUP // 2)
    partial = (xg[None] * codes).sum((2, 3))  # [N, groups]
    y = (partial * w["scale4"].float() - w["scaled_zero4"].float() * xg.sum((1, 2))[None]).sum(-1)
    return y.to(x.dtype)[None]


FORMS = {"bf16": bf16, "int8pack": int8pack, "int8 reduction": int8_reduction, "int4pack": int4pack,
         "int4 reduction": int4_reduction}


def step(form, weights):
    def run(h):
        for layer in weights:
            qkv, o = form(h, layer[0]), form(h, layer[1])
            gate_up = form(h, layer[2])
            down = form(gate_up[:, :INTERMEDIATE] * torch.sigmoid(gate_up[:, INTERMEDIATE:]), layer[3])
            h = h + (qkv[:, :HIDDEN] + o + down) * 0.01
        return h
    return run


def median_ms(fn, x, calls: int, rounds: int = 5) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - started) / calls * 1e3)
    return sorted(times)[rounds // 2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, 2 threads; "
          f"{args.layers} layers x 4 GEMVs, ms per compiled call (median of 5 rounds of {args.calls})")
    weights = [[layer_weights(k, n) for k, n in SHAPES] for _ in range(args.layers)]
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    probe = weights[0][0]
    # Each quantized form against what it should compute: the int8 kernel eager; the bf16 weight the 4-bit codes make
    references = {"int8": int8pack(x, probe).float(), "int4": x.float() @ probe["bf16"].float().T}
    for name, form in FORMS.items():
        torch._dynamo.reset()
        compiled = torch.compile(step(form, weights), dynamic=False)
        error, reference = "", references.get(name[:4])
        if reference is not None:
            got = torch.compile(form, dynamic=False)(x, probe).float()
            error = f"  (one GEMV's max error, relative: {((got - reference).abs().max() / reference.abs().max()):.4f})"
        print(f"{name:>15}: {median_ms(compiled, x, args.calls):7.2f} ms{error}", flush=True)


if __name__ == "__main__":
    main()
