#!/usr/bin/env python
"""Measure this machine's matmul throughput (bf16, fp32) and memory bandwidth, then print the
decode roofline of the default model (SmolLM2-135M) in output tokens/s.

    .venv/bin/python scripts/roofline.py [--threads 2] [--context-len 150] [--json out.json]
        [--tpot none=19.5 gguf=9.7 ...]   # measured c=1 TPOT (ms) per --quantization scheme: share of the roofline

Decode of one token costs ~2 FLOP per weight (the tied embedding counts once, as the LM head)
and must read every weight once per step plus each sequence's KV cache. A batch of B
sequences is bound by ``min(B * bandwidth / bytes_per_step(B), matmul_flops / flops_per_token)``.
Run it on an idle machine: anything else running lowers every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

# SmolLM2-135M (the default model): hidden 576, MLP 1536, 30 layers, 9 query / 3 KV heads of 64, vocab 49152
DEFAULT_MODEL = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def model_shape_from_default() -> dict[str, int]:
    """Read the default model's shape from its GGUF when pagedserve can; else the known SmolLM2 numbers."""
    try:
        from pagedserve.models.default_model import default_model_path
        from pagedserve.models.gguf_loader import gguf_to_hf_config, open_gguf

        config = gguf_to_hf_config(open_gguf(default_model_path()))
        heads = config.num_attention_heads
        return dict(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
        )
    except Exception:  # noqa: BLE001 - the script must run without the package or the model
        return dict(DEFAULT_MODEL)


def count_params(shape: dict[str, int]) -> tuple[int, int]:
    """(matmul weights used per token incl. the LM head, KV elements per token of context)."""
    h, i, hd = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    weights = shape["layers"] * per_layer + shape["vocab"] * h + h
    kv_per_token = 2 * shape["layers"] * kv
    return weights, kv_per_token


BATCHES = (1, 16, 64, 256)

# bytes per weight of each --quantization scheme on the default model: (decoder layers, lm_head / embedding)
# none: bf16; int8: int8 + a float16 scale per row; int4: 4 bits + float16 scale and zero per 32 (lm_head int8
# per row); gguf: the file's Q4_1 (4 bits + float16 d and m per 32) and Q8_0 (8 bits + float16 d per 32)
SCHEME_BYTES_PER_WEIGHT = {"none": (2.0, 2.0), "int8": (1.0, 1.0), "int4": (0.625, 1.0), "gguf": (0.625, 34 / 32)}


def weight_bytes_per_token(shape: dict[str, int], scheme: str) -> float:
    """Bytes of weights one decode step reads under ``scheme`` (row scales of int8 are negligible)."""
    weights, _ = count_params(shape)
    lm_head = shape["vocab"] * shape["hidden"]
    body, head = SCHEME_BYTES_PER_WEIGHT[scheme]
    return (weights - lm_head) * body + lm_head * head


def _time(fn, min_time: float = 1.0) -> float:
    fn()
    fn()
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time and runs >= 3:
            return elapsed / runs


def matmul_gflops(dtype: torch.dtype, shape: dict[str, int]) -> dict[str, float]:
    """GFLOP/s of F.linear on the model's own projections at decode batch 64 and 256, and a big square."""
    h, i = shape["hidden"], shape["intermediate"]
    results = {}
    cases = {
        "mlp_up_b64": (64, h, 2 * i),
        "mlp_up_b256": (256, h, 2 * i),
        "mlp_down_b256": (256, i, h),
        "square_2048": (2048, 2048, 2048),
    }
    for name, (m, k, n) in cases.items():
        x = torch.randn(m, k).to(dtype)
        w = torch.randn(n, k).to(dtype)
        seconds = _time(lambda x=x, w=w: F.linear(x, w), 0.5)
        results[name] = 2.0 * m * k * n / seconds / 1e9
    return results


def memory_bandwidth_gbs(threads: int, read_mib: int = 2048, copy_mib: int = 512) -> dict[str, float]:
    """Read and copy bandwidth over buffers far larger than the caches, in GB/s.

    read: a plain streaming read, one thread per core each OR-reducing its slice of a uint64 array
    (NumPy releases the GIL): the bound the decode kernels' weight and KV reads can reach. PyTorch's
    float32 sum, used before, is limited by its own arithmetic and reads at about half that speed.
    copy: ``dst.copy_(src)`` (bytes read + bytes written).
    """
    array = np.ones(read_mib * 1024 * 1024 // 8, dtype=np.uint64)
    slices = np.array_split(array, threads)

    def read_all() -> None:
        workers = [threading.Thread(target=np.bitwise_or.reduce, args=(part,)) for part in slices]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    read_s = _time(read_all, 1.0)
    src = torch.ones(copy_mib * 1024 * 1024 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), 1.0)
    return {"read": array.nbytes / read_s / 1e9, "copy": 2 * src.numel() * 4 / copy_s / 1e9}


