"""The quant kernels and the codecs against their torch references, for `bench/gpu_check.py`.

Blocks with KV-like statistics (`kv_block`), laid out in rows as the codecs lay them out
(`int8_rows`, `lowbit_rows`), timed with CUDA events (`cuda_time`), compared bit for bit or
within one ulp (`ulp_close`); and the script's sections on them: cpu smoke (the codecs' CPU path),
copy (the device copy ceiling), match and speed (every Triton quant kernel), codecs (``get_codec``
on a CUDA block).
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from compression import get_codec
from kernels import quant_ref

BLOCK_SHAPE = (30, 2, 3, 256, 64)  # SmolLM2-135M: [layers, 2, kv_heads, tokens, head_dim]
LOWBIT = ((4, 32), (4, 64), (2, 32), (2, 64))  # (bits, group_size)
CODEC_SPECS = ("int8", "int4-g32", "int2-g64", "int4-g32+shuffle+zstd")
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}
WARMUP, ITERS = 3, 20


def kv_block(shape: tuple[int, ...], seed: int, device: str = "cpu") -> torch.Tensor:
    """fp16 block with KV-like statistics: lognormal channel scales, outlier key channels, offsets."""
    g = torch.Generator().manual_seed(seed)
    n_layers, _, n_heads, n_tokens, head_dim = shape
    chan = torch.exp(0.8 * torch.randn(n_layers, 1, n_heads, 1, head_dim, generator=g))
    chan[:, :, :, :, torch.randint(0, head_dim, (3,), generator=g)] *= 8.0
    block = torch.randn(shape, generator=g) * chan + 0.3 * torch.randn(n_layers, 2, n_heads, 1, head_dim, generator=g)
    return block.to(torch.float16).to(device)


def int8_rows(block: torch.Tensor) -> torch.Tensor:
    return block.reshape(-1, block.shape[-1])  # [L*2*H*T, D]


def lowbit_rows(block: torch.Tensor) -> dict[str, torch.Tensor]:
    n_tokens, head_dim = block.shape[3], block.shape[4]
    return {"k": block[:, 0].transpose(-1, -2).reshape(-1, n_tokens).contiguous(),  # [L*H*D, T]
            "v": block[:, 1].reshape(-1, head_dim).contiguous()}  # [L*H*T, D]


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cuda_time(fn: Callable[[], object]) -> float:
    """Median seconds of fn over ITERS runs after WARMUP, by CUDA events."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ulp_close(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(every |got - ref| <= one ulp of the dtype at |ref| (+ 2^-24), max |got - ref|)."""
    got, ref_d = got.double().cpu(), ref.double().cpu()
    diff = (got - ref_d).abs()
    ok = bool((diff <= ULP[ref.dtype] * ref_d.abs() + 2.0**-24).all())
    return ok, float(diff.max())


# -- sections ----------------------------------------------------------------------------------------------


def section_cpu_smoke() -> dict:
    block = kv_block((2, 2, 3, 40, 64), seed=1)
    rows = []
    for spec in ("int8", "int4-g32", "int2-g64+shuffle+zstd"):
        codec = get_codec(spec)
        encoded = codec.encode(block)
        decoded = codec.decode(encoded.payload, encoded.params, tuple(block.shape), block.dtype)
        err = float((decoded.float() - block.float()).abs().max())
        bound = codec.error_bound(block)
        rows.append({"codec": spec, "max_err": err, "bound": bound, "ok": err <= bound})
        print(f"  cpu smoke {spec}: max err {err:.4g} <= bound {bound:.4g}: {'ok' if err <= bound else 'FAIL'}")
    return {"ok": all(r["ok"] for r in rows), "rows": rows}


def section_copy(sizes: dict[str, torch.Tensor]) -> dict:
    out = {}
    for name, block in sizes.items():
        dest = torch.empty_like(block)
        seconds = cuda_time(lambda: dest.copy_(block))
        traffic = 2 * nbytes(block)
        out[name] = {"bytes": nbytes(block), "seconds": seconds, "traffic_gbps": traffic / seconds / 1e9}
        print(f"  copy {name}: {nbytes(block) / 1e6:.1f} MB in {seconds * 1e6:.1f} us = "
              f"{out[name]['traffic_gbps']:.0f} GB/s read+write")
    return out


def check_int8(quant, block_gpu: torch.Tensor, block_cpu: torch.Tensor) -> dict:
    got = quant.quantize_int8(int8_rows(block_gpu))
    ref = quant_ref.quantize_int8(int8_rows(block_cpu))
    codes = torch.equal(got.q.cpu(), ref.q)
    scales = torch.equal(got.scale.cpu(), ref.scale)
    out_ok, out_diff = ulp_close(quant.dequantize_int8(got.q, got.scale, torch.float16),
                                 quant_ref.dequantize_int8(ref.q, ref.scale, torch.float16))
    return {"codes_equal": codes, "scales_equal": scales, "dequant_within_ulp": out_ok,
            "dequant_max_diff": out_diff, "ok": codes and scales and out_ok}


