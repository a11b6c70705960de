"""What a copy of a shared kv head adds to a rank's decode step (FairKV's fair-copying), the
copies found inside the decode kernel against separate launches, measured in one run.

    PYTHONPATH=src python bench/profiles/copy_cost.py [--batch 4 64] [--copies 1 2 4] [--kept 1024]

One rank of two, one layer of Llama-3.1-8B (32 query heads over 8 kv heads, bf16): four own
kv heads under a KV budget (each (sequence, head) row keeps ``--kept`` tokens on average,
spread 0.25x-1.75x over the rows, in shuffled pages of 128 of one entry plane) and
``--copies`` copies of other heads, each this rank's half of a head (shares 0.5 / 0.5, the
second copy: the tail with the new token). Every variant is captured in a CUDA graph, as the
engine's decode runs, over 32 layers' planes, and timed by replay:

- ``own_and_plain_rows``: the own heads and, as plain rows, rows that read exactly the
  copies' keys (the same bytes, one launch, no copy work): the floor a copy's work is
  measured from;
- ``in_kernel`` (this code): own heads and copies in one launch, each copy's range cut
  inside the kernel from the lengths and shares (``entry_decode(key_shares=)``), then the
  merge (:func:`~headspace.tiers.copies.merge_copies`: a fixed handful of ops a layer);
- ``separate`` (as the engine ran copies before): the own heads' launch, then the copies'
  key ranges found with torch ops per copy, their new tokens stored, their own launch, and
  a merge with a loop over the copies.

The lse exchange is a stack of this rank's lse with itself (what an all-gather of two
returns, without NCCL: its cost is one collective a layer either way). ``copy_cost_us`` is
``(variant - own_and_plain_rows) / copies``, per layer: what each copy adds to a step, per
layer it is made in. Writes ``copy_cost_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import environment, gpu_tag, graph_seconds, write_result  # noqa: E402
from headspace.attention.entry_decode import entry_decode, share_ranges  # noqa: E402
from headspace.kv.paged_store import new_token_slots  # noqa: E402
from headspace.tiers.copies import merge_copies  # noqa: E402

LAYERS, Q_PER_KV, DIM, PAGE, OWN = 32, 4, 128, 128, 4
SHARES = (0.5, 0.5)


def rows_of(batch: int, heads: int, kept: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch x heads]`` rows' lengths (``kept`` on average, 0.25x-1.75x) and their block
    tables (shuffled pages of one plane), rows sequence-major."""
    num_rows = batch * heads
    lengths = (kept * (0.25 + 1.5 * torch.rand(num_rows, generator=generator))).int() + 1
    width = int(lengths.max()) // PAGE + 1
    pages = torch.randperm(num_rows * width, generator=generator).view(num_rows, width)
    return lengths, pages.int()


