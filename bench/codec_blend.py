"""The blend case of `bench/codec_quality.py` (``--blend``): chunks stored through a codec, then blended.

Each question's passages are cut as `bench/musique.build_prompt` cuts them (`blend_parts`),
each computed alone and stored as one float16 block (`segment_blocks`, cached on disk), passed
through the codec and blended with CacheBlend (`blend_first_logits`); the bench compares the
first token's logits against the same blend over the fp16-stored blocks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from bench.codec_eval import STORE_DTYPE
from engine_adapter.reference.model import LlamaModel


def blend_parts(tokenizer, data: Path, index: int):
    """The question's 10 passages as `bench/musique.build_prompt` cuts them: prefix, chunks, query."""
    from bench.musique import build_prompt

    item = json.loads(data.read_text())[index]
    return build_prompt(tokenizer, [p["text"] for p in item["ctxs"]], item["question"])


def segment_blocks(model: LlamaModel, parts: list[list[int]], cache_dir: Path) -> list[torch.Tensor]:
    """Each part's KV computed alone at 0..n-1 (`blend.assemble.chunk_block`) as stored: float16, cached on disk."""
    from blend.assemble import chunk_block

    blocks = []
    for tokens in parts:
        digest = hashlib.sha256(b"blend" + model.config.model_id.encode() + torch.tensor(tokens).numpy().tobytes())
        path = cache_dir / f"seg-{digest.hexdigest()[:20]}.pt"
        if path.is_file():
            blocks.append(torch.load(path))
            continue
        block = chunk_block(model, tokens).to(STORE_DTYPE)
        cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save(block, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        blocks.append(block)
    return blocks


@torch.inference_mode()
def blend_first_logits(model: LlamaModel, prompt, blocks: list[torch.Tensor], codec, ratio: float) -> torch.Tensor:
    """First-token logits [vocab] of CacheBlend over ``blocks`` (prefix + chunks) passed through ``codec``.

    Each block is one stored block, as `BlendEngine` stores a chunk; the codec sees it as the
    daemon's tiers would (start position estimated, not told)::

        |<prefix>|<chunk 0>|<chunk 1>| ... |<chunk 9>|<query>|
         '--- stored blocks, encoded + decoded, placed (keys re-rotated) ---' '-- prefilled --'
         blend_prefill: layer 0 + check layer in full, then `ratio` of chunk tokens and the query
    """
    from blend.assemble import BlendLayout, place_block
    from blend.recompute import blend_prefill
    from blend.select import DEFAULT_SELECTOR, get_selector

    layout = BlendLayout.from_lengths(len(prompt.prefix), [len(c) for c in prompt.chunks], len(prompt.query))
    kv = model.new_cache(layout.total + 1)
    for block, segment in zip(blocks, layout.cached):
        if codec is not None:
            encoded = codec.encode(block)
            block = codec.decode(encoded.payload, encoded.params, tuple(block.shape), block.dtype)
        place_block(model, kv, block, segment)
    ids = torch.tensor(prompt.prefix + [t for c in prompt.chunks for t in c] + prompt.query, dtype=torch.long)
    return blend_prefill(model, kv, layout, ids, get_selector(DEFAULT_SELECTOR), ratio).logits
