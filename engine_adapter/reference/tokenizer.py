"""Text <-> token ids, and chat templates, built with the `tokenizers` package (not transformers).

Two sources: GGUF metadata (`tokenizer.ggml.*`, byte-level BPE only) or a Hugging Face
`tokenizer.json`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; None means GPT-2's own regex (ByteLevel with use_regex=True).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids and chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None):
        if not eos_token_ids:
            raise ValueError("a Tokenizer needs at least one EOS token id")
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Byte-level BPE from a GGUF file's `tokenizer.ggml.*` fields (already decoded to Python values)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') GGUF tokenizers are "
                "supported - use load_hf_folder with a tokenizer.json for other models"
            )
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZER_SPLITS:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is unknown; known: {sorted(PRE_TOKENIZER_SPLITS)}")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges") or []]

        # Some files store a token in plain UTF-8 rather than in the byte alphabet; respell it.
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {
            token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)
        }
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        split = PRE_TOKENIZER_SPLITS[pre]
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        backend.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>) must stay whole; a "control" token spelled outside the byte
        # alphabet is a converter mislabel and is left alone.
        control = [AddedToken(token, special=True, normalized=False)
                   for token, kind in zip(tokens, token_types)
                   if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet]
        user_defined = [AddedToken(token, special=False, normalized=False)
                        for token, kind in zip(tokens, token_types)
                        if kind == TOKEN_TYPE_USER_DEFINED and token in vocab]
        backend.add_special_tokens(control)
        backend.add_tokens(user_defined)

        eos_ids = [metadata["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in metadata else []
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if key in metadata and metadata[key] not in eos_ids:
                eos_ids.append(metadata[key])
        return cls(backend, metadata.get("tokenizer.ggml.bos_token_id"), tuple(eos_ids),
                   metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_ids: Sequence[int] | None = None,
                    bos_token_id: int | None = None) -> Tokenizer:
        """From a Hugging Face folder: `tokenizer.json`, plus `tokenizer_config.json` and
        `chat_template.jinja` when present. Special ids not given are looked up from the token
        strings in `tokenizer_config.json`."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json; save one with tokenizer.save_pretrained")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = folder / "chat_template.jinja"
        chat_template = template_path.read_text() if template_path.is_file() else config.get("chat_template")

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(text) if text else None

        if bos_token_id is None:
            bos_token_id = token_id(config.get("bos_token"))
        if not eos_token_ids:
            eos = token_id(config.get("eos_token"))
            if eos is None:
                raise ValueError(f"no EOS token: pass eos_token_ids or set eos_token in {config_path}")
            eos_token_ids = (eos,)
        return cls(backend, bos_token_id, tuple(eos_token_ids), chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (<|im_start|>) stay whole."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]), rendered with the
        model's Jinja chat template in a sandbox."""
        if not self.chat_template:
            raise ValueError("this model ships no chat template; build the prompt text yourself")
        template = _compile_chat_template(self.chat_template)
        token = self.backend.id_to_token
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=token(self.eos_token_ids[0]),
        )


@lru_cache(maxsize=8)
def _compile_chat_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source)
