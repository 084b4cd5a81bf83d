"""Codec quality, one question at a time: the pieces `bench/codec_quality.py` runs per codec.

A MuSiQue dev question (`Question`: its document prompt and question tokens), its context's KV as
stored (`context_block`: float16, cached on disk), that KV loaded chunk by chunk through a codec
(`load_through_codec`), and the scores against the fp16 reference: next-token logits at every
answer position under teacher forcing (`teacher_forced_logits`), their KL (`kl_per_position`),
and the codec's greedy answer (`greedy_from`, `answer_text`). The picture of one evaluation is in
`bench/codec_quality.py`'s doc.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_adapter.reference.generate import decode_loop, prefill
from engine_adapter.reference.kv_cache import KVCache
from engine_adapter.reference.model import LlamaModel
from engine_adapter.reference.prompts import document_prompt

CHUNK_TOKENS = 256
STORE_DTYPE = torch.float16


# -- questions ----------------------------------------------------------------------------------------


@dataclass
class Question:
    index: int  # position in dev.json
    question: str
    answers: list[str]
    context_ids: list[int]
    question_ids: list[int]


def load_questions(path: Path, tokenizer, limit: int, seed: int, exclude: set[int] = frozenset()
                   ) -> list[Question]:
    """``limit`` dev questions picked with ``seed`` (in file order when seed < 0), never one of ``exclude``."""
    items = json.loads(path.read_text())
    order = [i for i in range(len(items)) if i not in exclude]
    if seed >= 0:
        random.Random(seed).shuffle(order)
    picked = sorted(order[:limit])
    questions = []
    for i in picked:
        item = items[i]
        document = "\n\n".join(p["text"] for p in item["ctxs"])
        context_ids, question_ids = document_prompt(tokenizer, document, item["question"])
        questions.append(Question(i, item["question"], list(item["answers"]), context_ids, question_ids))
    return questions


# -- the context KV, cached on disk -----------------------------------------------------------------------


def context_block(model: LlamaModel, context_ids: list[int], cache_dir: Path) -> tuple[torch.Tensor, float]:
    """The context's KV as one float16 block [L, 2, KVH, T, D], and the prefill seconds (0 if cached)."""
    digest = hashlib.sha256(model.config.model_id.encode() + torch.tensor(context_ids).numpy().tobytes())
    path = cache_dir / f"ctx-{digest.hexdigest()[:20]}.pt"
    if path.is_file():
        return torch.load(path), 0.0
    start = time.perf_counter()
    kv = model.new_cache(len(context_ids))
    prefill(model, context_ids, kv, start_pos=0)
    block = kv.export(0, len(context_ids)).to(STORE_DTYPE)
    seconds = time.perf_counter() - start
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(block, tmp)
    tmp.rename(path)
    return block, seconds


def chunk_bounds(n_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each 256-token chunk; the last one may be shorter.

        tokens: 0 ..... 255 | 256 ..... 511 | ... | 256k ... n-1
        chunk:  0           | 1             | ... | k (tail)
    """
    return [(s, min(s + CHUNK_TOKENS, n_tokens)) for s in range(0, n_tokens, CHUNK_TOKENS)]


@dataclass
class Transfer:
    """What `load_through_codec` moved: bytes before and after the codec, and seconds in encode and decode."""

    fp16_bytes: int = 0
    encoded_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0


def load_through_codec(kv: KVCache, block: torch.Tensor, codec) -> Transfer:
    """Reset kv to the context passed chunk by chunk through ``codec`` (None: unchanged)."""
    kv.truncate(0)
    out = Transfer()
    for start, end in chunk_bounds(block.shape[3]):
        chunk = block[:, :, :, start:end].contiguous()  # [L, 2, KVH, t, D] float16
        if codec is None:
            decoded = chunk
        else:
            t0 = time.perf_counter()
            encoded = codec.encode(chunk)
            t1 = time.perf_counter()
            decoded = codec.decode(encoded.payload, encoded.params, tuple(chunk.shape), chunk.dtype)
            out.encode_s += t1 - t0
            out.decode_s += time.perf_counter() - t1
            out.encoded_bytes += encoded.nbytes
        out.fp16_bytes += chunk.numel() * chunk.element_size()
        kv.load(decoded, start)
    return out


# -- scoring -------------------------------------------------------------------------------------------------


def answer_text(tokenizer, tokens: list[int]) -> str:
    """The continuation up to its first newline, EOS dropped."""
    tokens = [t for t in tokens if t not in tokenizer.eos_token_ids]
    return tokenizer.decode(tokens).split("\n")[0].strip()


@torch.inference_mode()
def teacher_forced_logits(model: LlamaModel, kv: KVCache, context_len: int, question_ids: list[int],
                          answer: list[int]) -> torch.Tensor:
    """Next-token logits [len(answer), vocab] at each answer position, one forward over question + answer.

    Row i predicts answer[i]: it is the output at question[-1] (i = 0) or answer[i-1].
    """
    ids = torch.tensor(question_ids + answer[:-1], dtype=torch.long)
    logits = model(ids, kv, context_len)  # [Tq + Ta - 1, vocab]
    return logits[len(question_ids) - 1:]


@torch.inference_mode()
def greedy_from(model: LlamaModel, kv: KVCache, context_len: int, question_ids: list[int], reference: list[int],
                ref_argmax: torch.Tensor, logits: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...]
                ) -> list[int]:
    """The codec's greedy continuation, given its teacher-forced ``logits`` over ``reference``.

    Same as the reference up to the first position p whose argmax differs; from p it is decoded
    on ``kv``, which holds the question + reference[:p] after truncating the forward's extra rows.
    """
    argmax = logits.argmax(-1)
    differ = (argmax != ref_argmax).nonzero()
    if differ.numel() == 0:
        return list(reference)
    p = int(differ[0])
    kv.truncate(context_len + len(question_ids) + p)
    return reference[:p] + decode_loop(model, kv, logits[p], max_new_tokens - p, eos)


def kl_per_position(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) in nats for each row of logits [N, vocab]."""
    log_p = F.log_softmax(ref_logits.double(), dim=-1)
    log_q = F.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)
