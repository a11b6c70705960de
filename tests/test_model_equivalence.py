"""The lean decoder equals transformers on tiny random checkpoints of every family."""

from __future__ import annotations

import pytest
import torch

from headspace import LLM, SamplingParams

NUM_GREEDY_STEPS = 64


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, 40000, (150,), generator=generator).tolist()


def test_logits_match_transformers(tiny, prompt_ids):
    family, path, hf_model = tiny
    llm = LLM(str(path), device="cpu", dtype="float32")
    ours = llm.logits(prompt_ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4, family


def test_greedy_tokens_match_transformers(tiny, prompt_ids):
    family, path, hf_model = tiny
    llm = LLM(str(path), device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=NUM_GREEDY_STEPS, ignore_eos=True)
    ours = llm.generate(prompt_ids[:40], params)[0].token_ids
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([prompt_ids[:40]]),
            max_new_tokens=NUM_GREEDY_STEPS,
            min_new_tokens=NUM_GREEDY_STEPS,
            do_sample=False,
        )[0, 40:].tolist()
    assert ours == theirs, family


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(tiny, prompt_ids, chunk):
    family, path, _ = tiny
    whole = LLM(str(path), prefill_chunk=len(prompt_ids)).logits(prompt_ids)
    chunked = LLM(str(path), prefill_chunk=chunk).logits(prompt_ids)
    assert (whole - chunked).abs().max().item() <= 1e-5, family


def test_reference_backend_equals_sdpa_backend(tiny, prompt_ids):
    _, path, _ = tiny
    fast = LLM(str(path), prefill_chunk=32).logits(prompt_ids)
    reference = LLM(str(path), prefill_chunk=32, attention_backend="reference").logits(prompt_ids)
    assert (fast - reference).abs().max().item() <= 1e-5


