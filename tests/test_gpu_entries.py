"""Per-entry pages on the GPU: entry-row decode, KV budgets (resident and offloaded), ring
entries of streaming heads, and prefill under patterns, each against its CPU twin or the
resident run."""

from __future__ import annotations

import pytest
import torch

from gpu_models import GREEDY, arena_budget, greedy, make_engine, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_entry_decode_on_gpu_matches_the_cpu_twin():
    """Rows of per-head lengths through the Triton kernel (which stores the new K/V), their
    tables' columns past each row's pages unreadable."""
    from headspace.attention.entry_decode import entry_decode

    torch.manual_seed(7)
    page, num_rows, dim = 128, 6, 128
    plane = torch.randn(2, 40 * page, dim, device="cuda")
    tables = torch.randperm(40)[:30].view(num_rows, 5).int().cuda()
    lengths = torch.tensor([1, 129, 640, 300, 57, 513], dtype=torch.int32, device="cuda")
    # no column past a row's pages is read: there a page far outside the plane
    unused = torch.arange(5, device="cuda") >= (lengths[:, None] + page - 1) // page
    tables[unused] = 2**30
    q = torch.randn(2, 12, dim, device="cuda")  # 2 sequences x 3 kv heads x group 4
    new_kv = torch.randn(2, 2, 3, dim, device="cuda")
    cpu_plane = plane.cpu()
    out, lse = entry_decode(q, plane[0], plane[1], tables, lengths, page, new_kv=new_kv)
    ref, ref_lse = entry_decode(q.cpu(), cpu_plane[0], cpu_plane[1], tables.cpu(), lengths.cpu(),
                                page, new_kv=new_kv.cpu(), reference=True)  # fmt: skip
    torch.testing.assert_close(plane.cpu(), cpu_plane)  # the same slots were written
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-4, rtol=1e-4)


def test_kv_budget_on_gpu():
    """A budget covering the prompt equals the resident run; a quarter holds less."""
    model = tiny_model("cuda", torch.float32, layers=8)
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 300)]
    expected = greedy(make_engine(model, dtype="float32"), prompts)
    whole = make_engine(model, dtype="float32", kv_budget=1.0, kv_policy="ada_snapkv")
    assert greedy(whole, prompts) == expected
    quarter = make_engine(model, dtype="float32", kv_budget=0.25)
    outs = quarter.generate_batch([p.tolist() for p in prompts], [GREEDY] * 2)
    assert all(o.stats.kv_held_fraction < 0.4 for o in outs)


@pytest.mark.parametrize("policy,min_run", [("snapkv", None), ("ada_snapkv", None),
                                             ("snapkv", 1), ("snapkv", 2)])  # fmt: skip
def test_offloaded_budget_entries_on_gpu_equal_the_resident_budget(policy, min_run,
                                                                   monkeypatch):  # fmt: skip
    """Entries in page-locked host pages, staged per layer on the copy stream by their own
    lengths (by the page kernel; with ``min_run`` by the copy engine over runs of adjacent
    host pages, and at 2 by both in one step), in a batch of two: the same tokens as every
    entry resident."""
    from headspace.engine.hooks import EngineHooks
    from headspace.planner.sparsity import gathered_bytes
    from headspace.tiers.entry_staging import EntryStaging

    if min_run is not None:
        monkeypatch.setattr(EntryStaging, "MIN_RUN_PAGES", min_run)
    model = tiny_model("cuda", torch.float32, layers=8)
    generator = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 300)]
    options = {"dtype": "float32", "kv_budget": 0.25, "kv_policy": policy}
    resident = make_engine(model, **options)
    expected = greedy(resident, prompts)
    spec, cfg = resident.lanes.spec, model.config
    pages = spec.pages_for(900 + 64)  # half the entries of the longer request, two slots
    gathered = gathered_bytes(spec.num_kv_heads, cfg.num_queries_per_kv, spec.head_dim, 4,
                              resident.max_context)  # fmt: skip
    plane = spec.num_entries // 2 * pages + 2 * spec.num_kv_heads * pages + 1
    plans = []

    def seen(name: str) -> None:  # the layout in force as each step starts
        plans.append(offloaded.load().lane(name).plan)

    offloaded = make_engine(model, EngineHooks(lane_step=seen),
                            gpu_memory=arena_budget(model, plane * spec.entry_page_bytes
                                                    + gathered), **options)  # fmt: skip
    runner = offloaded.lanes.resident.runner  # (per-entry pages: one lane)
    assert greedy(offloaded, prompts) == expected
    plans = [plan for plan in plans if plan is not None]
    assert max(p.head_map.count("stream") for p in plans) > 0 and runner.host.data.is_pinned()
    paths = {None: (False, True), 1: (True, False), 2: (True, True)}[min_run]  # (runs, kernel)
    staged = runner.site.counters  # pages staged by the copy engine and by the kernel
    assert (staged.run_pages > 0, staged.kernel_pages > 0) == paths, staged