def check_lowbit(quant, block_gpu: torch.Tensor, block_cpu: torch.Tensor, bits: int, group: int) -> dict:
    result = {"ok": True}
    rows_gpu, rows_cpu = lowbit_rows(block_gpu), lowbit_rows(block_cpu)
    for kind in "kv":
        x_gpu, x_cpu = rows_gpu[kind], rows_cpu[kind]
        got = quant.quantize_lowbit(x_gpu, bits, group, torch.float16)
        ref = quant_ref.quantize_lowbit(x_cpu, bits, group, torch.float16)
        packed = torch.equal(got.packed.cpu(), ref.packed)
        meta = torch.equal(got.scale.cpu(), ref.scale) and torch.equal(got.zero.cpu(), ref.zero)
        n_cols = x_cpu.shape[1]
        out_ok, out_diff = ulp_close(
            quant.dequantize_lowbit(got.packed, got.scale, got.zero, bits, group, n_cols, torch.float16),
            quant_ref.dequantize_lowbit(ref.packed, ref.scale, ref.zero, bits, group, n_cols, torch.float16))
        result[kind] = {"packed_equal": packed, "scale_zero_equal": meta, "dequant_within_ulp": out_ok,
                        "dequant_max_diff": out_diff}
        result["ok"] = result["ok"] and packed and meta and out_ok
    return result


def section_match(quant, blocks: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    out = {}
    for name, (block_gpu, block_cpu) in blocks.items():
        ops = ["int8"] + [f"int{b}-g{g}" for b, g in LOWBIT]
        if name.startswith("batch"):  # same kernels on a bigger grid; the CPU reference is the slow side
            ops = ["int8", "int4-g32"]
        for op in ops:
            key = f"{name}/{op}"
            try:
                if op == "int8":
                    out[key] = check_int8(quant, block_gpu, block_cpu)
                else:
                    bits, group = (int(p) for p in op[3:].split("-g"))
                    out[key] = check_lowbit(quant, block_gpu, block_cpu, bits, group)
            except Exception as e:  # one op failing must not hide the others
                out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            detail = out[key].get("error") or ", ".join(
                f"{k}={v}" for k, v in out[key].items() if k != "ok" and not isinstance(v, dict))
            if not detail:
                detail = "; ".join(f"{kind}: " + ", ".join(f"{k}={v}" for k, v in out[key][kind].items())
                                   for kind in "kv" if kind in out[key])
            print(f"  match {key}: {'ok' if out[key]['ok'] else 'FAIL'} ({detail})")
    return out


def section_speed(quant, blocks: dict[str, torch.Tensor], copy: dict) -> dict:
    out = {}
    for name, block in blocks.items():
        ceiling = copy[name]["traffic_gbps"]
        fp16 = nbytes(block)
        timings: dict[str, tuple[float, int]] = {}  # op -> (seconds, bytes read + written)
        rows = int8_rows(block)
        q8 = quant.quantize_int8(rows)
        timings["int8 quantize"] = (cuda_time(lambda: quant.quantize_int8(rows)), nbytes(rows, *q8))
        timings["int8 dequantize"] = (cuda_time(lambda: quant.dequantize_int8(q8.q, q8.scale, torch.float16)),
                                      nbytes(rows, *q8))
        lrows = lowbit_rows(block)
        for bits, group in LOWBIT:
            parts = {kind: quant.quantize_lowbit(x, bits, group, torch.float16) for kind, x in lrows.items()}
            io = nbytes(*lrows.values()) + sum(nbytes(*p) for p in parts.values())

            def enc(bits=bits, group=group):
                for x in lrows.values():
                    quant.quantize_lowbit(x, bits, group, torch.float16)

            def dec(bits=bits, group=group, parts=parts):
                for kind, p in parts.items():
                    quant.dequantize_lowbit(p.packed, p.scale, p.zero, bits, group, lrows[kind].shape[1],
                                            torch.float16)

            timings[f"int{bits}-g{group} quantize (k+v)"] = (cuda_time(enc), io)
            timings[f"int{bits}-g{group} dequantize (k+v)"] = (cuda_time(dec), io)
        out[name] = {}
        for op, (seconds, io) in timings.items():
            gbps = io / seconds / 1e9
            out[name][op] = {"seconds": seconds, "io_bytes": io, "gbps": gbps, "of_copy": gbps / ceiling,
                             "fp16_gbps": fp16 / seconds / 1e9}
        print(f"  speed {name} ({fp16 / 1e6:.1f} MB fp16; copy ceiling {ceiling:.0f} GB/s read+write):")
        print(f"    {'op':<28} {'us':>9} {'GB/s r+w':>9} {'of copy':>8} {'fp16 GB/s':>10}")
        for op, r in out[name].items():
            print(f"    {op:<28} {r['seconds'] * 1e6:>9.1f} {r['gbps']:>9.1f} {r['of_copy']:>7.1%} {r['fp16_gbps']:>10.1f}")
    return out


def section_codecs(block_gpu: torch.Tensor, block_cpu: torch.Tensor) -> dict:
    out = {}
    for spec in CODEC_SPECS:
        try:
            codec = get_codec(spec)
            enc_gpu, enc_cpu = codec.encode(block_gpu), codec.encode(block_cpu)
            same = enc_gpu.payload == enc_cpu.payload and enc_gpu.params == enc_cpu.params
            decoded = codec.decode(enc_gpu.payload, enc_gpu.params, tuple(block_gpu.shape), block_gpu.dtype, "cuda")
            err = float((decoded.float() - block_gpu.float()).abs().max())
            bound = codec.error_bound(block_cpu)
            out[spec] = {"payload_equal_cpu": same, "max_err": err, "bound": bound, "on_cuda": decoded.is_cuda,
                         "ok": same and err <= bound and decoded.is_cuda}
        except Exception as e:
            out[spec] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        r = out[spec]
        print(f"  codec {spec}: {'ok' if r['ok'] else 'FAIL'} ("
              + (r.get("error") or f"payload == CPU encode: {r['payload_equal_cpu']}, decoded on cuda: "
                 f"{r['on_cuda']}, max err {r['max_err']:.4g} <= bound {r['bound']:.4g}") + ")")
    return out
