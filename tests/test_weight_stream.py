"""Decoder layers streamed from host memory (FlexAttn's CPIP), on the CPU twin: the model's
outputs equal the resident model's exactly; each layer's successor is in its slot before the
layer attends; the next pass's first layers are fetched as a pass ends; the host copy is
the only one; and the planner's arithmetic of streamed weights."""

from __future__ import annotations

import json

import pytest
import torch

from headspace.api import LLM
from headspace.engine.config import EngineConfig
from headspace.engine.sampling import SamplingParams
from headspace.engine.weight_stream import WeightStream, device_weight_bytes
from headspace.errors import UserError
from headspace.kv.spec import GiB
from headspace.model.config import config_from_dict
from headspace.model.llama import LlamaModel
from headspace.planner import PlanRequest, make_plan
from headspace.planner.memory import (
    Hardware,
    WeightSpec,
    prefill_chunk,
    streams_weights,
    weight_bytes,
)
from test_planner import LLAMA3_8B
from test_shard import dense_attention

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
          "intermediate_size": 90, "num_hidden_layers": 5, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
          "attention_bias": True}  # fmt: skip


def _model(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(config_from_dict(CONFIG)).float().eval()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return model


def _forward(model: LlamaModel, ids: torch.Tensor, attention=dense_attention) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, torch.arange(len(ids)), attention)


@pytest.mark.parametrize("depth", [1, 2, 3, 8])
def test_streamed_layers_equal_resident_ones_over_passes(depth):
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    model = _model()
    resident, prefix = _forward(model, ids), _forward(model, ids[:7])
    stream = WeightStream(model, "cpu", depth)
    assert stream.depth == min(depth, 5)
    for _ in range(3):  # passes after the first find their first layers already fetched
        assert torch.equal(_forward(model, ids), resident)
    assert torch.equal(_forward(model, ids[:7]), prefix)


@pytest.mark.parametrize("depth", [2, 3])
def test_each_layer_attends_with_its_successors_already_in_their_slots(depth):
    model = _model()
    stream = WeightStream(model, "cpu", depth)
    seen = []

    def attention(layer, q, kv):
        seen.append((layer, list(stream._holds)))
        for ahead in range(min(depth, 5 - layer)):  # this layer and the next ones, fetched
            index = layer + ahead
            slot = stream.slots[index % depth, : stream.host[index].numel()]
            assert stream._holds[index % depth] == index
            assert torch.equal(slot, stream.host[index])
        return dense_attention(layer, q, kv)

    _forward(model, torch.arange(9), attention)
    assert [layer for layer, _ in seen] == list(range(5))
    assert stream._holds == list(range(depth))  # the next pass's first layers, fetched


def test_the_delay_hook_comes_before_each_copy_and_each_layer():
    """``delay("copy", i)`` just before layer i's copy into its slot (each layer once a pass,
    the next pass's first layers as a pass ends), ``delay("layer", i)`` just before layer i
    computes, once per layer per pass; the outputs stay the resident ones."""
    ids = torch.arange(9)
    model = _model()
    resident = _forward(model, ids)
    calls, layers = [], []

    def delay(what: str, index: int) -> None:
        calls.append((what, index))
        if what == "layer":  # its own copy has landed: the slot holds it
            assert stream._holds[index % 2] == index

    def attention(layer, q, kv):
        layers.append(layer)
        return dense_attention(layer, q, kv)

    stream = WeightStream(model, "cpu", 2, delay=delay)
    assert calls == []  # nothing copied before the first pass
    assert torch.equal(_forward(model, ids), resident)
    assert calls == [("copy", 0), ("copy", 1), ("layer", 0), ("copy", 2), ("layer", 1),
                     ("copy", 3), ("layer", 2), ("copy", 4), ("layer", 3), ("layer", 4),
                     ("copy", 0), ("copy", 1)]  # fmt: skip
    calls.clear()
    for _ in range(2):
        assert torch.equal(_forward(model, ids, attention), resident)
    assert [i for what, i in calls if what == "layer"] == layers == list(range(5)) * 2
    assert sorted(i for what, i in calls if what == "copy") == sorted(list(range(5)) * 2)


