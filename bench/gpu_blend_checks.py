"""bench/gpu_check.py's sections for a load's page writes and the blend's speed.

- ``page_write_cpu`` (any host, before the CUDA sections): the native page writer
  (`kernels/page_copy.c`) against its reference for every layout, with and without its AVX2 paths,
  and a save's read of the block back out of the pages (`PageWriter.read`),
  then each layout's copy against memcpy on SmolLM2's shapes (bench/vllm_ttft.py's copy benchmark,
  forced layouts, no vLLM): a GPU host's CPU is another host kind (often one with AMX).
- ``page_write_cuda``: the connector's CUDA page write (`split_cache_write`, FLASH_ATTN / TRITON
  pages) against the reference, and its time against a device copy of the same bytes.
- ``blend_speed``: CacheBlend's steps on CUDA on a SmolLM2-135M-shaped model (random bf16 weights:
  time does not depend on them) at bench/vllm_rag.py's prompt shapes: full prefill, naive reuse and
  blend r = 0.15, beside bench/blend_roofline.py's model of an H100.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.blend_roofline import DEVICES, PROMPTS, SHAPES, blend_model
from bench.gpu_quant_checks import cuda_time


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: str, runs: int = 20) -> float:
    """Median seconds of fn: CUDA events on a GPU (bench/gpu_quant_checks.py), else the wall clock."""
    if torch.device(device).type == "cuda":
        return cuda_time(fn)
    fn()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def section_page_write_cpu(rounds: int = 5) -> dict:
    from bench.host_isa import isa_summary
    from bench.vllm_ttft import LAYOUTS, copy_benchmark
    from kernels.page_copy import PageWriter
    from kernels.page_copy_ref import write_pages_ref

    result, ok = {"host": isa_summary()}, True
    generator = torch.Generator().manual_seed(0)
    for layout in LAYOUTS:
        for simd in (True, False):
            caches = [torch.randn(9, 3, 32, 128, generator=generator).to(torch.bfloat16) for _ in range(2)]
            expected = [c.clone() for c in caches]
            block = torch.randn(2, 2, 3, 90, 64, generator=generator).to(torch.bfloat16)
            position = torch.arange(90) + 7  # from row 7 of a scattered page table: ragged ends, whole pages
            slots = torch.randperm(9, generator=generator)[position // 32] * 32 + position % 32
            writer = PageWriter(caches, layout, simd=simd)
            writer.write(block, slots)
            write_pages_ref(expected, layout, block, slots)
            same = all(torch.equal(a, b) for a, b in zip(caches, expected))
            ok &= same
            result[f"{layout}{'' if simd else '_sse2'}_matches"] = same
            if simd:  # a save's read back out of the pages (one path on every CPU)
                read = torch.equal(writer.read(slots), block)
                ok &= read
                result[f"{layout}_read_matches"] = read
        copy = copy_benchmark(3840, rounds, layout)
        result[f"{layout}_vs_memcpy"] = copy["copy_vs_memcpy"]
        result[f"{layout}_vs_memcpy_spread"] = copy["copy_vs_memcpy_spread"]
        print(f"  page write {layout}: matches {result[f'{layout}_matches']}, read back {result[f'{layout}_read_matches']}, "
              f"{copy['copy_vs_memcpy']:.2f}x memcpy ({copy['copy_vs_memcpy_spread'][0]:.2f}-"
              f"{copy['copy_vs_memcpy_spread'][1]:.2f})")
    return {"ok": ok, **result}


def section_page_write_cuda(device: str = "cuda", tokens: int = 3840) -> dict:
    from engine_adapter.vllm.layout import split_cache_write
    from kernels.page_copy_ref import write_pages_ref

    layers, heads, head_dim, page = 30, 3, 64, 16  # FLASH_ATTN's 16-token pages
    pages = tokens // page + 16
    caches = [torch.zeros(pages, heads, page, 2 * head_dim, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    block = torch.randn(layers, 2, heads, tokens, head_dim, device=device).to(torch.bfloat16)
    position = torch.arange(tokens, device=device) + 5
    slots = torch.randperm(pages, device=device)[position // page] * page + position % page

    def write() -> None:
        for cache, kv in zip(caches, block):
            split_cache_write(kv[0].transpose(0, 1), kv[1].transpose(0, 1), cache, slots)

    write()
    expected = [torch.zeros_like(c) for c in caches]
    write_pages_ref(expected, "split", block, slots)
    same = all(torch.equal(a, b) for a, b in zip(caches, expected))
    source, target = block.flatten(), torch.empty(block.numel(), dtype=block.dtype, device=device)
    write_s, copy_s = median_seconds(write, device), median_seconds(lambda: target.copy_(source), device)
    ratio = write_s / copy_s
    print(f"  CUDA page write (split, {block.numel() * 2 / 1e6:.1f} MB): matches {same}, {write_s * 1e3:.3f} ms, "
          f"{ratio:.2f}x a device copy ({copy_s * 1e3:.3f} ms)")
    return {"ok": same, "write_ms": write_s * 1e3, "device_copy_ms": copy_s * 1e3, "vs_device_copy": ratio}


def section_blend_speed(device: str = "cuda", ratio: float = 0.15, runs: int = 5) -> dict:
    from blend.assemble import BlendLayout, chunk_block, place_block
    from blend.recompute import blend_prefill
    from blend.select import DEFAULT_SELECTOR, get_selector
    from engine_adapter.reference.model import LlamaModel, ModelConfig

    shape = SHAPES["smollm2-135m"]
    config = ModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, rope_theta=100000.0, rope_scaling=None, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, attention_bias=False, max_position_embeddings=8192,
                         bos_token_id=None, eos_token_ids=(0,), model_id="gpu-check-smollm2-shape")
    torch.manual_seed(0)
    model = LlamaModel(config).to(device=device, dtype=torch.bfloat16).eval()
    result, selector = {"selector": DEFAULT_SELECTOR, "ratio": ratio}, get_selector(DEFAULT_SELECTOR)
    for prompt, (prefix, passages, query) in PROMPTS.items():
        layout = BlendLayout.from_lengths(prefix, passages, query)
        parts = [torch.randint(1, shape.vocab, (n,)).tolist() for n in (prefix, *passages)]
        ids = torch.tensor([t for p in parts for t in p] + torch.randint(1, shape.vocab, (query,)).tolist())
        with torch.inference_mode():
            blocks = [chunk_block(model, tokens) for tokens in parts]

            def assembled():
                kv = model.new_cache(layout.total)
                for segment, block in zip(layout.cached, blocks):
                    place_block(model, kv, block, segment)
                return kv

            def timed(fn) -> float:  # untimed set-up (the cache as loaded), then the step, synchronized
                times = []
                for _ in range(runs + 1):
                    kv = assembled()
                    synchronize(device)
                    began = time.perf_counter()
                    fn(kv)
                    synchronize(device)
                    times.append(time.perf_counter() - began)
                return statistics.median(times[1:])

            full = timed(lambda kv: model(ids.to(device), model.new_cache(layout.total), 0, last_only=True))
            naive = timed(lambda kv: blend_prefill(model, kv, layout, ids, selector, 0.0))
            blend = timed(lambda kv: blend_prefill(model, kv, layout, ids, selector, ratio))
        predicted = blend_model(shape, DEVICES["h100"], prefix, passages, query, ratio)
        entry = {"tokens": layout.total, "full_ms": full * 1e3, "naive_ms": naive * 1e3, "blend_ms": blend * 1e3,
                 "speedup": full / blend, "recompute_cost": (blend - naive) / full / ratio,
                 "model_h100": {"full_ms": predicted["full"]["seconds"] * 1e3,
                                "blend_ms": predicted["blend"]["seconds"] * 1e3, "speedup": predicted["speedup"],
                                "recompute_cost": predicted["recompute_cost"]}}
        result[prompt] = entry
        print(f"  blend {prompt} ({layout.total} tokens): full {entry['full_ms']:.2f} ms, naive "
              f"{entry['naive_ms']:.2f}, blend r={ratio} {entry['blend_ms']:.2f} = {entry['speedup']:.2f}x full, "
              f"recompute cost {entry['recompute_cost']:.2f} (H100 model: {predicted['speedup']:.2f}x, "
              f"{predicted['recompute_cost']:.2f})")
    return {"ok": True, **result}
