"""Streaming heads at decode: a profile's least-retrieving heads keep only their sink and
window tokens, in ring entries that overwrite their oldest window token. The engine's decode
equals an independent dense model whose streaming heads are masked to sink + window."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_of
from headspace import SamplingParams, UserError
from headspace.kv.entry_table import EntryBlockManager
from headspace.planner.profile import Profile
from test_hybrid import decode_logits
from test_offload import _prompts, make


def test_a_ring_entry_stops_growing_and_overwrites_its_oldest_window_token():
    blocks = EntryBlockManager(4, 20, 2)
    blocks.allocate_prompt(0, list(range(10)))  # 2 entries x 3 pages
    blocks.compress(0, [6, 10], rings={0: (2, 4)})  # entry 0: 2 sink + 4 window tokens
    lists = blocks.entries[0]
    assert lists.lengths == [6, 10] and lists.newest == [5, 9]
    assert blocks.pool.num_free == 20 - 2 - 3
    assert blocks.future_pages(0, 10 + 7) == 0 + 2  # the ring stays at 6 tokens, entry 1: 17
    written = []
    for _ in range(9):
        blocks.append_token(0)
        written.append(lists.newest[0])
    assert written == [2, 3, 4, 5, 2, 3, 4, 5, 2]  # over the window, oldest first
    assert lists.lengths == [6, 19] and [len(p) for p in lists.pages] == [2, 5]
    assert blocks.pages_needed(0) == 0  # entry 1 has room, the ring needs none
    with pytest.raises(ValueError, match="ring"):
        blocks.compress(0, [7, 19], rings={0: (2, 4)})


def _profile(path, llm, seed=0) -> str:
    """A profile of random retrieval scores for ``llm``'s model shape."""
    config = llm.engine.model.config
    scores = torch.rand(config.num_layers, config.num_kv_heads,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
    Profile("tiny", config.num_layers, config.num_kv_heads, scores.tolist()).save(path)
    return str(path)


def _masked_logits(llm, tokens: list[int], rings: dict) -> torch.Tensor:
    """fp32 logits ``[tokens, vocab]`` of the model over ``tokens`` in one pass: every head
    attends causally, except that the heads of ``rings`` ``{(layer, kv_head): (sink,
    window)}`` see only keys ``< sink`` or within ``window`` (prompt and decode alike)."""
    model = llm.engine.model
    positions = torch.arange(len(tokens))
    causal = positions[None, :] <= positions[:, None]  # [queries, keys]

    def attention(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, dim = q.shape
        group = num_heads // kv.shape[2]
        mask = causal.expand(num_heads, -1, -1).clone()  # [heads, queries, keys]
        for (ring_layer, kv_head), (sink, window) in rings.items():
            if ring_layer == layer:
                near = (positions[None, :] < sink) | (positions[:, None] - positions[None] < window)
                mask[kv_head * group : (kv_head + 1) * group] &= near
        k, v = (x.transpose(0, 1).repeat_interleave(group, 0).double() for x in kv)
        logits = q.transpose(0, 1).double() @ k.transpose(1, 2) * dim**-0.5
        weights = logits.masked_fill(~mask, float("-inf")).softmax(-1)
        return (weights @ v).transpose(0, 1).to(q.dtype)

    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), positions, attention)
        return model.logits(hidden)


