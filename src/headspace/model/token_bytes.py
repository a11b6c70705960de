"""The bytes each token stands for, where the tokenizer's decoder says how: byte-level BPE
(GPT-2's alphabet of 256 characters for bytes: Llama 3, Qwen, SmolLM) and SentencePiece's
byte fallback (``<0xE4>`` tokens: Llama 2, Mistral). A streamed text is read by them: a
token that ends inside a character is known as such, not guessed from the replacement
character that its text shows until the next one comes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, read backwards (character -> byte), from
    transformers' table of it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_byte_reader(tokenizer) -> Callable[[int], bytes] | None:
    """``read(token_id) -> bytes`` of ``tokenizer``'s tokens, where its decoder is byte-level
    BPE or byte fallback (each as the ``tokenizers`` backend names it, alone or in a
    sequence); None for other decoders (whose tokens are whole characters) and tokenizers
    without a ``tokenizers`` backend. (Cheap to make: the decoder's description is small.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    try:
        described = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 (no backend, or a decoder that describes itself otherwise)
        return None
    kinds = {part.get("type") for part in described.get("decoders", [described])}
    byte_level, fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
    if not (byte_level or fallback):
        return None
    alphabet = byte_level_alphabet() if byte_level else {}

    def read(token_id: int) -> bytes:
        token = backend.id_to_token(token_id)
        if token is None:
            return b""
        if fallback and BYTE_TOKEN.fullmatch(token):
            return bytes([int(token[3:5], 16)])
        if byte_level and all(c in alphabet for c in token):
            return bytes(alphabet[c] for c in token)
        return token.replace("\u2581", " ").encode()  # (SentencePiece's word mark: a space)

    return read


def ends_inside_character(read: Callable[[int], bytes], token_ids: Sequence[int]) -> bool:
    """Whether the bytes of ``token_ids`` end inside a UTF-8 character: a lead byte not
    followed yet by all its continuation bytes (the last 4 tokens read at most)."""
    tail = b"".join(read(t) for t in token_ids[-4:])[-4:]
    for back in range(1, len(tail) + 1):
        byte = tail[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: its lead is further back
            continue
        if byte >= 0xC0:  # a lead byte: of 2, 3 or 4
            return back < (2 if byte < 0xE0 else 3 if byte < 0xF0 else 4)
        return False  # ASCII: the text ends on a whole character
    return False  # continuation bytes alone: no character to wait for


def starts_inside_character(read: Callable[[int], bytes], token_id: int) -> bool:
    """Whether the token's first byte continues a character begun before it."""
    first = read(token_id)[:1]
    return bool(first) and first[0] & 0xC0 == 0x80


__all__ = ["ends_inside_character", "starts_inside_character", "token_byte_reader"]