class Layer:
    """One layer's decode inputs on the GPU: q and the new token for own heads and copies,
    the entry plane, every row's table and length, and the copies' shares."""

    def __init__(self, batch: int, copies: int, kept: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        heads = OWN + copies
        self.batch, self.copies, self.heads = batch, copies, heads
        lengths, tables = rows_of(batch, heads, kept, generator)
        self.lengths, self.tables = lengths.to("cuda"), tables.to("cuda")
        slots = (int(tables.max()) + 2) * PAGE
        self.plane = torch.randn(2, slots, DIM, dtype=torch.bfloat16, device="cuda")
        self.q = torch.randn(batch, heads * Q_PER_KV, DIM, dtype=torch.bfloat16, device="cuda")
        self.new_kv = torch.randn(2, batch, heads, DIM, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.q)
        # each copy: this rank's second half of a head (index 1 of shares 0.5 / 0.5)
        bounds = [(0.0, 1.0)] * OWN + [(SHARES[0], 1.0)] * copies
        self.key_shares = torch.tensor(bounds, dtype=torch.float64, device="cuda")
        self.columns = torch.arange(copies, device="cuda")
        # the plain rows' floor: every row over the keys its variant reads, no copy work
        self.plain_tables, self.plain_lengths = share_ranges(self.tables, self.lengths,
                                                             self.key_shares, PAGE)  # fmt: skip

    def exchange(self, mine: torch.Tensor) -> torch.Tensor:
        return torch.stack([mine, mine])

    def plain_rows(self) -> None:
        result, _ = entry_decode(self.q, self.plane[0], self.plane[1], self.plain_tables,
                                 self.plain_lengths, PAGE, new_kv=self.new_kv)  # fmt: skip
        self.out.copy_(result)

    def in_kernel(self) -> None:  # (its slices sized for the own heads, as the engine)
        result, lse = entry_decode(self.q, self.plane[0], self.plane[1], self.tables,
                                   self.lengths, PAGE, new_kv=self.new_kv,
                                   key_shares=self.key_shares,
                                   sliced_rows=self.batch * OWN)  # fmt: skip
        self.out.copy_(result)
        split = OWN * Q_PER_KV
        merge_copies(lse[:, split:], self.out[:, split:], self.columns, self.copies,
                     self.exchange, self.batch, Q_PER_KV, self.q.device)  # fmt: skip

    def separate(self) -> None:
        """The copies as the engine ran them before they joined the own heads' launch."""
        split, batch, heads = OWN * Q_PER_KV, self.batch, self.heads
        tables = self.tables.view(batch, heads, -1)
        lengths = self.lengths.view(batch, heads)
        result, _ = entry_decode(self.q[:, :split], self.plane[0], self.plane[1],
                                 tables[:, :OWN].flatten(0, 1), lengths[:, :OWN].flatten(),
                                 PAGE, new_kv=self.new_kv[:, :, :OWN])  # fmt: skip
        self.out[:, :split] = result
        index = lengths[:, OWN:] - 1
        slots = new_token_slots(tables[:, OWN:].flatten(0, 1), index.flatten(), PAGE)
        scratch = self.plane.shape[1] - PAGE
        slots = torch.where(lengths[:, OWN:].flatten() > 0, slots, scratch)
        self.plane[:, slots] = self.new_kv[:, :, OWN:].flatten(1, 2)
        ranges = [share_ranges(tables[:, OWN + j], lengths[:, OWN + j],
                               self.key_shares[OWN + j : OWN + j + 1], PAGE)
                  for j in range(self.copies)]  # fmt: skip
        shifted, counts = (torch.stack(parts, 1) for parts in zip(*ranges, strict=True))
        part, lse = entry_decode(self.q[:, split:], self.plane[0], self.plane[1],
                                 shifted.flatten(0, 1), counts.flatten(), PAGE)  # fmt: skip
        empty = (counts.flatten() == 0).view(batch, -1).repeat_interleave(Q_PER_KV, 1)
        lse = lse.float().masked_fill(empty, -torch.inf)
        self.out[:, split:] = part
        mine = torch.full((batch, self.copies, Q_PER_KV), -torch.inf, device=self.q.device)
        for j in range(self.copies):
            mine[:, j] = lse[:, j * Q_PER_KV : (j + 1) * Q_PER_KV]
        total = torch.logsumexp(self.exchange(mine), dim=0)
        for j in range(self.copies):
            weight = torch.exp(mine[:, j] - total[:, j]).nan_to_num(0.0)[..., None]
            cols = slice(split + j * Q_PER_KV, split + (j + 1) * Q_PER_KV)
            self.out[:, cols] = (self.out[:, cols].float().nan_to_num(0.0) * weight).to(
                self.out.dtype
            )


def check_merge(layer: Layer) -> None:
    """The two ways of running copies give the same merged output (bf16)."""
    layer.in_kernel()
    fused = layer.out.clone()
    layer.separate()
    error = (layer.out.float() - fused.float()).abs().max().item()
    assert error < 2e-2, f"in-kernel copies differ from separate launches by {error}"


def measure(batch: int, copies: int, kept: int) -> dict:
    """Each variant's graph-replayed seconds over ``LAYERS`` layers, and the copy cost."""
    layers = [Layer(batch, copies, kept, seed) for seed in range(LAYERS)]
    check_merge(layers[0])
    seconds = {}
    for name in ("own_and_plain_rows", "in_kernel", "separate"):
        method = "plain_rows" if name == "own_and_plain_rows" else name

        def step(method=method) -> None:
            for layer in layers:
                getattr(layer, method)()

        seconds[name] = graph_seconds(step) / LAYERS
    floor = seconds["own_and_plain_rows"]
    cost = {name: (seconds[name] - floor) / copies * 1e6 for name in ("in_kernel", "separate")}
    layers.clear()
    torch.cuda.empty_cache()
    return {"batch": batch, "copies": copies, "kept_tokens_mean": kept,
            "layer_us": {k: v * 1e6 for k, v in seconds.items()},
            "copy_cost_us": {"before": cost["separate"], "after": cost["in_kernel"]}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kept", type=int, default=1024)
    args = parser.parse_args()
    env = environment()
    cases = [measure(b, c, args.kept) for b in args.batch for c in args.copies]
    result = {
        "env": env,
        "config": {
            "layers": LAYERS,
            "q_per_kv": Q_PER_KV,
            "head_dim": DIM,
            "page_size": PAGE,
            "own_kv_heads": OWN,
            "copy_shares": SHARES,
            "dtype": "bfloat16",
            "rank": "1 of 2 (lse exchange: a stack, no NCCL)",
        },  # fmt: skip
        "cases": cases,
        "copy_cost_us": {
            "before": max(c["copy_cost_us"]["before"] for c in cases),
            "after": max(c["copy_cost_us"]["after"] for c in cases),
        },
    }
    path = write_result(f"copy_cost_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"{'batch':>6} {'copies':>6} {'floor us':>9} {'in kernel':>10} {'separate':>9} "
          f"{'cost after':>10} {'cost before':>11}")  # fmt: skip
    for c in cases:
        us, cost = c["layer_us"], c["copy_cost_us"]
        print(f"{c['batch']:>6} {c['copies']:>6} {us['own_and_plain_rows']:>9.1f} "
              f"{us['in_kernel']:>10.1f} {us['separate']:>9.1f} {cost['after']:>10.1f} "
              f"{cost['before']:>11.1f}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