def test_streaming_heads_on_gpu_equal_the_cpu_run(tmp_path):
    """Ring entries in CUDA graphs (each new token over the oldest window token), a batch
    of two, against the same engine on the CPU."""
    from headspace.planner.profile import Profile

    cpu_model = tiny_model("cpu", torch.float32, layers=8)
    cfg = cpu_model.config
    scores = torch.rand(
        cfg.num_layers, cfg.num_kv_heads, generator=torch.Generator().manual_seed(3)
    )
    profile = tmp_path / "profile.json"
    Profile("tiny", cfg.num_layers, cfg.num_kv_heads, scores.tolist()).save(profile)
    options = {"dtype": "float32", "profile": str(profile), "retrieval_heads": 0.5,
               "sparse_pattern": "streaming(4,100)"}  # fmt: skip
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 300)]
    expected = greedy(make_engine(cpu_model, **options), prompts)
    gpu = make_engine(tiny_model("cuda", torch.float32, layers=8), **options)
    outs = gpu.generate_batch([p.tolist() for p in prompts], [GREEDY] * 2)
    assert [o.token_ids for o in outs] == expected
    assert all(0.5 < o.stats.kv_held_fraction < 0.7 for o in outs)


@pytest.mark.parametrize("pattern", ["block_sparse(2)", "vertical_slash(16,200)"])
def test_prefill_patterns_on_gpu_equal_the_cpu_run(tmp_path, pattern):
    """Compiled FlexAttention over gathered keys (padded to a capacity), chunk by chunk,
    against the same engine on the CPU (there equal to the masked dense model)."""
    from headspace.planner.profile import Profile

    cpu_model = tiny_model("cpu", torch.float32, layers=8)
    cfg = cpu_model.config
    scores = torch.rand(cfg.num_layers, cfg.num_kv_heads,
                        generator=torch.Generator().manual_seed(4))  # fmt: skip
    profile = tmp_path / "profile.json"
    Profile("tiny", cfg.num_layers, cfg.num_kv_heads, scores.tolist()).save(profile)
    options = {"dtype": "float32", "profile": str(profile), "retrieval_heads": 0.5,
               "sparse_pattern": pattern, "prefill_chunk": 256}  # fmt: skip
    generator = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 300)]
    expected = greedy(make_engine(cpu_model, **options), prompts)
    gpu = make_engine(tiny_model("cuda", torch.float32, layers=8), **options)
    assert greedy(gpu, prompts) == expected
    assert expected != greedy(make_engine(cpu_model, dtype="float32"), prompts)


def test_entry_decode_on_gpu_stores_ring_rows_at_their_index_and_empty_rows_nowhere():
    from headspace.attention.entry_decode import entry_decode

    torch.manual_seed(8)
    page, dim = 64, 64
    plane = torch.randn(2, 30 * page, dim, device="cuda")
    tables = torch.randperm(30)[:12].view(4, 3).int().cuda()
    lengths = torch.tensor([150, 0, 64, 100], dtype=torch.int32, device="cuda")
    new_index = torch.tensor([7, 0, 63, 99], dtype=torch.int32, device="cuda")  # rings: 7, 63
    q = torch.randn(2, 8, dim, device="cuda")  # 2 sequences x 2 kv heads x group 4
    new_kv = torch.randn(2, 2, 2, dim, device="cuda")
    cpu_plane = plane.cpu()
    out, lse = entry_decode(q, plane[0], plane[1], tables, lengths, page, new_kv=new_kv,
                            new_index=new_index)  # fmt: skip
    ref, ref_lse = entry_decode(q.cpu(), cpu_plane[0], cpu_plane[1], tables.cpu(), lengths.cpu(),
                                page, new_kv=new_kv.cpu(), new_index=new_index.cpu(),
                                reference=True)  # fmt: skip
    torch.testing.assert_close(plane.cpu(), cpu_plane)  # the same slots, none for the empty row
    slot = int(tables[0, 0]) * page + 7
    torch.testing.assert_close(plane[0, slot], new_kv[0, 0, 0])
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-4, rtol=1e-4)
