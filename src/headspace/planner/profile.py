"""A model's head profile (written by ``headspace profile``) and the patterns it gives the
head map: the heads that retrieve keep full attention, the others take a sparse pattern."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from headspace.errors import UserError
from headspace.planner.head_map import HeadMap


@dataclass
class Profile:
    """Per-head retrieval scores ``retrieval [layers][kv heads]`` in [0, 1] measured on a
    model, and pattern costs measured on a device: ``pattern_ms[pattern][context]`` for one
    kv head's query heads over one prefill chunk of ``chunk`` queries; ``budget_shares`` of a
    budget policy measured on the model."""

    model: str
    num_layers: int
    num_kv_heads: int
    retrieval: list[list[float]]
    device: str = "cpu"
    chunk: int = 0
    pattern_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    cases: list[dict] = field(default_factory=list)
    # "POLICY BUDGET" -> [layers][kv heads]: the tokens the policy gave each entry over the
    # profile's prompts, as a multiple of an even share
    budget_shares: dict[str, list[list[float]]] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and check a profile; UserError with the reason."""
        try:
            profile = cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"cannot read the profile {path}: {exc}") from None
        rows = {len(row) for row in profile.retrieval}
        if len(profile.retrieval) != profile.num_layers or rows != {profile.num_kv_heads}:
            raise UserError(f"the profile {path} has no score for every (layer, kv head)")
        return profile

    def check(self, num_layers: int, num_kv_heads: int) -> None:
        """UserError unless the profile was made on a model of this shape."""
        if (self.num_layers, self.num_kv_heads) != (num_layers, num_kv_heads):
            raise UserError(
                f"the profile is of a model with {self.num_layers} layers x "
                f"{self.num_kv_heads} kv heads, not {num_layers} x {num_kv_heads}"
            )


def with_patterns(head_map: HeadMap, retrieval: list[list[float]], retrieval_heads: float,
                  sparse: str) -> HeadMap:  # fmt: skip
    """``head_map`` with its patterns: the ``retrieval_heads`` share of entries with the
    highest scores keep ``full``, the rest take ``sparse`` (ties: earlier layers first),
    except entries off the GPU: the streamed tiers attend exactly, so they stay ``full``."""
    if not 0 <= retrieval_heads <= 1:
        raise UserError(f"retrieval heads must be a share in [0, 1], got {retrieval_heads}")
    ranked = sorted(head_map.entries, key=lambda e: -retrieval[e.layer][e.kv_head])
    full = {(e.layer, e.kv_head) for e in ranked[: round(retrieval_heads * len(ranked))]}
    entries = [replace(e, pattern="full" if (e.layer, e.kv_head) in full or e.tier != "gpu"
                       else sparse) for e in head_map.entries]  # fmt: skip
    return HeadMap(head_map.num_layers, head_map.num_kv_heads, entries)


def budget_key(policy: str, budget: float | int) -> str:
    """The key of a profile's ``budget_shares`` measured under ``policy`` at ``budget``."""
    return f"{policy} {budget}"


def with_budget_shares(head_map: HeadMap, shares: list[list[float]]) -> HeadMap:
    """``head_map`` whose budgeted entries keep their budget times their measured share
    (``shares[layer][kv_head]``, 1.0 = even): the uneven loads a share policy leaves. A
    streaming entry keeps its sink and window."""
    entries = [e if e.budget is None or e.pattern.startswith("streaming") else
               replace(e, budget=max(1, round(e.budget * shares[e.layer][e.kv_head])))
               for e in head_map.entries]  # fmt: skip
    return HeadMap(head_map.num_layers, head_map.num_kv_heads, entries)
