"""The head map: one entry per (layer, kv head) saying where its KV lives and how it runs.

A small, printable, serialisable table. The planner fills ``tier`` and ``group``; later
work fills ``pattern``, ``budget`` and ``rank``. All-``gpu``/``full``/``None``/rank 0 is a
plain single-GPU engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

TIERS = ("gpu", "stream", "hybrid")
OFFLOADED = ("stream", "hybrid")  # tiers whose KV lives in host pages


@dataclass(frozen=True)
class HeadEntry:
    """Decisions for one kv head of one layer."""

    layer: int
    kv_head: int
    tier: str = "gpu"  # gpu: resident; stream: host pages, copied in per layer; hybrid:
    # host pages, the older tokens attended there by CPU threads, the rest copied in
    pattern: str = "full"
    budget: int | None = None  # KV tokens kept (None: all)
    rank: tuple[int, ...] = (0,)  # GPU rank(s) computing this head
    shares: tuple[float, ...] = ()  # with several ranks: each copy's share of its attention
    group: int = 0  # head group inside the layer (moved and computed together)

    def __post_init__(self):
        assert self.tier in TIERS, f"unknown tier {self.tier}"
        assert not self.shares or (
            len(self.shares) == len(self.rank) > 1 and abs(sum(self.shares) - 1) < 1e-6
        ), f"shares {self.shares} must be one per rank of {self.rank} and sum to 1"


@dataclass
class HeadMap:
    """Entries for every (layer, kv head), layer-major."""

    num_layers: int
    num_kv_heads: int
    entries: list[HeadEntry] = field(default_factory=list)

    @classmethod
    def all_gpu(cls, num_layers: int, num_kv_heads: int) -> HeadMap:
        entries = [HeadEntry(l, h) for l in range(num_layers) for h in range(num_kv_heads)]  # noqa: E741
        return cls(num_layers, num_kv_heads, entries)

    def __post_init__(self):
        if self.entries:
            assert len(self.entries) == self.num_layers * self.num_kv_heads
            assert all(
                (e.layer, e.kv_head) == divmod(i, self.num_kv_heads)
                for i, e in enumerate(self.entries)
            ), "entries must be layer-major"

    def entry(self, layer: int, kv_head: int) -> HeadEntry:
        return self.entries[layer * self.num_kv_heads + kv_head]

    def layer(self, layer: int) -> list[HeadEntry]:
        return self.entries[layer * self.num_kv_heads : (layer + 1) * self.num_kv_heads]

    def heads(self, layer: int, tier: str) -> list[int]:
        """kv heads of ``layer`` in ``tier``, ascending."""
        return [e.kv_head for e in self.layer(layer) if e.tier == tier]

    def offloaded_groups(self, layer: int) -> list[list[int]]:
        """The offloaded (stream or hybrid) kv heads of ``layer``, grouped as they are moved
        and attended, in group order."""
        groups: dict[int, list[int]] = {}
        for e in self.layer(layer):
            if e.tier in OFFLOADED:
                groups.setdefault(e.group, []).append(e.kv_head)
        return [groups[g] for g in sorted(groups)]

    def count(self, *tiers: str) -> int:
        """Entries in any of ``tiers``."""
        return sum(1 for e in self.entries if e.tier in tiers)

    @property
    def num_offloaded(self) -> int:
        """Entries whose KV lives in host pages (stream or hybrid)."""
        return self.count(*OFFLOADED)

    @property
    def num_offloaded_groups(self) -> int:
        """Groups of offloaded entries over all layers (each moved and attended as one)."""
        return sum(len(self.offloaded_groups(layer)) for layer in range(self.num_layers))

    def summary(self) -> str:
        """One line: entries per tier, group size, patterns, budgets, ranks."""
        tiers = Counter(e.tier for e in self.entries)
        parts = [
            f"{len(self.entries)} entries ({self.num_layers} layers x {self.num_kv_heads} kv heads)"
        ]
        parts += [f"{tier}={tiers[tier]}" for tier in TIERS if tiers[tier]]
        sizes = {len(g) for layer in range(self.num_layers) for g in self.offloaded_groups(layer)}
        if sizes:
            parts.append(f"group size {'/'.join(map(str, sorted(sizes)))}")
        patterns = Counter(e.pattern for e in self.entries)
        parts.append("pattern " + ", ".join(f"{p}={n}" for p, n in patterns.items()))
        budgets = Counter("all" if e.budget is None else e.budget for e in self.entries)
        if set(budgets) == {"all"}:
            parts.append("budget all")
        else:  # tokens kept: count of entries
            parts.append("budget " + ", ".join(f"{b}={n}" for b, n in budgets.items()))
        ranks = sorted({r for e in self.entries for r in e.rank})
        parts.append(f"ranks {ranks}")
        copied = sum(len(e.rank) > 1 for e in self.entries)
        if copied:
            parts.append(f"{copied} entries copied on several ranks")
        return "; ".join(parts)

    def grid(self) -> str:
        """A layer x head picture: G resident, S streamed, H hybrid (group digit after),
        lower case where the head's pattern is not ``full``."""
        marks = {"gpu": "G", "stream": "S", "hybrid": "H"}
        lines = []
        for layer in range(self.num_layers):
            cells = [(marks[e.tier] if e.pattern == "full" else marks[e.tier].lower())
                     + (str(e.group) if e.tier in OFFLOADED else " ")
                     for e in self.layer(layer)]  # fmt: skip
            lines.append(f"layer {layer:>3}  " + " ".join(cells))
        return "\n".join(lines)

    @staticmethod
    def legend() -> str:
        """What :meth:`grid`'s marks and :meth:`summary`'s words mean, for a reader."""
        return ("legend: G resident on the GPU; S streamed from host pages each step; H "
                "hybrid (its older tokens attended on the CPU); the digit after S or H: the "
                "streamed group it moves with (group size: kv heads a group holds); lower "
                "case: a pattern other than full attention")  # fmt: skip

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "entries": [
                {**asdict(e), "rank": list(e.rank), "shares": list(e.shares)} for e in self.entries
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> HeadMap:
        entries = [
            HeadEntry(**{**e, "rank": tuple(e["rank"]), "shares": tuple(e.get("shares", ()))})
            for e in data["entries"]
        ]
        return cls(data["num_layers"], data["num_kv_heads"], entries)
