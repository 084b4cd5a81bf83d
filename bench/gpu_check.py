"""One prepared check for a lent GPU: Triton quant kernels compiled for real, against the torch references.

Sections (each in its own try/except; each prints its result and lands in the JSON):

1. env        torch / triton versions, device, TRITON_INTERPRET (must be unset on a GPU);
2. cpu smoke  the codecs' CPU path (torch references) round-trips a small block within its error bound,
              and the kvtc section (9) on the CPU;
   --- without CUDA the script stops here: "no CUDA device: nothing to check", exit 0 ---
3. copy       device-to-device ``dst.copy_(src)`` bandwidth on the same bytes as each block: the ceiling;
4. match      Triton vs torch reference (reference run on CPU copies) on one SmolLM2-135M-shaped block
              [30, 2, 3, 256, 64] fp16 and an irregular block [7, 2, 3, 250, 64] (tail groups), every
              kernel; on a batch of 64 such blocks (stacked along layers), int8 and int4-g32: codes,
              packed bytes, scales and zeros bit-exact; dequantized values within one ulp of the
              output dtype (|a - b| <= 2^-10 |b| + 2^-24 for fp16: the GPU may contract
              q * scale + zero into an FMA);
5. speed      each kernel timed with CUDA events (3 warmup, median of 20) on the block and the batch;
              GB/s = bytes read + written per second, also as a fraction of the copy ceiling
              (which also reads and writes), and fp16 GB/s = fp16 block bytes per second;
6. codecs     ``get_codec(spec)`` on a CUDA block: payload bit-identical to the CPU encode, decode on
              the GPU within ``error_bound``;
7. gpu tier   the daemon's GPU tier: batched copies, CUDA IPC against a device copy;
8. blend      CacheBlend on CUDA (tiny random Llama, every selector at r = 0.15) against the same blend
              on the CPU: same selection, logits within fp32 tolerance (every tensor on one device);
9. kvtc       the transform codec on a CUDA block (a RoPE-aware calibration of correlated synthetic
              blocks shaped like SmolLM2's, sinks raw): Triton projection + quantization against the
              CPU codes (differ by 1 at most, rarely), decode on the GPU within ``error_bound`` and
              against the CPU decode, and the time of encode and decode of a block (the entropy
              stage, `ans`, runs on the CPU either way) with each Triton kernel's own time; then the
              same with rows over 10 layers (1,920 channels, `Calibration.layer_group`);
10. pytest    ``python -m pytest -q -m cuda`` when any test is marked cuda;
11. page write (bench/gpu_blend_checks.py) on the CPU, before the CUDA sections: the native page
              writer against its reference, every layout, and against memcpy (a GPU host's CPU, often
              one with AMX, is another host kind); on CUDA, the connector's `split` page write against
              the reference and a device copy;
12. blend speed  CacheBlend's full prefill, naive reuse and blend r = 0.15 on CUDA on a SmolLM2-shaped
              model at bench/vllm_rag.py's prompt shapes, beside bench/blend_roofline.py's H100 model.

Rows are laid out as the codecs lay them out: int8 rows are (layer, k/v, head, token) over head_dim;
low-bit keys are (layer, head, channel) over tokens (a transposed copy, made before timing), values
(layer, head, token) over head_dim.

    python bench/gpu_check.py [--json PATH]     # default $OUT/gpu_check.json when $OUT is set
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_quant_checks import (  # noqa: E402  (sections 2-6: the quant kernels and the codecs)
    BLOCK_SHAPE, cuda_time, kv_block, section_codecs, section_copy, section_cpu_smoke, section_match, section_speed)
from bench.gpu_blend_checks import (  # noqa: E402  (sections 11-12: page writes, the blend's speed)
    section_blend_speed, section_page_write_cpu, section_page_write_cuda)

BATCH_BLOCKS = 64
IRREGULAR_SHAPE = (7, 2, 3, 250, 64)  # 250 tokens: key rows end in a tail group


# -- sections ----------------------------------------------------------------------------------------------


def section_env() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(),
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
           "KVSTORE_KERNELS": os.environ.get("KVSTORE_KERNELS")}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = f"not importable: {e}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    print("env: " + ", ".join(f"{k}={v}" for k, v in out.items()))
    if out["TRITON_INTERPRET"] and torch.cuda.is_available():
        print("  WARNING: TRITON_INTERPRET is set: kernels would run in the interpreter, not compiled")
    return out


def section_gpu_tier(copy_gbps: float | None, blocks: int = 32) -> dict:
    """GPU tier: H2D puts and batched D2H reads against plain tensor.copy_ of the same bytes,
    and a device-to-device Get through CUDA IPC from a real daemon against the device copy."""
    import tempfile
    from pathlib import Path

    from engine_adapter.client.kvstore_client import KVStoreClient
    from kvstore.block import BlockHeader
    from kvstore.keys import KEY_BYTES, KVLayout, Namespace, prefix_keys
    from kvstore.spawn import DaemonProcess
    from tiers.gpu import GpuTier

    layout = KVLayout(*[BLOCK_SHAPE[0], BLOCK_SHAPE[2], BLOCK_SHAPE[4]], "float16")
    size = layout.block_bytes(BLOCK_SHAPE[3])
    host = torch.empty(blocks * size, dtype=torch.uint8, pin_memory=True)
    host.copy_(kv_block((blocks * BLOCK_SHAPE[0], *BLOCK_SHAPE[1:]), seed=5).view(torch.uint8).reshape(-1)[: blocks * size])
    device = torch.empty_like(host, device="cuda")
    total = blocks * size
    h2d_plain = total / cuda_time(lambda: device.copy_(host, non_blocking=True)) / 1e9
    d2h_plain = total / cuda_time(lambda: host.copy_(device, non_blocking=True)) / 1e9
    tier = GpuTier(total + 2**20, device="cuda")
    headers = [BlockHeader(key=i.to_bytes(KEY_BYTES, "little"), namespace=b"n" * KEY_BYTES, layout=layout, tokens=BLOCK_SHAPE[3],
                           payload_len=size, checksum=0) for i in range(blocks)]

    def put_all() -> None:
        for i, header in enumerate(headers):
            tier.put(header, host[i * size:(i + 1) * size])

    start = time.perf_counter()
    put_all()
    torch.cuda.synchronize()
    h2d_tier = total / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    tier.read_many_into([(h.key, host[i * size:(i + 1) * size]) for i, h in enumerate(headers)])
    d2h_tier = total / (time.perf_counter() - start) / 1e9
    result = {"h2d_plain_gbps": h2d_plain, "h2d_tier_gbps": h2d_tier, "h2d_ratio": h2d_tier / h2d_plain,
              "d2h_plain_gbps": d2h_plain, "d2h_tier_gbps": d2h_tier, "d2h_ratio": d2h_tier / d2h_plain}
    tier.close()
    # Device-to-device Get through the daemon's exported pool.
    folder = Path(tempfile.mkdtemp(prefix="kvgpu-"))
    ns = Namespace("gpu-check", layout, chunk_tokens=BLOCK_SHAPE[3])
    keys = prefix_keys(ns, list(range(blocks * BLOCK_SHAPE[3])))
    with DaemonProcess.in_folder(folder, gpu_capacity=total * 2, gpu_device="cuda", cpu_capacity="1GiB",
                                 disk_path="") as daemon, KVStoreClient(daemon.address, arena_bytes=total + 2**26) as kv:
        kv.put(ns, [(k, BLOCK_SHAPE[3], host[i * size:(i + 1) * size]) for i, k in enumerate(keys)])
        target = torch.empty(total, dtype=torch.uint8, device="cuda")
        times = []
        for _ in range(5):
            start = time.perf_counter()
            with kv.fetch_gpu(keys) as views:
                for i, view in enumerate(views):
                    target[i * size:(i + 1) * size].copy_(view)
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        ok = bool(torch.equal(target.cpu(), host))
    ipc = total / statistics.median(times) / 1e9
    result.update({"ipc_get_gbps": ipc, "ipc_matches": ok,
                   "ipc_vs_device_copy": ipc / copy_gbps if copy_gbps else None})
    return {"ok": ok, **result}


def section_blend(device: str = "cuda") -> dict:
    """CacheBlend on the device against the same blend on the CPU: a tiny random Llama (fp32),
    three chunks computed alone and placed (keys re-rotated on the device), glue (separator tokens)
    before two of them, every selector at
    r = 0.15; the selections must match and the logits agree to fp32 tolerance."""
    from blend.assemble import BlendLayout, chunk_block, place_block
    from blend.recompute import blend_prefill
    from blend.select import SELECTORS, get_selector
    from engine_adapter.reference.model import LlamaModel, ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, attention_bias=False, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_ids=(0,), model_id="gpu-check-tiny")
    cpu_model = LlamaModel(config).eval()
    dev_model = LlamaModel(config).eval()
    dev_model.load_state_dict(cpu_model.state_dict())
    dev_model.to(device)
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 37, 11, 29)]  # prefix, 3 chunks
    glue = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 0, 2)]  # separator tokens before each
    query = torch.randint(1, 97, (6,), generator=g).tolist()
    layout = BlendLayout.from_lengths(len(parts[0]), [len(c) for c in parts[1:]], len(query), [len(x) for x in glue])
    ids = torch.tensor(parts[0] + [t for gl, c in zip(glue, parts[1:]) for t in gl + c] + query)

    def run(model, name):
        kv = model.new_cache(layout.total)
        for segment, tokens in zip(layout.cached, parts):
            place_block(model, kv, chunk_block(model, tokens), segment)
        return blend_prefill(model, kv, layout, ids, get_selector(name), 0.15)

    result, ok = {}, True
    for name in sorted(SELECTORS):
        ref, got = run(cpu_model, name), run(dev_model, name)
        same = torch.equal(ref.selected.cpu(), got.selected.cpu())
        err = (got.logits.cpu() - ref.logits).abs().max().item()
        passed = same and err <= 1e-3 * max(1.0, ref.logits.abs().max().item()) and got.logits.device.type == device
        ok &= passed
        result[name] = {"ok": passed, "same_selection": same, "max_logit_err": err}
        print(f"  blend {name}: selection {'same' if same else 'DIFFERS'}, max logit err {err:.2e}")
    return {"ok": ok, **result}


def kvtc_calibration(shape: tuple[int, ...] = BLOCK_SHAPE, layer_group: int = 1):
    """A RoPE-aware kvtc calibration of two correlated synthetic contexts (a low-rank part per row,
    an outlier channel, offsets, noise) shaped like SmolLM2's blocks; and a third context to code.
    ``layer_group``: rows over that many layers (1,920 channels at 10, near `MAX_GROUP_CHANNELS`)."""
    from compression.calibration import Allocation, turn_keys
    from compression.calibration_fit import calibrate

    n_layers, _, n_heads, _, head_dim = shape
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    mix = torch.randn(n_layers, 2, 16, n_heads * head_dim, generator=torch.Generator().manual_seed(7))

    def context(tokens: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n_layers, 2, tokens, 16, generator=g) @ mix
        x = x + 0.1 * torch.randn(n_layers, 2, tokens, n_heads * head_dim, generator=g) + 0.3
        x[..., 5] *= 6.0
        block = x.view(n_layers, 2, tokens, n_heads, head_dim).permute(0, 1, 3, 2, 4).contiguous()
        return turn_keys(block, 0, inv_freq, to_rope=True)  # keys as a model stores them, at 0..tokens-1

    scale = max(1, -(-3 * layer_group * n_heads * head_dim // 1200))  # 3C tokens at least (2C needed)
    cal = calibrate([context(700 * scale, 1), context(500 * scale, 2)], Allocation(0.8, 0.55, 0.2, sink_tokens=4),
                    source="gpu_check synthetic", rope_inv_freq=inv_freq, max_position=4096 * scale,
                    layer_group=layer_group)
    return cal, context(shape[3] + 256, 3)[:, :, :, 256:].to(torch.float16).contiguous()  # a block at 256


def section_kvtc(device: str = "cuda", layer_group: int = 1) -> dict:
    from compression import calibration_store
    from compression.transform import TransformCodec

    cal, block_cpu = kvtc_calibration(layer_group=layer_group)
    calibration_store.register(cal)
    block = block_cpu.to(device)
    codec = TransformCodec(cal)
    enc, enc_cpu = codec.encode(block, start=256), TransformCodec(cal, kernels_choice="torch").encode(block_cpu, start=256)
    decoded = codec.decode(enc.payload, enc.params, tuple(block.shape), block.dtype, device)
    decoded_cpu = TransformCodec(cal, kernels_choice="torch").decode(enc.payload, enc.params, tuple(block.shape),
                                                                     block.dtype)
    bound = codec.error_bound(block_cpu, start=256)
    err = float((decoded.float().cpu() - block_cpu.float()).abs().max())
    vs_cpu = float((decoded.float().cpu() - decoded_cpu.float()).abs().max())
    out = {"device": device, "ratio_vs_fp16": block.numel() * 2 / enc.nbytes,
           "payload_bytes": enc.nbytes, "cpu_payload_bytes": enc_cpu.nbytes, "max_err": err, "bound": bound,
           "decode_vs_cpu_max": vs_cpu, "on_device": decoded.device.type == torch.device(device).type}
    out["ok"] = err <= bound and out["on_device"] and vs_cpu <= 2 * bound
    if device == "cuda":
        from kernels import transform as tk

        rows = cal.block_rows(block.float())
        mean, analysis, inv_step = (t.to(device) for t in (cal.mean, cal.analysis, cal.inv_step))
        from kernels import transform_ref

        codes = tk.project_quantize(rows, mean, analysis, inv_step)
        diff = (codes.cpu() - transform_ref.project_quantize(rows.cpu(), cal.mean, cal.analysis, cal.inv_step)).abs()
        out["codes_max_diff"], out["codes_diff_frac"] = int(diff.max()), float((diff > 0).float().mean())
        out["ok"] = out["ok"] and out["codes_max_diff"] <= 1 and out["codes_diff_frac"] < 0.005
        step, synthesis = cal.step.to(device), cal.synthesis.to(device)
        fp16 = block.numel() * 2
        timings = {"project_quantize": cuda_time(lambda: tk.project_quantize(rows, mean, analysis, inv_step)),
                   "dequantize_backproject": cuda_time(lambda: tk.dequantize_backproject(codes, step, synthesis, mean,
                                                                                         torch.float32)),
                   "encode (codec)": cuda_time(lambda: codec.encode(block, start=256)),
                   "decode (codec)": cuda_time(lambda: codec.decode(enc.payload, enc.params, tuple(block.shape),
                                                                    block.dtype, device))}
        out["seconds"] = timings
        out["fp16_gbps"] = {k: fp16 / v / 1e9 for k, v in timings.items()}
    print(f"  kvtc ({layer_group} layer{'s' if layer_group > 1 else ''} a row) on {device}: "
          f"{'ok' if out['ok'] else 'FAIL'} ({out['ratio_vs_fp16']:.2f}x, max err {err:.4g} <= "
          f"bound {bound:.4g}, vs CPU decode {vs_cpu:.4g}"
          + (f", codes differ by <= {out['codes_max_diff']} in {100 * out['codes_diff_frac']:.3f}%; fp16 GB/s "
             + ", ".join(f"{k} {v:.2f}" for k, v in out["fp16_gbps"].items()) if device == "cuda" else "") + ")")
    return out


def section_pytest(timeout_s: int = 90) -> dict:
    """Run the cuda-marked tests, if any; pytest exit 5 means none were collected."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    if proc.returncode == 5:
        print("  pytest -m cuda: no cuda-marked tests; skipped")
        return {"ran": False, "ok": True, "detail": "no tests marked cuda", "tail": tail}
    print(f"  pytest -m cuda: exit {proc.returncode}: {tail[-1] if tail else ''}")
    return {"ran": True, "ok": proc.returncode == 0, "returncode": proc.returncode, "tail": tail}