def test_the_engine_hands_the_delay_hook_to_its_stream(bias_llama, prompt):
    from headspace.engine.hooks import EngineHooks

    calls = []
    hooks = EngineHooks(weight_delay=lambda what, index: calls.append((what, index)))
    llm = LLM(str(bias_llama), weights="stream", prefill_chunk=64, page_size=16, hooks=hooks)
    assert llm.engine.model.layer_source.delay is hooks.weight_delay
    llm.generate(prompt[:40], SamplingParams(max_new_tokens=3, ignore_eos=True))
    layers = [index for what, index in calls if what == "layer"]
    num_layers = llm.engine.model.config.num_layers
    assert layers == list(range(num_layers)) * (len(layers) // num_layers) and len(layers) >= 3
    assert {index for what, index in calls if what == "copy"} == set(range(num_layers))


def test_the_host_copy_is_the_only_copy_of_a_streamed_layer():
    model = _model()
    layer_bytes = sum(p.nbytes for p in model.layers[0].parameters())
    others = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("layers."))
    stream = WeightStream(model, "cpu")
    for layer, flat in zip(model.layers, stream.host, strict=True):
        start, end = flat.data_ptr(), flat.data_ptr() + flat.nbytes
        for param in layer.parameters():  # views into the flat host buffer
            assert start <= param.data_ptr() < end
            assert (param.data_ptr() - start) % 256 == 0  # aligned GEMM operands
    for index, (layer, stand_in) in enumerate(zip(model.layers, stream.layers, strict=True)):
        slot = stream.slots[index % 2]  # each stand-in's views lie in its own slot
        start, end = slot.data_ptr(), slot.data_ptr() + slot.nbytes
        for param, view in zip(layer.parameters(), stand_in.parameters(), strict=True):
            assert view.shape == param.shape and start <= view.data_ptr() < end
            assert (view.data_ptr() - stream.slots.data_ptr()) % 256 == 0
    assert device_weight_bytes(model) == others + stream.slots.nbytes
    assert stream.slots.shape[0] == 2 and stream.slots.nbytes < 3 * layer_bytes
    with pytest.raises(UserError, match="already stream for another engine"):
        WeightStream(model, "cpu")


def test_the_loader_keeps_layers_where_asked_after_keep(embedded_dir):
    from headspace.model.loader import load_model

    kept = []
    model = load_model(embedded_dir, "cpu", torch.float32,
                       keep=lambda i, layer: kept.append(i), layer_device="meta")  # fmt: skip
    assert kept == list(range(model.config.num_layers))  # each layer, once, in order
    assert all(p.device.type == "meta" for p in model.layers.parameters())
    assert model.embed_tokens.weight.device.type == "cpu" and model.norm.weight.is_meta is False


@pytest.fixture(scope="module")
def bias_llama(tmp_path_factory, embedded_dir):
    from conftest import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("stream-tiny")
    make_tiny_checkpoint("llama-bias-mqa", path, embedded_dir)  # 3 layers: slots wrap
    return path


@pytest.mark.parametrize(
    "options", [{}, {"kv_budget": 0.5}, {"offload": "layer", "num_kv_pages": 4}]
)
def test_engine_with_streamed_weights_equals_resident(bias_llama, prompt, options):
    base = {"prefill_chunk": 64, "page_size": 16, **options}
    results = {}
    for weights in ("gpu", "stream"):
        llm = LLM(str(bias_llama), weights=weights, **base)
        streamed = isinstance(llm.engine.model.layer_source, WeightStream)
        assert streamed == (weights == "stream")
        logits = llm.logits(prompt, decode_tokens=6)
        tokens = llm.generate([prompt, prompt[:40]],
                              SamplingParams(max_new_tokens=8, ignore_eos=True))  # fmt: skip
        results[weights] = logits, [out.token_ids for out in tokens]
    assert torch.equal(results["stream"][0], results["gpu"][0])
    assert results["stream"][1] == results["gpu"][1]


def test_a_bad_weights_option_is_one_line_with_exit_code_2(capsys):
    from headspace.cli.main import main

    with pytest.raises(UserError, match="weights must be one of auto, gpu, stream, got 'disk'"):
        EngineConfig.of(weights="disk")
    assert main(["generate", "--prompt", "x", "--weights", "disk"]) == 2
    assert "invalid choice: 'disk'" in capsys.readouterr().err