def test_streaming_decode_equals_a_dense_model_masked_to_sink_and_window(tiny_llama, tmp_path):
    prompt, steps = _prompts([150], seed=4)[0], 40
    exact = make(tiny_llama)
    profile = _profile(tmp_path / "profile.json", exact)
    llm = make(tiny_llama, profile=profile, retrieval_heads=0.5, sparse_pattern="streaming(4,24)")
    out = llm.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True))[0]
    head_map = plan_of(llm).head_map
    rings = {(e.layer, e.kv_head): (4, 24) for e in head_map.entries if e.pattern != "full"}
    assert len(rings) == len(head_map.entries) // 2
    assert {e.budget for e in head_map.entries if e.pattern != "full"} == {28}  # sink + window
    assert {e.budget for e in head_map.entries if e.pattern == "full"} == {None}
    scores = Profile.load(profile).retrieval
    assert min(scores[layer][head] for layer, head in rings) < max(
        scores[e.layer][e.kv_head] for e in head_map.entries if e.pattern == "full"
    )
    got = decode_logits(llm, prompt, steps)
    want = _masked_logits(llm, prompt + out.token_ids[:-1], rings)
    torch.testing.assert_close(got, want[len(prompt) :], atol=1e-4, rtol=1e-4)
    # the ring wrapped (40 tokens past a 24-token window) and changed the output
    full = _masked_logits(llm, prompt + out.token_ids[:-1], {})
    assert (full[len(prompt) :] - want[len(prompt) :]).abs().max() > 1e-2
    num_entries, total = len(head_map.entries), len(prompt) + steps - 1
    held = (num_entries // 2 * total + len(rings) * 28) / (num_entries * total)
    assert out.stats.kv_held_fraction == pytest.approx(held)


def test_streaming_heads_wider_than_the_sequence_equal_the_exact_run(tiny_llama, tmp_path):
    prompt = _prompts([150], seed=2)[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    exact = make(tiny_llama)
    streaming = make(tiny_llama, profile=_profile(tmp_path / "p.json", exact),
                     retrieval_heads=0.25, sparse_pattern="streaming(4,500)")  # fmt: skip
    assert (
        streaming.generate(prompt, params)[0].token_ids
        == exact.generate(prompt, params)[0].token_ids
    )
    gap = decode_logits(streaming, prompt, 12) - decode_logits(exact, prompt, 12)
    assert gap.abs().max().item() < 1e-4


def test_streaming_options_fail_in_one_line(tiny_llama, tmp_path):
    profile = str(tmp_path / "p.json")
    Profile("other", 7, 3, [[0.0] * 3] * 7).save(profile)
    for options, message in [({"retrieval_heads": 0.5}, "profile"),
                             ({"retrieval_heads": 1.5, "profile": profile}, r"\[0, 1\]"),
                             ({"sparse_pattern": "full"}, "must be sparse"),
                             ({"sparse_pattern": "streaming(x)"}, "sparse_pattern"),
                             ({"retrieval_heads": 0.5, "profile": profile}, "7 layers"),
                             ({"retrieval_heads": 0.5, "profile": profile, "offload": "layer"},
                              "offload")]:  # fmt: skip
        with pytest.raises(UserError, match=message):
            make(tiny_llama, **options)


def test_eval_compare_streaming_names_the_share_of_retrieval_heads():
    from headspace.cli.eval import _mode_options

    base = {"offload": "auto", "cpu_sparsity": None, "kv_budget": None, "retrieval_heads": 0.5}
    mode = _mode_options("streaming:0.25", base)
    assert (mode["retrieval_heads"], mode["offload"], mode["kv_budget"]) == (0.25, "none", None)
    assert _mode_options("none", base)["retrieval_heads"] is None
    mode = _mode_options("block_sparse:0.5", {**base, "sparse_pattern": "streaming(4,64)"})
    assert (mode["sparse_pattern"], mode["offload"]) == ("block_sparse(64)", "auto")
    mode = _mode_options("vertical_slash:0.5", {**base, "sparse_pattern": "vertical_slash(8,64)"})
    assert (mode["sparse_pattern"], mode["retrieval_heads"]) == ("vertical_slash(8,64)", 0.5)
    with pytest.raises(UserError, match="number"):
        _mode_options("streaming:", base)


def test_entry_decode_stores_ring_rows_at_their_index_and_empty_rows_nowhere():
    from headspace.attention.entry_decode import entry_decode

    torch.manual_seed(8)
    page, dim = 4, 8
    plane = torch.randn(2, 12 * page, dim)
    tables = torch.arange(12).view(4, 3).int()
    lengths = torch.tensor([10, 0, 4, 6], dtype=torch.int32)
    new_index = torch.tensor([2, 0, 3, 5], dtype=torch.int32)  # a ring row writes at 2
    new_kv = torch.randn(2, 2, 2, dim)
    before = plane.clone()
    entry_decode(torch.randn(2, 4, dim), plane[0], plane[1], tables, lengths, page,
                 new_kv=new_kv, new_index=new_index)  # fmt: skip
    written = {0 * page + 2: (0, 0), 6 * page + 3: (1, 0), 10 * page + 1: (1, 1)}  # (seq, head)
    for slot in range(plane.shape[1]):
        want = new_kv[:, *written[slot]] if slot in written else before[:, slot]
        torch.testing.assert_close(plane[:, slot], want)


def test_budgets_and_streaming_heads_combine(tiny_llama, tmp_path):
    """Retrieval heads keep their budget, streaming heads their sink and window."""
    prompt, steps = _prompts([150], seed=6)[0], 10
    exact = make(tiny_llama)
    llm = make(tiny_llama, kv_budget=0.5, profile=_profile(tmp_path / "p.json", exact),
               retrieval_heads=0.5, sparse_pattern="streaming(4,24)")  # fmt: skip
    out = llm.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True))[0]
    num_entries, total = 6, len(prompt) + steps - 1
    held = (3 * (75 + steps - 1) + 3 * 28) / (num_entries * total)  # snapkv: 75 of 150
    assert out.stats.kv_held_fraction == pytest.approx(held)