def _causal_attention(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The model's attention callback over the prompt alone, by the fp32 reference: ``q
    [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` -> ``[tokens, heads, dim]``."""
    from headspace.attention import reference_attention

    out, _ = reference_attention(q.transpose(0, 1), kv[0].transpose(0, 1),
                                 kv[1].transpose(0, 1), causal=True)  # fmt: skip
    return out.transpose(0, 1).to(q.dtype)


def test_layers_run_a_few_at_a_time_equal_the_whole_pass(tiny, prompt_ids):
    """The decoder run in slices of layers, each from the states the slice before returned
    (a prefill chunk spread over steps), gives exactly the whole pass's states; only the
    last slice is final-normed."""
    family, path, _ = tiny
    model = LLM(str(path), device="cpu", dtype="float32").engine.model
    ids, positions = torch.tensor(prompt_ids), torch.arange(len(prompt_ids))
    attention = _causal_attention

    with torch.inference_mode():
        whole = model(ids, positions, attention)
        num_layers, hidden = len(model.layers), None
        bounds = [0, 1, num_layers - 1, num_layers] if num_layers > 2 else [0, 1, num_layers]
        for first, end in zip(bounds, bounds[1:], strict=False):
            hidden = model(ids, positions, attention, layers=(first, end), hidden=hidden)
            if end < num_layers:  # the stream and the last layer's MLP output, apart
                stream, pending = hidden
                assert stream.shape == pending.shape == whole.shape
                assert not torch.equal(model.norm(stream + pending), whole)
    assert torch.equal(hidden, whole), family


def test_a_layer_leaves_its_mlp_output_for_the_next_layers_norm_to_add(tiny, prompt_ids):
    """A decoder layer returns the residual stream after its attention and its MLP's output
    apart (the next layer adds them in its norm's kernel, so the down projection writes no
    copy of the stream); a pending output given to a layer is added before its norm."""
    import torch.nn.functional as F

    from headspace.model.rope import rope_cos_sin

    family, path, _ = tiny
    model = LLM(str(path), device="cpu", dtype="float32").engine.model
    layer, seen = model.layers[1], []

    def attention(layer_idx, q, kv):  # the reference, its output kept
        seen.append(_causal_attention(layer_idx, q, kv))
        return seen[-1]

    generator = torch.Generator().manual_seed(3)
    num_tokens, hidden_size = len(prompt_ids), model.config.hidden_size
    x, pending = (torch.randn(num_tokens, hidden_size, generator=generator) for _ in range(2))
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(num_tokens), x.dtype)
    with torch.inference_mode():
        stream, out = layer(1, x, cos, sin, attention)
        attn_out = layer.o_proj(seen[-1].reshape(num_tokens, -1))
        assert torch.equal(stream, x + attn_out), family
        gate, up = layer.gate_up_proj(layer.post_attention_norm(stream)).chunk(2, -1)
        assert torch.equal(out, layer.down_proj(F.silu(gate) * up)), family
        added = layer(1, x, cos, sin, attention, pending=pending)
        assert all(map(torch.equal, added, layer(1, x + pending, cos, sin, attention)))
        assert not torch.equal(added[0], stream)


def test_tuned_blocks_take_only_options_this_torch_knows():
    """The decode step's "tuned" blocks: torch.compile rejects an option it does not know
    when the block is made; max-autotune on, Inductor's own graphs off (the engine captures
    its own), and its tables of timed choices kept off stderr where this torch has them."""
    import torch._inductor.config as inductor_config

    from headspace.model.llama import QUIET_OPTIONS, Blocks, qkv_block, tuned_options

    blocks = Blocks("tuned")
    assert blocks.qkv is not qkv_block  # compiled
    options = tuned_options()
    assert options["max_autotune"] and options["triton.cudagraphs"] is False
    known = [k for k in QUIET_OPTIONS if hasattr(inductor_config, k)]
    assert known and all(options[k] == QUIET_OPTIONS[k] for k in known)


def test_rows_blocks_compile_once_for_every_batch_past_one():
    """The decode step's blocks with symbolic rows ("rows"): one compile for a single row and one
    for every count past it (2 to 32 rows), each equal to the eager block; with the count
    fixed, one compile per count."""
    from torch._dynamo.testing import CompileCounter

    from headspace.model.llama import QKV_ROW_ARGS, _compiled, qkv_block

    hidden, heads, kv_heads, dim = 32, 4, 2, 8
    weights = (torch.ones(hidden), 1e-6,
               torch.randn((heads + 2 * kv_heads) * dim, hidden) / hidden**0.5, None)  # fmt: skip
    rows_seen = (1, 2, 4, 8, 32, 3)
    for row_args, compiles in ((QKV_ROW_ARGS, 2), ((), len(rows_seen))):
        torch._dynamo.reset()
        counter = CompileCounter()
        block = _compiled(qkv_block, {"backend": counter, "fullgraph": True, "dynamic": False},
                          row_args)  # fmt: skip
        for rows in rows_seen:
            x, pending = torch.randn(rows, hidden), torch.randn(rows, hidden)
            cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
            args = (x, pending, *weights, cos, sin, (heads, kv_heads, dim))
            for got, want in zip(block(*args), qkv_block(*args), strict=True):
                torch.testing.assert_close(got, want)
        assert counter.frame_count == compiles


def test_blocks_not_tuned_choose_their_kernels_by_rule(monkeypatch):
    """The compiled blocks other than the tuned ones ask Inductor for its deterministic mode
    (a configuration that changes a kernel's sums is chosen by rule, not timed), per compile;
    the tuned ones time their choices; a user's TORCHINDUCTOR_DETERMINISTIC is left to rule."""
    import torch._inductor.config as inductor_config

    from headspace.model.llama import ruled_options, tuned_options

    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    assert ruled_options() == ({"deterministic": True}
                               if hasattr(inductor_config, "deterministic") else {})  # fmt: skip
    assert "deterministic" not in tuned_options()
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", "0")
    assert ruled_options() == {}
