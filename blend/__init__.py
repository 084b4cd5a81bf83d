"""CacheBlend: reuse the KV of chunks (RAG passages) at any position. See docs/blend.md.

    BlendEngine(model, tokenizer, client).generate(prefix, chunks, query)   blend/engine.py
    split_prompt(tokenizer, text, separator)                                blend/engine.py
"""
