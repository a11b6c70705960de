"""What the KV cache is, in pure arithmetic (no tensors): its shape and the bytes of its
pages (:class:`KVSpec`), and the spec of each head's attention pattern (:class:`Pattern`),
which also says what KV a head holds. The planner reads these; so do the modules that own
memory and the attention kernels."""

from __future__ import annotations

import re
from dataclasses import dataclass

from headspace.model.config import ModelConfig

GiB = 2**30


def byte_size(num_bytes: float) -> str:
    """``num_bytes`` in a unit that fits it, for messages: "1.50 GiB", "3.0 MiB", "12.5 KiB",
    "100 bytes"."""
    for unit, size, digits in (("GiB", GiB, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes:.0f} bytes"


BLOCK = 128  # tokens per query and key block of the block masks
LAST_QUERIES = 64  # queries of a chunk that estimate vertical-slash (MInference's last_q)
FORCED_SINK = 1  # key blocks every vertical-slash head keeps (the first: attention sinks)
FORCED_LOCAL = 2  # block diagonals every vertical-slash head keeps (its own and the previous)
KINDS = {"full": (), "streaming": ("sink", "window"), "vertical_slash": ("vertical", "slash"),
         "block_sparse": ("blocks",)}  # fmt: skip
KIND_IDS = {kind: i for i, kind in enumerate(KINDS)}
# each sparse kind's parameters when none are given (DuoAttention's and MInference's, for
# prompts of 100K tokens and more)
DEFAULT_PATTERNS = {"streaming": "streaming(4,1024)", "vertical_slash": "vertical_slash(1000,6096)",
                    "block_sparse": "block_sparse(64)"}  # fmt: skip


def padded_length(n: int) -> int:
    """The length a chunk's queries, or its gathered keys and their tables, are padded to:
    a power of two, at least a block, so one compiled kernel serves every chunk up to it."""
    return 1 << (max(n, BLOCK) - 1).bit_length()


@dataclass(frozen=True)
class Pattern:
    """One head's pattern: a kind and its integer parameters (see the module doc)."""

    kind: str = "full"
    params: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"pattern must be one of {', '.join(KINDS)}, got {self.kind!r}")
        names = KINDS[self.kind]
        if len(self.params) != len(names) or any(type(p) is not int for p in self.params):
            raise ValueError(f"{self.kind} takes integers ({', '.join(names)}), got {self.params}")
        low = {"sink": 0}
        for name, value in zip(names, self.params, strict=True):
            if value < low.get(name, 1):
                raise ValueError(f"{self.kind}: {name} must be at least {low.get(name, 1)}")

    def __str__(self) -> str:
        return self.kind if not self.params else f"{self.kind}({','.join(map(str, self.params))})"

    @classmethod
    def parse(cls, text: str) -> Pattern:
        """``full``, ``streaming(4,1024)``, ``vertical_slash(1000,6000)``, ``block_sparse(16)``."""
        match = re.fullmatch(r"\s*(\w+)\s*(?:\(([\d,\s]*)\))?\s*", text)
        if match is None:
            raise ValueError(f"cannot read the pattern {text!r}")
        params = tuple(int(p) for p in (match.group(2) or "").split(",") if p.strip())
        return cls(match.group(1), params)

    @property
    def is_full(self) -> bool:
        return self.kind == "full"


def prefill_ring(page_size: int, sink: int, window: int, chunk: int) -> tuple[int, int]:
    """``(sink pages, ring pages)`` a ``streaming(sink, window)`` entry holds while its prompt
    is prefilled ``chunk`` tokens at a time: the pages of its sink, then a ring that each
    later page of the prompt overwrites in turn (logical page ``p`` past the sink in ring
    page ``(p - sink pages) % ring pages``). A chunk writes its tokens and reads the
    ``window`` keys before it, and those span at most ``(window + chunk) // page_size + 2``
    pages, so the ring holds all of them; a prompt of no more pages never wraps."""
    return -(-sink // page_size), (window + chunk) // page_size + 2


PREFIX_PIECE = 32768  # prefix tokens gathered at a time, at least, for a chunk's attention
PREFIX_CHUNKS = 4  # ... or this many chunks' worth


def prefix_piece(chunk_tokens: int, fixed: int | None = None) -> int:
    """Prefix tokens a chunk of ``chunk_tokens`` gathers at a time for its attention:
    ``fixed`` when given (a test's small pieces), else the larger of :data:`PREFIX_PIECE` and
    :data:`PREFIX_CHUNKS` chunks (Llama-3-8B: 16 KiB of K/V per chunk token, against ~100
    KiB of the chunk's activations)."""
    return fixed if fixed is not None else max(PREFIX_PIECE, PREFIX_CHUNKS * chunk_tokens)


@dataclass(frozen=True)
class KVSpec:
    """The KV cache's shape and the bytes of its pages.

    An *entry* is one (layer, kv head). A GPU page holds ``page_size`` tokens of every
    resident entry; a host page holds ``page_size`` tokens of every entry (so a whole
    sequence can be swapped out, and any entry can stream, without a new layout).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype_bytes: int

    @classmethod
    def of(cls, config: ModelConfig, page_size: int, dtype_bytes: int) -> KVSpec:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, page_size,
                   dtype_bytes)  # fmt: skip

    @property
    def num_entries(self) -> int:
        return self.num_layers * self.num_kv_heads

    @property
    def entry_token_bytes(self) -> int:
        """K and V of one token of one entry."""
        return 2 * self.head_dim * self.dtype_bytes

    @property
    def entry_page_bytes(self) -> int:
        """K and V of one page of one entry."""
        return self.page_size * self.entry_token_bytes

    @property
    def full_page_bytes(self) -> int:
        """One page of every entry: the all-resident GPU page and a host page of every row."""
        return self.num_entries * self.entry_page_bytes

    def host_page_bytes(self, rows: int = 0) -> int:
        """One host page holding ``rows`` kv heads of every layer (0: every kv head; per-entry
        pages offload fewer: ``Plan.host_rows``)."""
        return self.num_layers * (rows or self.num_kv_heads) * self.entry_page_bytes

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
