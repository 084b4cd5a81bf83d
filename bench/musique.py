"""MuSiQue for the benches: the dev set and its check, the RAG prompt, BM25 retrieval and answer F1.

The benches that read MuSiQue (`reuse_vs_rag.py`, `vllm_rag.py`, `codec_quality.py`, `warm_prefix.py`)
take the dev set from `MUSIQUE_DEV` or a ``--data`` file, checked by `musique_items`. The prompt (`prompt_text`, `build_prompt`) is the CacheBlend paper's MuSiQue prompt in
the model's chat template, each passage a chunk of its own, cut at ``SEP`` by `blend.prompt.split_prompt`.

MuSiQue: https://github.com/StonyBrookNLP/musique (CC BY 4.0).
"""

from __future__ import annotations

import json
import math
import os
import re
import string
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from blend.prompt import split_prompt

ROOT = Path(__file__).resolve().parent.parent
MUSIQUE_DEV = ROOT.parent / "shared" / "data" / "musique" / "dev.json"


def musique_items(path: str | os.PathLike | None, flag: str = "--data") -> list[dict]:
    """The MuSiQue JSON list in ``path``; when it cannot be used, exit (status 1) with one line
    naming the file, what is wrong and where the file comes from, before any model loads."""
    origin = (f"it is MuSiQue's dev set, a JSON list of {{question, answers, ctxs}}: {MUSIQUE_DEV} in this "
              f"project's layout, or from https://github.com/StonyBrookNLP/musique (docs/benchmarks.md: Reuse vs RAG)")
    prog = os.path.basename(sys.argv[0] or "bench")
    if not path:
        raise SystemExit(f"{prog}: no {flag} given and no {MUSIQUE_DEV}; {origin}")
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SystemExit(f"{prog}: {flag} {path}: {exc.strerror}; {origin}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{prog}: {flag} {path}: not JSON ({exc}); {origin}") from None
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and {"question", "answers", "ctxs"} <= set(i) for i in items):
        raise SystemExit(f"{prog}: {flag} {path}: not a non-empty list of {{question, answers, ctxs}}; {origin}")
    return items


SEP = "\u2063KVSTORE-CHUNK\u2063"
INSTRUCTION = ("You will be asked a question after reading several passages. Answer it directly from the "
               "passages, in at most 5 words. Do not repeat the question.\n\nPassages:\n")
QUESTION = "\nAnswer the question directly from the passages, in at most 5 words.\nQuestion: {question}"


# -- prompt, retrieval, scoring ------------------------------------------------------------------


@dataclass
class Prompt:
    prefix: list[int]
    chunks: list[list[int]]    # every passage, tokenized alone
    query: list[int]

    def ids(self, chosen: list[int]) -> list[int]:
        return self.prefix + [t for i in chosen for t in self.chunks[i]] + self.query


def prompt_text(tokenizer, passages: list[str], question: str) -> str:
    """The chat prompt's text, passages marked with SEP (``prefix SEP passage SEP ... SEP query``)."""
    content = INSTRUCTION + SEP + SEP.join(p.strip() + "\n\n" for p in passages) + SEP + QUESTION.format(question=question)
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def build_prompt(tokenizer, passages: list[str], question: str) -> Prompt:
    split = split_prompt(tokenizer, prompt_text(tokenizer, passages, question), SEP)
    return Prompt(split.prefix, split.chunks, split.query)


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def bm25_top_k(question: str, passages: list[str], k: int, k1: float = 1.5, b: float = 0.75) -> list[int]:
    """Indices of the k best passages for ``question`` by Okapi BM25, in passage order."""
    docs = [Counter(words(p)) for p in passages]
    lengths = [sum(d.values()) for d in docs]
    avg = sum(lengths) / len(lengths)
    n = len(docs)
    scores = []
    for doc, length in zip(docs, lengths):
        score = 0.0
        for term in set(words(question)):
            df = sum(term in d for d in docs)
            if not df or term not in doc:
                continue
            idf = math.log((n - df + 0.5) / (df + 0.5) + 1)
            tf = doc[term]
            score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / avg))
        scores.append(score)
    best = sorted(range(n), key=lambda i: -scores[i])[:k]
    return sorted(best)


def normalize_answer(text: str) -> list[str]:
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return [w for w in text.split() if w not in ("a", "an", "the")]


def f1_score(prediction: str, golds: list[str]) -> float:
    best = 0.0
    pred = normalize_answer(prediction)
    for gold in golds:
        ref = normalize_answer(gold)
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            precision, recall = common / len(pred), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
