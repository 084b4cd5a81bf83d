"""The tiny random models and prompts the CacheBlend tests share (tests/test_blend.py,
tests/test_blend_select.py, tests/test_query_probs.py), and the exact references they are held to:
a full prefill, naive reuse over an assembled cache, and KL between two last-position logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blend.assemble import chunk_block, place_block
from blend.select import TokenSelector
from engine_adapter.reference.model import LlamaModel, ModelConfig

TOL = 1e-4


def tiny_model(seed: int = 0, layers: int = 4) -> LlamaModel:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, attention_bias=False, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_ids=(0,), model_id=f"tiny-{seed}")
    model = LlamaModel(config).eval()
    with torch.no_grad():  # larger weights than the default init: attention that is far from uniform
        for layer in model.layers:
            layer.q_proj.weight.mul_(4)
            layer.k_proj.weight.mul_(4)
    return model


def tiny_prompt(seed: int = 1, prefix: int = 5, chunks=(17, 9, 23), query: int = 6):
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(1, 97, (n,), generator=g).tolist()  # noqa: E731
    return draw(prefix), [draw(n) for n in chunks], draw(query)


def full_logits(model, ids) -> tuple[torch.Tensor, object]:
    with torch.inference_mode():
        kv = model.new_cache(len(ids))
        return model(torch.tensor(ids), kv, 0)[-1], kv


def naive_reuse(model, layout, prefix, chunks, query):
    """Naive reuse: the query computed over the assembled cache as it is; (its KV cache, the
    last position's logits)."""
    naive = assembled(model, layout, [prefix] + chunks)
    naive.length = layout.query.start
    with torch.inference_mode():
        logits = model(torch.tensor(query), naive, layout.query.start)[-1]
    return naive, logits


def assembled(model, layout, parts):
    kv = model.new_cache(layout.total)
    for segment, tokens in zip(layout.cached, parts):
        place_block(model, kv, chunk_block(model, tokens), segment)
    return kv


def kl(p_logits, q_logits) -> float:
    return float(F.kl_div(q_logits.log_softmax(-1), p_logits.log_softmax(-1), log_target=True, reduction="sum"))


class FixedSelector(TokenSelector):
    """Recomputes exactly the given positions (to test the recompute path, not a policy)."""

    name = "fixed"

    def __init__(self, positions, check_layer=1):
        self.positions, self.check_layer = torch.tensor(sorted(positions), dtype=torch.long), check_layer

    def select(self, layout, view, budget):
        return self.positions
