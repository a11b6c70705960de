"""Shared fixtures: tiny random checkpoints of each supported family, the embedded model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # run Triton kernels on CPU tensors through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # workers share the cores, a part each
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

from headspace.model.source import resolve_model_dir  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "llama-bias-mqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1},
    ),
    "llama-mha-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 8,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The embedded SmolLM2 checkpoint directory (converted at set-up)."""
    return resolve_model_dir(None)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.08 * noise)


def make_tiny_checkpoint(family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0,
                         **overrides):  # fmt: skip
    """Save a random tiny HF model of ``family`` (embedded tokenizer); returns the HF model.
    ``overrides`` change config fields (e.g. more layers)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    vocab = transformers.AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size
    fields = {**TINY, "vocab_size": vocab, **extra, **overrides}
    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return model


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny(request, tmp_path_factory, embedded_dir):
    """(family, checkpoint dir, transformers model) for each supported family."""
    out_dir = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = make_tiny_checkpoint(request.param, out_dir, embedded_dir)
    return request.param, out_dir, model


# the tiers' tests share these (test_offload, test_hybrid)
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("offload-tiny")
    make_tiny_checkpoint("llama3", path, embedded_dir)
    return path


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(3, 40000, (150,), generator=generator).tolist()


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, embedded_dir):
    """8 layers x 4 kv heads: 32 entries, so one streamed head is a small part of the KV."""
    path = tmp_path_factory.mktemp("offload-wide")
    make_tiny_checkpoint("llama3", path, embedded_dir, num_hidden_layers=8,
                         num_key_value_heads=4)  # fmt: skip
    return path


@pytest.fixture
def cpu_timings():
    """An empty record of the hybrid tier's CPU side, for a test to give its engine as
    ``EngineHooks(cpu_timings=...)`` and read back: each kernel call and background job in
    ``calls`` (:class:`headspace.tiers.cpu_timings.CpuCall`: tokens, kv heads, page size)."""
    from headspace.tiers.cpu_timings import CpuTimings

    return CpuTimings()


def random_profile(path: Path, num_layers: int, num_kv_heads: int, seed: int) -> str:
    """A profile of random retrieval scores for a model's (layer, kv head) entries, saved
    to ``path``; its path."""
    from headspace.planner.profile import Profile

    scores = torch.rand(num_layers, num_kv_heads, generator=torch.Generator().manual_seed(seed))
    Profile("random", num_layers, num_kv_heads, scores.tolist()).save(path)
    return str(path)


def ran_in(llm, output=None):
    """The lane ``output`` (default: ``llm``'s last) ran in (a test's look at a runner)."""
    output = output or llm.last_output
    return llm.engine.lanes.lane(output.stats.lane)


def plan_of(llm, output=None):
    """The layout the lane of ``output`` (default: ``llm``'s last; without one, the engine's
    first lane) ran under."""
    output = output or llm.last_output
    load = llm.engine.load()
    return (load.lanes[0] if output is None else load.lane(output.stats.lane)).plan


def pools_back(engine) -> bool:
    """Every lane's GPU and host pages back in their pools."""
    return all(lane.gpu_pages_used == lane.host_pages_used == 0 for lane in engine.load().lanes)


@pytest.fixture(scope="module")
def tiny_cpu_llm(tiny_llama):
    """The engine over ``tiny_llama`` on the CPU, default options."""
    from headspace import LLM

    return LLM(str(tiny_llama), device="cpu")


@pytest.fixture(scope="module")
def tiny_hf_model(tiny_llama):
    """transformers' model of ``tiny_llama`` (fp32), the reference of sampling's tests."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).float().eval()
