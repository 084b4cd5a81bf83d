"""Prompt layout for document question answering with a reusable document prefix.

The document must be the *prefix* of the token sequence for its KV to be reused, and its tokens
must be identical whatever question follows. So the chat template is rendered once with a marker
where the document ends, and the two sides are tokenized separately::

    |<chat header><document>|<question><assistant header>|
     '---- context_ids -----' '------ question_ids ------'

``kvstore ingest`` stores ``context_ids`` chunks; a later question over the same document hits
every full chunk of them.
"""

from __future__ import annotations

from engine_adapter.reference.tokenizer import Tokenizer

_MARKER = "\u2063KVSTORE-DOCUMENT-END\u2063"


def document_prompt(tokenizer: Tokenizer, document: str, question: str) -> tuple[list[int], list[int]]:
    """(context_ids, question_ids) for asking ``question`` about ``document``."""
    content = f"Answer the question from the document.\n\nDocument:\n{document}{_MARKER}\n\nQuestion: {question}\nAnswer in a few words."
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    head, tail = text.split(_MARKER)
    return tokenizer.encode(head), tokenizer.encode(tail)