# -- main -----------------------------------------------------------------------------------------------------


def run_section(report: dict, name: str, fn: Callable[[], dict]) -> dict | None:
    print(f"[{name}]")
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        print(f"  {name}: ERROR {result['error']}")
    result["seconds"] = round(time.perf_counter() - start, 2)
    report["sections"][name] = result
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_json = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None
    parser.add_argument("--json", default=default_json, help="where to write the report (default $OUT/gpu_check.json)")
    parser.add_argument("--batch", type=int, default=BATCH_BLOCKS, help=f"blocks in the batch (default {BATCH_BLOCKS})")
    args = parser.parse_args()
    started = time.perf_counter()
    report: dict = {"sections": {}}

    def finish(status: str) -> int:
        report["status"] = status
        report["seconds"] = round(time.perf_counter() - started, 1)
        failed = [n for n, s in report["sections"].items() if not s.get("ok", True)]
        report["failed_sections"] = failed
        print(f"\n{status}; {'failed: ' + ', '.join(failed) if failed else 'no section failed'}; "
              f"{report['seconds']} s")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
            print(f"json: {args.json}")
        return 0

    env = run_section(report, "env", section_env)
    run_section(report, "cpu_smoke", section_cpu_smoke)
    run_section(report, "kvtc_cpu", lambda: section_kvtc("cpu"))
    run_section(report, "kvtc_layers10_cpu", lambda: section_kvtc("cpu", layer_group=10))
    run_section(report, "page_write_cpu", section_page_write_cpu)
    if not torch.cuda.is_available():
        print("\nno CUDA device: nothing to check")
        return finish("no CUDA device: nothing to check")
    if env.get("TRITON_INTERPRET"):
        os.environ.pop("TRITON_INTERPRET")  # before kernels.quant is imported: its kernels then compile

    quant_holder: dict = {}

    def import_kernels() -> dict:
        from kernels import quant

        quant_holder["quant"] = quant
        return {"ok": True, "module": quant.__name__}

    if not run_section(report, "import_triton_kernels", import_kernels).get("ok"):
        return finish("Triton kernels did not import")
    quant = quant_holder["quant"]

    single_cpu = kv_block(BLOCK_SHAPE, seed=0)
    batch_shape = (BLOCK_SHAPE[0] * args.batch, *BLOCK_SHAPE[1:])  # blocks stacked along layers
    batch_cpu = kv_block(batch_shape, seed=1)
    irregular_cpu = kv_block(IRREGULAR_SHAPE, seed=2)
    gpu = {name: b.cuda() for name, b in (("block", single_cpu), (f"batch{args.batch}", batch_cpu),
                                           ("irregular", irregular_cpu))}
    cpu = {"block": single_cpu, f"batch{args.batch}": batch_cpu, "irregular": irregular_cpu}
    timed = {name: gpu[name] for name in ("block", f"batch{args.batch}")}

    copy = run_section(report, "copy", lambda: {"ok": True, **section_copy(timed)})
    run_section(report, "match", lambda: (lambda r: {"ok": all(v["ok"] for v in r.values()), **r})(
        section_match(quant, {n: (gpu[n], cpu[n]) for n in gpu})))
    if copy.get("ok"):
        run_section(report, "speed", lambda: {"ok": True, **section_speed(quant, timed, copy)})
    run_section(report, "codecs", lambda: (lambda r: {"ok": all(v["ok"] for v in r.values()), **r})(
        section_codecs(gpu["block"], cpu["block"])))
    device_copy = None  # payload GB/s of the largest device-to-device copy (half its read+write traffic)
    measured = [v for v in copy.values() if isinstance(v, dict) and "traffic_gbps" in v] if copy else []
    if measured:
        device_copy = max(measured, key=lambda v: v["bytes"])["traffic_gbps"] / 2
    run_section(report, "gpu_tier", lambda: section_gpu_tier(device_copy))
    run_section(report, "blend", section_blend)
    run_section(report, "blend_speed", section_blend_speed)
    run_section(report, "page_write_cuda", section_page_write_cuda)
    run_section(report, "kvtc", section_kvtc)
    run_section(report, "kvtc_layers10", lambda: section_kvtc("cuda", layer_group=10))
    run_section(report, "pytest_cuda", section_pytest)
    return finish("GPU checks done")


if __name__ == "__main__":
    sys.exit(main())