# -- the planner's arithmetic ----------------------------------------------------------------
def test_weight_spec_counts_the_layers_once_and_the_slots_on_the_gpu():
    config = config_from_dict(LLAMA3_8B)
    resident, streamed = WeightSpec.of(config, 2), WeightSpec.of(config, 2, streamed=True)
    assert resident.gpu_bytes == weight_bytes(config, 2) and resident.host_bytes == 0
    assert (
        streamed.host_bytes
        == 32 * streamed.layer_bytes
        == weight_bytes(config, 2) - (streamed.other_bytes)
    )
    assert streamed.gpu_bytes == streamed.other_bytes + 2 * streamed.layer_bytes
    halves = WeightSpec.of(config, 2, streamed=True, world=2)
    norms = 2 * 4096 * 2  # both norms whole on every rank; the rest halved
    assert halves.layer_bytes == (streamed.layer_bytes - norms) // 2 + norms


def test_auto_streams_exactly_when_resident_weights_leave_no_room():
    config = config_from_dict(LLAMA3_8B)
    weights = weight_bytes(config, 2)
    assert not streams_weights("auto", config, None, 2)  # no budget (the CPU): resident
    assert streams_weights("stream", config, None, 2) and not streams_weights(
        "gpu", config, 4 * GiB, 2
    )
    assert streams_weights("auto", config, weights, 2)  # the weights alone fill it
    assert not streams_weights("auto", config, weights + 2 * GiB, 2)
    assert streams_weights("auto", config, weights // 2, 2)
    assert not streams_weights("auto", config, weights // 2 + 2 * GiB, 2, world=2)  # halves
    assert streams_weights("auto", config, weights // 2 + 2 * GiB, 2, world=2, kv_heads=8)
    room = weights + 2 * GiB  # a 32K chunk's working memory does not fit beside the weights
    assert not streams_weights("auto", config, room, 2) and streams_weights(
        "auto", config, room, 2, chunk=32768
    )


def test_streamed_weights_raise_the_chunk_to_hide_each_layers_copy():
    config, hw = config_from_dict(LLAMA3_8B), Hardware()
    resident = prefill_chunk(config, 9 * GiB, 131072, 2, hw)
    streamed = prefill_chunk(config, 9 * GiB, 131072, 2, hw, streamed=True)
    assert resident < streamed == 16384  # 2 FLOPs a weight a token hide its copy
    assert 2 * streamed / hw.gemm_flops >= 2 / hw.h2d_bytes  # per weight: compute >= copy


def test_plan_prices_streamed_weights_on_pcie_per_step_and_per_chunk():
    config, hw = config_from_dict(LLAMA3_8B), Hardware()
    plan = make_plan(config, PlanRequest(32768, 12 * GiB, 64 * GiB))  # 15 GiB of weights
    streamed = WeightSpec.of(config, 2, streamed=True)
    assert plan.memory["weights"] == streamed.gpu_bytes
    assert plan.memory["weights_host"] == streamed.host_bytes
    floor_ms = 1000 * streamed.host_bytes / hw.h2d_bytes
    assert plan.decode_ms >= floor_ms and plan.decode_pcie_floor_ms >= floor_ms
    chunks = 32768 // plan.prefill_chunk
    assert plan.prefill_tok_s <= 32768 / (chunks * streamed.host_bytes / hw.h2d_bytes)
    roomy = make_plan(config, PlanRequest(32768, 60 * GiB, 64 * GiB, weights="stream"))
    resident = make_plan(config, PlanRequest(32768, 60 * GiB, 64 * GiB))
    assert roomy.memory["weights_host"] > 0 == resident.memory["weights_host"]
    assert roomy.decode_ms > 10 * resident.decode_ms  # PCIe, not HBM, carries the weights
    with pytest.raises(UserError, match="GPU budget too small"):
        make_plan(config, PlanRequest(32768, 12 * GiB, 64 * GiB, weights="gpu"))


def test_plan_cli_says_the_layers_stream_and_counts_them_in_host_memory(capsys, tmp_path):
    from headspace.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["plan", "--model", str(tmp_path), "--context", "32K", "--gpu-memory", "12GiB",
            "--host-memory", "64GiB"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "weights: decoder layers streamed from pinned host memory" in out
    assert "416.0 MiB a layer; asked: auto" in out
    host = WeightSpec.of(config_from_dict(LLAMA3_8B), 2, streamed=True).host_bytes
    row = next(line for line in out.splitlines() if line.startswith("weights "))
    assert row.split()[-1] == f"{host / GiB:.2f}"  # the weights row's host column
    assert main([*args, "--weights", "gpu"]) == 2
    assert "GPU budget too small" in capsys.readouterr().err
