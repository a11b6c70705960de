"""Run under torchrun by tests/test_parallel_engine.py: each case of a JSON file through
``LLM`` (logits with decode steps, then a batch of generations); rank 0 saves the results
and each case's head map summary."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed

from headspace.api import LLM
from headspace.engine.hooks import EngineHooks
from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError
from headspace.kv.host_store import HostKVArena
from headspace.parallel.dist import leave
from headspace.parallel.launch import is_first_rank
from headspace.tiers.budget_ranks import RankBudgetTier
from headspace.tiers.entry_staging import EntryStaging

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' graph twin
from graph_twin import EagerGraphTwin  # noqa: E402

WIDTHS: list[int] = []  # the table width of every per-entry decode step on this rank
SWAPS: list[int] = []  # pages each swap moved, out to host pages (+) and back (-)
STAGED: list[int] = []  # bytes each decode step staged from this rank's host pages
GRAPH_DECISIONS: list[tuple] = []  # (streamed bytes, groups) each graph-or-eager choice
RELEASED: list[bool] = []  # at each graphs' release: whether the process group still stood
KEPT: list[list[int]] = []  # each prompt's entry lengths on this rank after its prefill


def _record(cls, name: str, note) -> None:
    """``cls.name`` calls through, then ``note`` with the same arguments."""
    method = getattr(cls, name)

    def recorded(self, *args, **kwargs):
        method(self, *args, **kwargs)
        note(self, *args, **kwargs)

    setattr(cls, name, recorded)


_record(RankBudgetTier, "before_decode", lambda self, *_, **__: WIDTHS.append(self.widest))
_record(
    RankBudgetTier,
    "after_prefill",
    lambda self, seq_id, *_: KEPT.append(list(self.blocks.entries[seq_id].lengths)),
)
_record(EntryStaging, "begin_decode", lambda self, *_, **__: STAGED.append(self.streamed_bytes))


class RefusingArena(HostKVArena):
    """Host pages of a rank whose arena cannot grow (page-locking failed)."""

    def ensure(self, num_pages: int, *, keep: bool = True, rows: int | None = None) -> bool:
        if num_pages > self.num_pages or rows not in (None, self.rows):
            raise UserError("cannot page-lock host memory on this rank")
        return False


def deciding_twin(bound: int | None) -> type:
    """The graphs' twin, recording each graph-or-eager choice; with ``bound``, a step is a
    graph when it streams at most that many bytes (ranks that stream different counts must
    still decide alike)."""

    class DecidingTwin(EagerGraphTwin):
        def step_faster(self, streamed_bytes: int, num_groups: int) -> bool:
            GRAPH_DECISIONS.append((streamed_bytes, num_groups))
            if bound is None:
                return super().step_faster(streamed_bytes, num_groups)
            return streamed_bytes <= bound

        def release(self) -> None:
            RELEASED.append(torch.distributed.is_initialized())
            super().release()

    return DecidingTwin


def run_case(case: dict) -> dict:
    WIDTHS.clear()
    SWAPS.clear()
    STAGED.clear()
    # decode steps through the graphs' CPU twin (padded rows, warm-ups) when the case asks;
    # a case bounds the bytes a graph's step may stream
    GRAPH_DECISIONS.clear()
    KEPT.clear()
    twin = deciding_twin(case.get("graph_max_bytes")) if case.get("graph_twin") else None
    refuses = case.get("host_refuses_on_rank") == int(os.environ["RANK"])
    stand_in = case.get("stand_in")  # kept counts per (layer, kv head): prompts not computed
    engines = []

    def count_swaps(name: str) -> None:  # before each step: the pages the last one swapped
        step = engines[0].load().lane(name).last_step if engines else None
        if step is not None:
            SWAPS.extend(n for n in (step["swap_out"], -step["swap_in"]) if n)

    hooks = EngineHooks(graphs=twin, host_arena=RefusingArena if refuses else None,
                        prompt_stand_in=stand_in and (lambda ids: stand_in),
                        lane_step=count_swaps)  # fmt: skip
    llm = LLM(case["model"], hooks=hooks, **case["options"])
    engines.append(llm.engine)
    ids = case["prompt"]
    params = SamplingParams(**case["params"])
    logits, outputs, error, after = None, [], None, None
    try:
        if stand_in is None:
            logits = llm.logits(ids, decode_tokens=case["decode_tokens"])
        outputs = llm.generate(batch(case), params)
    except UserError as refused:  # every rank must refuse alike (or the others would hang)
        error = str(refused)
        short = SamplingParams(max_new_tokens=8, ignore_eos=True)  # then a request that fits
        after = llm.generate(ids[:40], short)[0].token_ids if case.get("after") else None
    arrivals, moved = arrive(llm, case) if "arrivals" in case else (None, None)
    ranks = llm.engine.ranks
    errors = every_rank(error)
    heads = [lay.layer_heads for lay in ranks.layouts]  # every rank's heads per layer
    widths = every_rank(list(WIDTHS))  # step widths (a graph's key: they must agree)
    staged = every_rank(list(STAGED))  # bytes staged from host pages per decode step
    weighed = every_rank(llm.engine.lanes.rates[:2])  # the weights rate predictions weigh
    runner = llm.engine.lanes.resident.runner  # (under torchrun: one lane)
    graphs = every_rank(runner.has_graphs)  # decode steps as graphs
    searching = every_rank(runner.hybrid_share.search is not None)  # the hybrid share
    result = {"logits": logits, "tokens": [o.token_ids for o in outputs],
            "summary": ranks.head_map.summary(), "heads": heads, "widths": widths,
            "graphs": graphs[0], "graphs_all": graphs,
            "graph_decisions": every_rank(GRAPH_DECISIONS), "weighed": weighed,
            "swaps": list(SWAPS), "staged": staged, "errors": errors, "after": after,
            "tiers": [tiers(o.stats) for o in outputs], "arrivals": arrivals,
            "moved": every_rank(moved), "idle_pages": every_rank(pages_in_use(llm)),
            "streamed": llm.engine.model.layer_source is not None,
            "searching": searching, "kept": every_rank(list(KEPT)),
            "rank_heads": [[lay.heads(layer) for layer in range(len(lay.own))]
                           for lay in ranks.layouts],
            "patterns": [[e.pattern for e in ranks.head_map.layer(layer)]
                         for layer in range(ranks.head_map.num_layers)]}  # fmt: skip
    if case.get("leave"):  # the last case: the group goes as at exit, graphs released first
        result["left"] = left(llm)
    return result


def left(llm: LLM) -> dict:
    """What ``leave()`` (the exit's) does on this rank: the runner's decode graphs freed
    (each twin's ``release``) before the process group is destroyed."""
    runner = llm.engine.lanes.resident.runner
    had = runner.has_graphs
    RELEASED.clear()
    leave()
    return {
        "had_graphs": had,
        "group_alive_at_release": list(RELEASED),
        "graphs_after": runner.has_graphs,
        "group_after": torch.distributed.is_initialized(),
    }


def pages_in_use(llm: LLM) -> list[tuple[str, int, int]]:
    """Each lane's GPU and host pages in use on this rank."""
    return [(v.name, v.gpu_pages_used, v.host_pages_used) for v in llm.engine.load().lanes]


def arrive(llm: LLM, case: dict) -> tuple[list[list[int] | str], list]:
    """The batch's prompts added to the stepping engine before steps ``case["arrivals"]``
    (every rank alike), and aborted before the steps of ``case.get("aborts")`` ([index,
    step] pairs; one that has ended by then is left); each one's final tokens, or "abort",
    and the placements that changed under a running request ([index, before, after])."""
    engine, prompts, finals, placed, moved = llm.engine, batch(case), {}, {}, []
    params = SamplingParams(**case["params"])
    ids, step, aborts = {}, 0, case.get("aborts", [])
    last = max(case["arrivals"] + [at for _, at in aborts])
    while step <= last or engine.has_unfinished():
        for i, at in enumerate(case["arrivals"]):
            if at == step:
                ids[engine.add_request(prompts[i], params)] = i
        for i, at in aborts:
            request = next((r for r, index in ids.items() if index == i), None)
            if at == step and request is not None:
                engine.abort(request)
        for output in engine.step():
            if output.finished:
                reason = output.finish_reason
                finals[ids[output.request_id]] = "abort" if reason == "abort" else \
                    output.token_ids  # fmt: skip
        for view in engine.load().requests:
            if view.state in ("prefilling", "decoding"):
                before = placed.setdefault(view.request_id, view.placement)
                if view.placement != before:
                    moved.append([ids[view.request_id], before, view.placement])
        step += 1
    return [finals[i] for i in range(len(prompts))], moved


def every_rank(value) -> list:
    """Every rank's ``value`` (picklable), in rank order."""
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def tiers(stats) -> dict[str, int]:
    """Entries in each tier (every rank's) of the plan a request ran under."""
    return {"gpu": stats.num_gpu_heads, "stream": stats.num_streamed_heads,
            "hybrid": stats.num_hybrid_heads}  # fmt: skip


def batch(case: dict) -> list[list[int]]:
    """The prompts generated together: the case's prompt and its first half, or the first
    tokens of it in the case's ``batch`` lengths."""
    ids = case["prompt"]
    return [ids[:n] for n in case.get("batch", [len(ids), len(ids) // 2])]


def main(cases_path: str, out_path: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    results = [run_case(case) for case in cases]
    if is_first_rank():
        torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
