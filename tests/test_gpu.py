"""GPU paths against their CPU reference twins (run on a GPU machine; CI has none)."""

from __future__ import annotations

import pytest
import torch

from headspace.attention import attend, reference_attention
from headspace.engine.config import EngineConfig
from headspace.engine.paged_runner import PagedRunner
from headspace.engine.scheduler import Sequence
from headspace.model.config import config_from_dict
from headspace.model.loader import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("heads,kv_heads,length", [(32, 8, 8191), (9, 3, 1000), (8, 8, 33)])
def test_triton_decode_matches_reference(heads, kv_heads, length):
    from headspace.attention.triton_decode import triton_decode_attention

    q = torch.randn(heads, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(kv_heads, length + 700, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, lse = triton_decode_attention(q, k, v, torch.tensor([length], device="cuda"))
    ref_out, ref_lse = reference_attention(q, k[:, :length], v[:, :length])
    assert _rel(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max().item() < 1e-2


@pytest.mark.parametrize("num_q,num_kv", [(1000, 1000), (300, 1300), (77, 77)])
def test_sdpa_gpu_matches_reference(num_q, num_kv):
    q = torch.randn(32, num_q, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, num_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for causal in (False, True):
        out, lse = attend(q, k, v, causal=causal)
        ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
        assert _rel(out, ref_out) < 1e-2
        assert (lse - ref_lse).abs().max().item() < 2e-2


def _tiny_model(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    state = LlamaForCausalLM(hf_config).state_dict()
    state = {k: (v + 0.02 * torch.randn_like(v)) for k, v in state.items()}
    return build_model(config_from_dict(hf_config.to_dict()), state.__getitem__, device, dtype)


def _runner(model, **options) -> PagedRunner:
    config = EngineConfig(device=str(model.lm_head.weight.device), page_size=64, **options)
    return PagedRunner(model, config, num_pages=64, page_size=64)


def _greedy(runner: PagedRunner, prompt: torch.Tensor, steps: int, chunk: int = 256) -> list[int]:
    seq = Sequence(0, prompt.tolist(), len(prompt) + steps)
    runner.blocks.allocate_prompt(0, seq.prompt_ids, reuse=False)
    logits = runner.prefill(seq, chunk)
    for _ in range(steps):
        seq.output_ids.append(int(logits.argmax()))
        logits = runner.decode([seq])[0]
    runner.blocks.free(0)
    return seq.output_ids


def _all_logits(runner: PagedRunner, prompt: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    seq = Sequence(1, prompt.tolist(), len(prompt))
    runner.blocks.allocate_prompt(1, seq.prompt_ids, reuse=False)
    logits = runner.prefill(seq, chunk, all_logits=True)
    runner.blocks.free(1)
    return logits


def test_gpu_engine_matches_cpu_reference():
    prompt = torch.randint(0, 512, (700,), generator=torch.Generator().manual_seed(1))
    cpu = _runner(_tiny_model("cpu", torch.float32))
    ref_logits = _all_logits(cpu, prompt)
    gpu = _runner(_tiny_model("cuda", torch.float32), dtype="float32")
    assert (_all_logits(gpu, prompt) - ref_logits).abs().max().item() < 1e-3
    assert _greedy(gpu, prompt, 64) == _greedy(cpu, prompt, 64)
    bf16_logits = _all_logits(_runner(_tiny_model("cuda", torch.bfloat16)), prompt)
    assert (bf16_logits - ref_logits).abs().max().item() <= 2e-2 * ref_logits.abs().max().item()


def test_graph_decode_equals_eager_decode():
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(2))
    model = _tiny_model("cuda", torch.bfloat16)
    graphed = _runner(model)
    eager = _runner(model, cuda_graph=False, compile=False)
    assert _greedy(graphed, prompt, 64) == _greedy(eager, prompt, 64)


def test_paged_paths_on_gpu_match_reference():
    from headspace.attention.paged import flex_paged_attention, physical_block_mask
    from headspace.attention.triton_decode import paged_decode_attention

    page, num_pages, seq_lens = 128, 40, [700, 129, 2000]
    pool = torch.randn(2, 8, num_pages * page, 128, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_pages).tolist()
    tables = torch.zeros(3, 16, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // page)):
            tables[b, j] = order.pop()
    tables, lens = tables.cuda(), torch.tensor(seq_lens, device="cuda")

    def dense(b):
        pos = torch.arange(seq_lens[b], device="cuda")
        slots = tables[b].long()[pos // page] * page + pos % page
        return pool[0][:, slots], pool[1][:, slots]

    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    out, _ = paged_decode_attention(q[:, :, 0], pool[0], pool[1], tables, lens, page)
    ones = torch.ones_like(lens)
    mask = physical_block_mask(tables, lens - 1, ones, lens, 1, num_pages * page, page)
    flex_out, _ = flex_paged_attention(q, pool[0], pool[1], mask)
    for b in range(3):
        ref, _ = reference_attention(q[b], *dense(b))
        assert _rel(out[b], ref[:, 0]) < 1e-2
        assert _rel(flex_out[b], ref) < 1e-2


def test_paged_batch_on_gpu_equals_one_at_a_time():
    from types import SimpleNamespace

    from headspace.engine.batch import BatchGenerator
    from headspace.engine.sampling import SamplingParams

    model = _tiny_model("cuda", torch.float32)
    config = EngineConfig(device="cuda", dtype="float32", page_size=64, num_kv_pages=64)

    class NoText:
        def decode(self, ids, **_):
            return ""

    engine = SimpleNamespace(config=config, model=model, tokenizer=NoText(), max_context=4096,
                             eos_token_ids=set(), check_length=lambda n: None)  # fmt: skip
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (30, 300, 129, 700)]
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * 4
    batched = [o.token_ids for o in BatchGenerator(engine).run(prompts, params)]
    single = _runner(model, dtype="float32")
    assert batched == [_greedy(single, torch.tensor(p), 32) for p in prompts]


def test_streamed_heads_on_gpu_equal_resident():
    """Copy stream, write-back stream and double-buffered staging against the resident run."""
    from headspace.planner.head_map import HeadEntry, HeadMap

    model = _tiny_model("cuda", torch.float32)
    entries = [HeadEntry(layer, head, tier="stream" if (layer + head) % 2 else "gpu",
                         group=0) for layer in range(4) for head in range(2)]  # fmt: skip
    entries[0] = HeadEntry(0, 0, tier="stream", group=0)  # layer 0: both heads streamed
    entries[1] = HeadEntry(0, 1, tier="stream", group=1)
    head_map = HeadMap(4, 2, entries)
    config = EngineConfig(device="cuda", dtype="float32", page_size=64)
    streamed = PagedRunner(model, config, num_pages=64, page_size=64, head_map=head_map)
    resident = _runner(model, dtype="float32", cuda_graph=False)
    prompt = torch.randint(0, 512, (700,), generator=torch.Generator().manual_seed(3))
    gap = _all_logits(streamed, prompt, chunk=128) - _all_logits(resident, prompt, chunk=128)
    assert gap.abs().max().item() < 1e-3
    assert _greedy(streamed, prompt, 48, chunk=128) == _greedy(resident, prompt, 48, chunk=128)


def test_host_store_is_page_locked_at_its_exact_size():
    """One registered buffer, not power-of-two pinned blocks; async copies round-trip."""
    from headspace.kv.host_store import HostKVStore

    streamed = [(0, 1), (2, 0), (3, 1)]
    host = HostKVStore(streamed, 1000, 64, dtype=torch.bfloat16, pin=True)
    assert host.data.is_pinned() and host.num_bytes == 3 * 2 * 1000 * 64 * 2
    k, v = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16)
    host.write(2, 0, 100, k, v, non_blocking=True)
    torch.cuda.synchronize()
    back_k, back_v = host.read(2, 0, 400)
    assert torch.equal(back_k[100:].cuda(non_blocking=True), k)
    assert torch.equal(back_v[100:].cuda(non_blocking=True), v)
    assert back_k[:100].abs().sum().item() == 0 and host.entry(0, 1).abs().sum().item() == 0
