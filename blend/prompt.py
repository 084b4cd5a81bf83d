"""A prompt cut into the parts CacheBlend reuses: prefix, chunks (RAG passages), query.

Engines mark the parts in a prompt's text with a separator; `split_prompt` cuts text (each part
tokenized alone, so a chunk has one key wherever it appears), `split_tokens` cuts a prompt already
tokenized whole (what vLLM holds). A tokenizer here is anything with ``encode(text) -> ids`` and a
``backend`` of the `tokenizers` kind (``decode``, ``encode(...).ids`` and ``.offsets``), such as
the reference engine's `Tokenizer`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

DEFAULT_SEPARATOR = "<|chunk|>"
DEFAULT_RATIO = 0.15


@dataclass(frozen=True)
class BlendPrompt:
    """A prompt cut into its reusable parts (token ids). ``glue[i]``: tokens just before chunk i
    that belong to no part (a separator tokenized inside the whole prompt); empty when each part
    was tokenized alone."""

    prefix: list[int]
    chunks: list[list[int]]
    query: list[int]
    glue: list[list[int]] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """The prompt's token ids, in order."""
        glue = self.glue or [[] for _ in self.chunks]
        return self.prefix + [t for g, c in zip(glue, self.chunks) for t in g + c] + self.query


def split_prompt(tokenizer: Any, text: str, separator: str = DEFAULT_SEPARATOR, whole: bool = False) -> BlendPrompt:
    """Cut a plain prompt at ``separator``: the first part is the prefix, the last the query, the
    ones between are chunks (empty ones dropped). Each part is tokenized on its own, so a chunk's
    tokens (and key) are the same in every prompt that contains it::

        "You answer questions.<|chunk|>Doc A<|chunk|>Doc B<|chunk|>Q: who?"
         '------ prefix ------'         '-chunk-'      '-chunk-'      '-query-'

    ``whole``: tokenize the text whole, separators included, and cut it as :func:`split_tokens`
    does, as an engine that tokenizes the whole prompt (vLLM) sees it.
    """
    if whole:
        prompt = split_tokens(tokenizer, tokenizer.encode(text), separator)
        if prompt is None:
            raise ValueError(f"no {separator!r} in the prompt: mark where the prefix, chunks and query split")
        return prompt
    parts = text.split(separator)
    if len(parts) < 2:
        raise ValueError(f"no {separator!r} in the prompt: mark where the prefix, chunks and query split")
    query = tokenizer.encode(parts[-1])
    if not query:
        raise ValueError("the query (text after the last separator) is empty; the answer needs one token to follow")
    prefix = tokenizer.encode(parts[0]) if parts[0] else []
    chunks = [tokenizer.encode(part) for part in parts[1:-1] if part]
    return BlendPrompt(prefix, [c for c in chunks if c], query)


def split_tokens(tokenizer: Any, ids: Sequence[int], separator: str) -> BlendPrompt | None:
    """Cut a prompt tokenized whole (``prefix<sep>chunk<sep>...<sep>query``) at its separators, or
    None where its text holds none. The tokens whose text overlaps a separator are glue, computed
    on every layer; the last separator's go with the query. A chunk is its tokens in place, which
    depend only on the chunk and the separators beside it, so the same chunk has one key in every
    prompt. Often they are also the chunk tokenized alone (then the key is :func:`split_prompt`'s),
    but not where the tokenizer splits differently at the edge (a chunk ending in "\n\n" before a
    separator: two "\n" tokens in place, one "\n\n" alone). Raises ValueError (one line) for ids
    that are not their text's tokenization (the separators cannot be placed) or an empty query.
    """
    backend = tokenizer.backend
    ids = list(ids)
    text = backend.decode(ids, skip_special_tokens=False)
    if separator not in text:
        return None
    encoding = backend.encode(text, add_special_tokens=False)
    if encoding.ids != ids:
        raise ValueError(f"the prompt holds {separator!r} but its token ids are not its text's tokenization, "
                         f"so the separators cannot be placed; tokenize each part alone (split_prompt)")
    spans, at = [], text.find(separator)
    while at >= 0:
        spans.append((at, at + len(separator)))
        at = text.find(separator, at + len(separator))
    is_glue, span = [], 0  # per token: does its text overlap a separator (offsets never decrease)
    for start, end in encoding.offsets:
        end = max(end, start + 1)  # a token of no width (a byte of a longer character) still has a place
        while span < len(spans) and spans[span][1] <= start:
            span += 1
        is_glue.append(span < len(spans) and spans[span][0] < end)
    runs = [(glue, len(list(group))) for glue, group in itertools.groupby(is_glue)]
    if runs[0][0]:
        runs.insert(0, (False, 0))  # the prompt starts with a separator: no prefix
    if runs[-1][0]:
        raise ValueError(f"the prompt ends with {separator!r}: the query after the last one is empty")
    bounds = list(itertools.accumulate(n for _, n in runs))  # prefix, glue, chunk, ..., glue, query
    cut = [ids[a:b] for a, b in zip([0, *bounds], bounds)]
    return BlendPrompt(cut[0], cut[2:-2:2], cut[-2] + cut[-1], cut[1:-2:2])