def roofline(
    weights: int, kv_per_token: int, gflops: float, bandwidth_gbs: float, dtype_bytes: int, batch: int, context_len: int
) -> float:
    """Output tokens/s bound for ``batch`` sequences decoding at ``context_len`` tokens of context."""
    flops_per_token = 2.0 * weights + 4.0 * context_len * kv_per_token / 2  # weights + attention (QK^T and PV)
    compute_bound = gflops * 1e9 / flops_per_token
    bytes_per_step = weights * dtype_bytes + batch * context_len * kv_per_token * dtype_bytes
    memory_bound = batch * bandwidth_gbs * 1e9 / bytes_per_step
    return min(compute_bound, memory_bound)


def _auto_dtype_name() -> str | None:
    """The dtype ``--dtype auto`` serves in on this CPU (bfloat16 only where it is native), if pagedserve is there."""
    try:
        from pagedserve.models.loader import resolve_dtype
    except ImportError:
        return None
    return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--context-len", type=int, default=150, help="mean context per sequence while decoding")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--tpot",
        nargs="*",
        default=[],
        metavar="SCHEME=MS",
        help="measured concurrency-1 TPOT per --quantization scheme, e.g. none=19.5 gguf=9.7: printed as a share "
        "of the memory-bandwidth roofline",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = model_shape_from_default()
    weights, kv_per_token = count_params(shape)
    print(
        f"torch {torch.__version__}, {args.threads} threads; model: {weights / 1e6:.1f}M matmul weights "
        f"({2 * weights / 1e6:.0f}M FLOP/token), {kv_per_token} KV elements per token of context"
    )
    gemm = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        gemm[name] = matmul_gflops(dtype, shape)
        print(f"{name:9s} matmul GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in gemm[name].items()))
    bandwidth = memory_bandwidth_gbs(args.threads)
    print(f"memory bandwidth: read {bandwidth['read']:.1f} GB/s, copy {bandwidth['copy']:.1f} GB/s")
    best_bw = max(bandwidth.values())
    rows: dict[str, dict[int, float]] = {}
    print(f"\ndecode roofline (output tokens/s) at {args.context_len} tokens of context per sequence")
    print("('peak': the best GEMM measured; 'model': the best at the model's own decode shapes)")
    print(f"{'dtype':15s} {'GFLOP/s':>8s} " + " ".join(f"{'batch ' + str(b):>9s}" for b in BATCHES))
    for name, dtype_bytes in (("bfloat16", 2), ("float32", 4)):
        for kind, gflops in (
            ("peak", max(gemm[name].values())),
            ("model", max(v for k, v in gemm[name].items() if not k.startswith("square"))),
        ):
            key = f"{name} {kind}"
            rows[key] = {
                b: roofline(weights, kv_per_token, gflops, best_bw, dtype_bytes, b, args.context_len) for b in BATCHES
            }
            print(f"{key:15s} {gflops:8.0f} " + " ".join(f"{v:9.0f}" for v in rows[key].values()))
    saturated = {name: 1e9 * max(gemm[name].values()) / (2.0 * weights) for name in gemm}
    served = _auto_dtype_name()
    for name, value in saturated.items():
        mark = "  <- pagedserve's --dtype auto here" if name == served else ""
        print(
            f"saturated {name} decode (peak GEMM / FLOP per token, attention ignored): {value:.0f} tokens/s; "
            f"60% of it: {0.6 * value:.0f} tokens/s{mark}"
        )
    measured = dict(item.split("=", 1) for item in args.tpot)
    print(
        f"\nconcurrency-1 decode per --quantization scheme (weights + KV of {args.context_len} tokens, at {best_bw:.1f} GB/s)"
    )
    schemes = {}
    for scheme in SCHEME_BYTES_PER_WEIGHT:
        step_bytes = weight_bytes_per_token(shape, scheme) + args.context_len * kv_per_token * 2
        floor_ms = 1e3 * step_bytes / (best_bw * 1e9)
        schemes[scheme] = {"bytes_per_token": step_bytes, "roofline_tpot_ms": floor_ms}
        line = f"{scheme:5s} {step_bytes / 1e6:7.1f} MB per token, roofline TPOT {floor_ms:5.2f} ms"
        if scheme in measured:
            tpot = float(measured[scheme])
            schemes[scheme]["measured_tpot_ms"] = tpot
            line += f"; measured {tpot:.1f} ms = {floor_ms / tpot:.0%} of the roofline"
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(
                {
                    "threads": args.threads,
                    "model_shape": shape,
                    "weights": weights,
                    "gemm_gflops": gemm,
                    "bandwidth_gbs": bandwidth,
                    "roofline_tokens_per_s": rows,
                    "saturated_bf16_tokens_per_s": saturated["bfloat16"],
                    "saturated_fp32_tokens_per_s": saturated["float32"],
                    "auto_dtype": served,
                    "quantization_c1": schemes,
                },
                file,
                indent=2,
            )


if __name__ == "__main__":
    main()
