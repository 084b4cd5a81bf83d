"""The transform codec in `bench/codec_quality.py` (``--kvtc``): calibrated on held-out contexts.

Each ``--kvtc`` setting (`parse_kvtc`) becomes a ``kvtc@<id>`` codec (`kvtc_codecs`), calibrated on
``--calibration-items`` (never an evaluated question): with the model, from the statistics of the
items' contexts or passages (`calibration_stats`, cached) and optionally per-row steps from the
measured sensitivity (`cached_sensitivity`, cached by calibration id); or as the daemon's
``kvtc@auto`` does, from the items' 256-token chunks without the model (`blind_calibration`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

from bench.codec_blend import blend_parts
from bench.codec_eval import CHUNK_TOKENS, chunk_bounds
from compression import get_codec
from engine_adapter.calibrate import SENSITIVITY_ALLOCATION, SENSITIVITY_LIMIT
from engine_adapter.reference.model import LlamaModel
from engine_adapter.reference.prompts import document_prompt


def parse_kvtc(text: str) -> dict:
    """One --kvtc setting -> calibration options. ``KEY:VALUE[:DROP]`` (relative steps, post-RoPE keys, as
    before) or ``key=0.2,value=0.2[,drop=0.5][,sinks=4][,rope=1][,sens=1][,limit=4][,metric=0]`` (``rope=1``:
    keys coded before RoPE; ``sens``: strength of the per-layer steps from measured sensitivity, clipped to
    [1/limit, limit]; ``metric=0``: plain PCA of the KV, no query / o_proj metric; ``auto=1``: the calibration a
    daemon makes from a namespace's first blocks, without the model (`compression/blind.py`), from the
    calibration items' 256-token chunks in order, item after item; only key, value and drop apply;
    ``layers=N``: rows over N consecutive layers, `Calibration.layer_group`)."""
    if "=" not in text:
        parts = [float(v) for v in text.split(":")]
        return {"key": parts[0], "value": parts[1], "drop": parts[2] if len(parts) > 2 else 0.5, "sinks": 0, "rope": 0,
                "sens": 0, "limit": SENSITIVITY_LIMIT, "metric": 1, "auto": 0, "layers": 1}
    out = {"key": None, "value": None, "drop": 0.5, "sinks": 0, "rope": 0, "sens": 0, "limit": SENSITIVITY_LIMIT,
           "metric": 1, "auto": 0, "layers": 1}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in out:
            raise SystemExit(f"--kvtc {text!r}: unknown field {name!r}; fields are {sorted(out)}")
        out[name] = float(value)
    if out["key"] is None or out["value"] is None:
        raise SystemExit(f"--kvtc {text!r} needs key= and value= (relative steps)")
    return out


def calibration_stats(model: LlamaModel, tokenizer, args, log, on: str = "contexts"):
    """`engine_adapter.calibrate.collect` over --calibration-items, cached in --cache-dir.

    ``on="contexts"``: each item's whole document prompt, prefilled at 0..n-1 (a stored prefix's KV);
    ``on="passages"``: each of its passages alone at 0..n-1, cut as the blend case cuts them (the
    KV that `BlendEngine` stores per chunk).
    """
    from engine_adapter.calibrate import collect

    items = json.loads(args.data.read_text())
    texts = []
    for i in args.calibration_items:
        if on == "passages":
            texts.extend(blend_parts(tokenizer, args.data, i).chunks)
            continue
        document = "\n\n".join(p["text"] for p in items[i]["ctxs"])
        texts.append(document_prompt(tokenizer, document, items[i]["question"])[0])
    digest = hashlib.sha256(model.config.model_id.encode() + json.dumps(texts).encode()).hexdigest()[:20]
    path = args.cache_dir / f"calstats-{digest}.pt"
    if path.is_file():
        try:
            return texts, torch.load(path, weights_only=False)
        except (ImportError, AttributeError) as exc:  # pickled by a tree where ModelStats lived elsewhere
            log(f"kvtc calibration statistics in {path} are from another version ({exc}); collecting them again")
    start = time.perf_counter()
    stats = collect(model, texts)
    log(f"kvtc calibration statistics: {stats.tokens} tokens from dev items {args.calibration_items} ({on}) "
        f"in {time.perf_counter() - start:.0f} s")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(stats, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return texts, stats


def cached_sensitivity(model: LlamaModel, texts: list[list[int]], stats, calibration, cache_dir: Path, log):
    """`engine_adapter.calibrate.row_sensitivity` of the calibration texts under ``calibration``, cached by its id."""
    from engine_adapter.calibrate import row_sensitivity
    from compression.transform import TransformCodec

    path = cache_dir / f"sensitivity-{calibration.id[:20]}.pt"
    if path.is_file():
        return torch.load(path)
    start = time.perf_counter()
    sensitivity = row_sensitivity(model, texts, stats.blocks, TransformCodec(calibration), chunk_tokens=CHUNK_TOKENS)
    log(f"per-row sensitivity under {calibration.id[:12]} in {time.perf_counter() - start:.0f} s: "
        f"keys {sensitivity[0::2].sum():.4f}, values {sensitivity[1::2].sum():.4f} nats summed over layers")
    torch.save(sensitivity, path)
    return sensitivity


def blind_calibration(blocks: list[torch.Tensor], source: str, log, layer_group: int = 1, allocation=None):
    """What a daemon calibrates from these contexts' 256-token chunks stored in order, without the model
    (at ``allocation``, default steps 0.5 / 0.5: per-layer rows take another one by `with_allocation`)."""
    from compression.blind import BlindCalibration
    from compression.calibration import Allocation

    start = time.perf_counter()
    n_layers, _, n_heads, _, head_dim = blocks[0].shape
    blind = BlindCalibration(n_layers, n_heads, head_dim, layer_group=layer_group)
    for block in blocks:
        for s, e in chunk_bounds(block.shape[3]):
            blind.add(block[:, :, :, s:e])
    calibration = blind.calibration(allocation or Allocation(0.5, 0.5),
                                    source=f"{source}, as {blind.blocks} blocks, no model")
    log(f"blind calibration in {time.perf_counter() - start:.1f} s: {calibration.source}")
    return calibration


def kvtc_codecs(model: LlamaModel, tokenizer, args, evaluated: set[int], log) -> dict:
    """``{spec: codec}`` for each --kvtc setting, calibrated on --calibration-items (never evaluated ones)."""
    from compression import calibration_store
    from compression.calibration import Allocation
    from compression.calibration_fit import calibrate

    overlap = evaluated & set(args.calibration_items)
    if overlap:
        raise SystemExit(f"--calibration-items {sorted(overlap)} are also evaluated; calibrate on other contexts")
    from engine_adapter.calibrate import sensitivity_scale

    # the per-row sensitivities are always measured on whole contexts (row_sensitivity needs texts
    # longer than a chunk plus its probe; passages are shorter), under the chosen basis
    texts, stats = calibration_stats(model, tokenizer, args, log)
    basis_stats = stats if args.calibrate_on == "contexts" else calibration_stats(model, tokenizer, args, log,
                                                                                on=args.calibrate_on)[1]
    source = f"MuSiQue dev items {args.calibration_items}, {basis_stats.tokens} tokens"
    if args.calibrate_on != "contexts":  # (contexts: the source, hence the calibration ids, as before)
        source += f", {args.calibrate_on} alone"
    bases = {}
    out = {}
    for text in args.kvtc:
        setting = parse_kvtc(text)
        sinks, rope, metric = int(setting["sinks"]), bool(setting["rope"]), bool(setting["metric"])
        base = sinks, rope, metric
        layers = int(setting["layers"])
        allocation = Allocation(setting["key"], setting["value"], setting["drop"], sink_tokens=sinks)
        if setting["auto"] and layers > 1:  # the steps are in the grouped bases: the daemon's whole path again
            calibration = blind_calibration(basis_stats.blocks, source, log, layers, allocation)
        elif setting["auto"]:
            if "auto" not in bases:
                bases["auto"] = blind_calibration(basis_stats.blocks, source, log)
            calibration = bases["auto"].with_allocation(
                dataclasses.replace(allocation, sink_tokens=bases["auto"].allocation.sink_tokens))
        else:
            if base not in bases:
                bases[base] = calibrate(basis_stats.blocks, Allocation(0.5, 0.5, sink_tokens=sinks),
                                        metric=basis_stats.metric(1, pre_rope=rope) if metric else None,
                                        source=source, rope_inv_freq=basis_stats.inv_freq if rope else None,
                                        max_position=model.config.max_position_embeddings if rope else 0)
            calibration = bases[base].with_allocation(allocation)
            if setting["sens"]:
                # measured once per basis, at one reference allocation: to first order every row's KL grows
                # as step^2 alike, so the relative sensitivities hold at any step
                reference = bases[base].with_allocation(dataclasses.replace(SENSITIVITY_ALLOCATION, sink_tokens=sinks))
                sensitivity = cached_sensitivity(model, texts, stats, reference, args.cache_dir, log)
                scale = sensitivity_scale(sensitivity, groups=1, strength=setting["sens"], limit=setting["limit"])
                allocation = dataclasses.replace(allocation, row_scale=scale)
                calibration = bases[base].with_allocation(allocation)
            if layers > 1:  # the steps go into the bases: calibrated again from the statistics
                calibration = calibrate(basis_stats.blocks, allocation,
                                        metric=basis_stats.metric(1, pre_rope=rope) if metric else None,
                                        source=source, rope_inv_freq=basis_stats.inv_freq if rope else None,
                                        max_position=model.config.max_position_embeddings if rope else 0,
                                        layer_group=layers)
        calibration_store.register(calibration)
        spec = f"kvtc@{calibration.id[:12]}"
        log(f"{spec}: {text}, {int(calibration.kept.sum())}/{calibration.kept.numel()} components kept")
        out[spec] = get_codec(spec)
    return out
