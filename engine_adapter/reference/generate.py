"""Plain local generation with the reference engine: prefill, then decode token by token.

The split lets a caller fill the cache its own way (e.g. load stored KV blocks for a prefix and
prefill only the rest) and then reuse `decode_loop`:

    kv = model.new_cache(capacity)
    logits = prefill(model, prompt_ids, kv, start_pos=0)     # [vocab]
    new_ids = decode_loop(model, kv, logits, max_new_tokens, eos_token_ids)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.reference.model import LlamaModel
from engine_adapter.reference.tokenizer import Tokenizer


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> int:
    """One token id from logits [vocab]: argmax when temperature == 0, else nucleus sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [vocab]
    sorted_probs, order = probs.sort(descending=True)
    # Keep the smallest head of the sorted distribution whose mass reaches top_p (at least one token).
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
    return int(order[choice.to(order.device)])


@torch.inference_mode()
def prefill(model: LlamaModel, ids: Sequence[int] | torch.Tensor, kv: KVCache, start_pos: int) -> torch.Tensor:
    """Run `ids` at positions start_pos.. into `kv`; returns the last position's logits [vocab]."""
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=model.device)
    return model(input_ids, kv, start_pos, last_only=True)[-1]


@torch.inference_mode()
def decode_loop(model: LlamaModel, kv: KVCache, first_logits: torch.Tensor, max_new_tokens: int,
                eos_token_ids: Sequence[int], temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> list[int]:
    """Sample up to `max_new_tokens` ids, feeding each back at kv.length; stops after an EOS (kept).

    `first_logits` [vocab] are the logits after the last token already in `kv`.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = set(eos_token_ids)
    logits = first_logits
    new_ids: list[int] = []
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_p, generator)
        new_ids.append(token)
        if token in eos or step == max_new_tokens - 1:
            break
        token_ids = torch.tensor([token], dtype=torch.long, device=model.device)
        logits = model(token_ids, kv, kv.length)[-1]
    return new_ids


def decode_after(model: LlamaModel, kv: KVCache, first: int, max_new_tokens: int, eos_token_ids: Sequence[int],
                 temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None) -> list[int]:
    """All ``max_new_tokens`` ids of an answer whose first id was already sampled (and is not yet
    in `kv`): ``first`` alone after an EOS or when one token was asked for, else ``first`` is fed
    at kv.length and `decode_loop` continues."""
    if first in eos_token_ids or max_new_tokens <= 1:
        return [first]
    logits = model(torch.tensor([first], dtype=torch.long, device=model.device), kv, kv.length)[-1]
    return [first] + decode_loop(model, kv, logits, max_new_tokens - 1, eos_token_ids, temperature, top_p, generator)


def generate(model: LlamaModel, tokenizer: Tokenizer, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None) -> list[int]:
    """New token ids after `prompt_ids` (greedy when temperature == 0), using a private cache."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; encode at least one token (e.g. add_bos=True)")
    kv = model.new_cache(len(prompt_ids) + max(max_new_tokens, 1))
    logits = prefill(model, prompt_ids, kv, start_pos=0)
    return decode_loop(model, kv, logits, max_new_tokens, tokenizer.eos_token_ids, temperature, top_p, generator)
