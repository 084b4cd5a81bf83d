"""Codecs against the disk tier: its O_DIRECT read ceiling, and TTFT warm from disk per ``disk_codec``.

Part of `bench/codec_quality.py` (``--disk-read``, ``--ttft-disk``), which measures quality; this
module measures what a codec costs a load from disk. Numbers and their reading: docs/notes/compression-log.md.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from bench.warm_prefix import o_direct_read_gbps as read_ceiling_gbps
from bench.warm_prefix import put_chunks, wait_in_tier
from compression import calibration_store
from compression.transform import TransformCodec
from engine_adapter.cached import CachedEngine
from engine_adapter.client.kvstore_client import KVStoreClient
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.reference.model import LlamaModel
from kvstore.keys import prefix_keys
from kvstore.spawn import DaemonProcess
from tiers.disk import block_path

#: CPU-tier capacity, in chunks, of `disk_ttft`'s daemons: small, so the context ends up on disk only.
EVICTING_CPU_CHUNKS = 2


def o_direct_read_gbps(folder: Path, nbytes: int, piece: int) -> float:
    """The disk tier's read ceiling: GB/s reading ``nbytes`` with O_DIRECT in ``piece``-byte reads (one block
    each, as ``--disk-o-direct true`` reads), best of 2 (`bench/warm_prefix.py`'s measure)."""
    folder.mkdir(parents=True, exist_ok=True)
    return read_ceiling_gbps(folder, nbytes, piece)


def disk_ttft(model: LlamaModel, tokenizer, question, block: torch.Tensor, specs: list[str],
              codecs: dict, folder: Path, repeats: int, log, chunk_tokens: int = 256) -> dict[str, dict]:
    """TTFT warm from the disk tier, per disk codec: one daemon each, a CPU tier above an O_DIRECT disk.

    Only a tier below the top re-encodes (the top keeps blocks as sent, `kvstore/daemon/process.py`), so the
    daemon has a CPU tier of ``EVICTING_CPU_CHUNKS`` chunks: the context's whole chunks (its tail cut
    off) are Put raw (the engine's float32 blocks), copied down and re-encoded with the
    ``disk_codec``, and evicted from the CPU tier by the later chunks and a few filler chunks, until
    Lookup finds every context chunk on disk only. Promotion on Get is off, so every repeat reads
    the disk. `CachedEngine.generate` then loads them (Get, decode in the engine) and prefills the
    question. Median of ``repeats`` after one untimed run. kvtc calibrations are saved where the
    daemon and the engine resolve them (`calibration_store.save`).

    ``question``: a `codec_eval.Question` (its ``index``, ``context_ids``, ``question_ids``);
    ``block``: its context KV [L, 2, H, T, D] as stored (`codec_eval.context_block`).
    """
    for spec in specs:
        codec = codecs.get(spec)
        if isinstance(codec, TransformCodec):
            calibration_store.save(codec.calibration)
    # only whole chunks, so the warm run loads every context token and prefills just the question
    context = question.context_ids[:len(question.context_ids) // chunk_tokens * chunk_tokens]
    if not context:
        raise ValueError(f"dev item {question.index} has fewer than {chunk_tokens} context tokens: nothing to load")
    full_kv = model.new_cache(len(context))
    full_kv.load(block[:, :, :, :len(context)].to(model.dtype), 0)
    out = {}
    scratch = Path(tempfile.mkdtemp(prefix="kvb-codec-ttft-", dir=folder))
    chunk_bytes = block[:, :, :, :chunk_tokens].numel() * model.dtype.itemsize  # one chunk as the engine Puts it
    for spec in specs:
        run = scratch / f"d{len(out)}"
        # write-back: a block is copied down (re-encoded) only when the CPU tier evicts it, so no
        # write-through copy of the last chunks is still encoding while the loads are timed
        daemon = DaemonProcess.in_folder(run, cpu_capacity=EVICTING_CPU_CHUNKS * (chunk_bytes + 2**16) + 2**20,
                                         disk_path=run / "blocks", disk_capacity="4GiB", disk_fsync="false",
                                         disk_o_direct="true", disk_codec=spec, promote_on_get="false",
                                         write_policy="write-back")
        try:
            with KVStoreClient(daemon.address) as client:
                engine = CachedEngine(model, tokenizer, client)
                keys = prefix_keys(engine.namespace, context)
                # filler chunks under keys no context shares (token ids 1, 2, ...): they push the
                # context's last chunks out of the CPU tier
                fillers = prefix_keys(engine.namespace, list(range(1, (EVICTING_CPU_CHUNKS + 1) * chunk_tokens + 1)))
                store_on_disk_only(client, engine, keys, fillers, full_kv)
                # the context's own block files (headers included), against its float32 payloads
                on_disk = sum(block_path(run / "blocks", k).stat().st_size for k in keys)
                raw_bytes = chunk_bytes * len(keys)
                if spec != "raw" and raw_bytes / on_disk < 1.1:
                    raise RuntimeError(f"disk_codec {spec}: the disk holds {on_disk} bytes for {raw_bytes} raw, i.e. "
                                       "blocks as sent: the daemon did not re-encode them")
                runs = []
                for _ in range(repeats + 1):
                    result = engine.generate(context + question.question_ids, max_new_tokens=1, store=False)
                    if result.reused_tokens != len(context) or set(result.tiers) != {"disk"}:
                        raise RuntimeError(f"{spec}: reused {result.reused_tokens} tokens from {set(result.tiers)}, "
                                           f"expected all {len(context)} from disk")
                    runs.append(result)
                runs = runs[1:]
                out[spec] = {"ttft_s": statistics.median(r.ttft_s for r in runs),
                             "load_s": statistics.median(r.load_s for r in runs),
                             "prefill_s": statistics.median(r.prefill_s for r in runs),
                             "ttft_per_repeat_s": [r.ttft_s for r in runs],
                             "reused_tokens": runs[0].reused_tokens, "disk_bytes": on_disk,
                             "disk_vs_float32": raw_bytes / on_disk}
                log(f"disk TTFT {spec}: {out[spec]}")
        finally:
            daemon.stop()
    return out


def store_on_disk_only(client, engine, keys: list[bytes], fillers: list[bytes], kv: KVCache,
                       timeout_s: float = 600.0) -> None:
    """Put each chunk of ``kv`` under ``keys``, then filler chunks (the first chunk's KV under
    ``fillers``) until the CPU tier has evicted (demoted) every context chunk: wait until Lookup
    finds them all on disk and nowhere higher."""
    put_chunks(client, engine, keys, kv)
    n = engine.namespace.chunk_tokens
    for key in fillers:
        client.put(engine.namespace, [(key, n, kv.export(0, n))])
    wait_in_tier(client, keys, "disk", timeout_s)


def print_disk_ttft(ttft: dict[str, dict], question_index: int, repeats: int) -> None:
    """`disk_ttft`'s result as a markdown table, raw first."""
    print(f"\nTTFT warm from disk (dev item {question_index}, its first {ttft['raw']['reused_tokens']} context "
          f"tokens, float32 blocks Put raw, re-encoded by the daemon's disk_codec when its {EVICTING_CPU_CHUNKS}-chunk "
          f"CPU tier demotes them; read from disk with O_DIRECT, decoded in the engine; median of {repeats}):\n")
    print("| disk_codec | on disk vs float32 | TTFT s | load s | prefill s | TTFT vs raw |")
    print("|---|---|---|---|---|---|")
    for spec, t in ttft.items():
        print(f"| {spec} | {t['disk_vs_float32']:.2f}x | {t['ttft_s']:.3f} | {t['load_s']:.3f} | "
              f"{t['prefill_s']:.3f} | {t['ttft_s'] / ttft['raw']['ttft_s']:.2f}x |")
