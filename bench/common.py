"""Shared pieces of the GPU benchmarks: environment record, timing, random Llama models."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)


def code_version() -> dict:
    """Which code ran: the commit where a git checkout is at hand ("+changes" where the
    sources differ from it: then only the digest names them), and a digest of the
    engine's sources either way (a copy of the working tree may carry no history; the same
    digest of a commit's ``src/headspace`` names it). The sources are the imported
    package's, which ``PYTHONPATH`` may take from another tree than this script's."""
    import hashlib
    import subprocess

    import headspace

    package = Path(headspace.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):  # named as in a checkout, wherever it lies
        name = "src/headspace/" + path.relative_to(package).as_posix()
        digest.update(name.encode() + b"\0" + path.read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=package, text=True,
                                capture_output=True, check=True).stdout.strip()  # fmt: skip
        status = ["git", "status", "--porcelain", "--", "."]
        changed = subprocess.run(status, cwd=package, text=True, capture_output=True,
                                 check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit, changed = None, ""
    if commit and changed:  # sources unlike the commit's (edited, or a copy over an old HEAD)
        commit += "+changes"
    return {"commit": commit, "src_sha256": digest.hexdigest()[:16]}


def environment() -> dict:
    """GPU (None on the CPU), driver-visible versions, the host's cores, the code and the
    date, recorded in every result file."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = {"gpu": None}  # (a CPU run's file says so)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
               "num_sms": props.multi_processor_count}  # fmt: skip
    return {
        **gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "host_cores": os.cpu_count(),
        "code": code_version(),
        "date": datetime.date.today().isoformat(),
    }


def gpu_tag(env: dict) -> str:
    """The GPU's short name in result file names (``h100``, ``h200``)."""
    return env["gpu"].replace("NVIDIA ", "").split()[0].lower()


def cuda_time(fn, *, warmup: int = 1, repeat: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup``, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def graphed(fn):
    """``fn`` captured in a CUDA graph (launch costs out of the kernels' time), after one
    eager call on a side stream: its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_seconds(fn) -> float:
    """Seconds per call of ``fn`` replayed as one CUDA graph (see :func:`graphed`)."""
    return cuda_time(graphed(fn), warmup=3, repeat=20)


def measure_hbm_bandwidth(num_bytes: int = 4 * 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), warmup=3, repeat=10)
    return 2 * num_bytes / seconds


def random_hf_llama(config_dict: dict, dtype=torch.bfloat16):
    """A transformers LlamaForCausalLM with random weights, built directly on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_dict)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def write_result(name: str, result: dict) -> Path:
    """Write ``result`` as JSON to bench/results (and $OUT when set); returns the path."""
    text = json.dumps(result, indent=2)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(text + "\n")
    return path


LLAMA31_8B = {  # Llama-3.1-8B: the same weights' shapes, a 128K trained context
    **LLAMA3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip

LLAMA31_70B = {  # Llama-3.1-70B's shapes: 64 query heads over 8 kv heads, 80 layers
    **LLAMA31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}

QWEN25_7B = {  # Qwen2.5-7B's shapes: 28 query heads over 4 kv heads (one a rank on 4 GPUs)
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

QWEN25_3B = {  # Qwen2.5-3B's shapes: 16 query heads over 2 kv heads (one a rank on 2 GPUs)
    **QWEN25_7B,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}

MODELS = {"llama3-8b": LLAMA31_8B, "llama3-70b": LLAMA31_70B, "qwen2.5-7b": QWEN25_7B,
          "qwen2.5-3b": QWEN25_3B}  # fmt: skip
MODEL_NAMES = {"llama3-8b": "Llama-3.1-8B", "llama3-70b": "Llama-3.1-70B",
               "qwen2.5-7b": "Qwen2.5-7B", "qwen2.5-3b": "Qwen2.5-3B"}  # in results  # fmt: skip


def model_config(name: str, num_layers: int | None = None) -> dict:
    """The config dict of ``MODELS[name]``, cut to its first ``num_layers`` layers if given."""
    config = dict(MODELS[name])
    if num_layers is not None:
        if not 0 < num_layers <= config["num_hidden_layers"]:
            raise SystemExit(f"{name} has {config['num_hidden_layers']} layers, not {num_layers}")
        config["num_hidden_layers"] = num_layers
    return config


def model_tag(name: str, num_layers: int | None = None) -> str:
    """The model's name in result file names: ``llama3-70b-l40`` for 40 of its layers."""
    return name if num_layers is None else f"{name}-l{num_layers}"


class NoText:
    """A tokenizer stand-in for random-weight models: generated text is not looked at."""

    def decode(self, ids, **_):
        return ""


def make_engine(model, hooks=None, **options):
    """The engine over a model built in memory, as ``LLM(...)`` builds it from a checkpoint
    (the model's own context, default options unless given); ``hooks``: the benchmark's
    :class:`headspace.engine.hooks.EngineHooks`, if any."""
    from headspace.engine.config import EngineConfig
    from headspace.engine.engine import Engine

    return Engine.from_model(model, NoText(), EngineConfig.of(device="cuda", **options), hooks)


def prefill_once(engine, ids: list[int]) -> None:
    """One prefill of ``ids`` into fresh pages (no prefix reuse), freed afterwards."""
    from headspace.engine.step_plan import Sequence

    seq = Sequence(10**9, list(ids), len(ids))
    _, lane = engine.lanes.prepare([seq])
    blocks = lane.scheduler.blocks
    blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, lane.scheduler.tiers, reuse=False)
    try:
        lane.runner.prefill(seq, engine.lanes.chunk, blocks.pages([seq.seq_id]))
    finally:
        blocks.free(seq.seq_id)


def random_model(config_dict: dict, device: str = "cuda"):
    """Our decoder with random bf16 weights (std 0.02), built straight on the device."""
    from headspace.model.config import config_from_dict
    from headspace.model.loader import build_model, checkpoint_layout

    config = config_from_dict(config_dict)
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = _hf_shapes(config)

    def tensor(name: str) -> torch.Tensor:
        shape = shapes[name]
        if "norm" in name:
            return torch.ones(shape, dtype=torch.bfloat16, device=device)
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return out.normal_(0.0, 0.02, generator=generator)

    assert set(n for names in checkpoint_layout(config).values() for n in names) <= set(shapes)
    return build_model(config, tensor, device, torch.bfloat16)


def sharpen_heads(model, sharpen: list[float] | None, seed: int = 5) -> None:
    """Scale each (layer, kv head)'s key rows of the fused q/k/v projection by a factor drawn
    log-uniformly from ``sharpen`` (low, high): its attention logits scale alike (RoPE is
    linear), from flatter to sharper than the random weights' own. None: unchanged."""
    if not sharpen:
        return
    cfg = model.config
    low, high = torch.tensor(sharpen, dtype=torch.float64).log().tolist()
    generator = torch.Generator().manual_seed(seed)
    shape = (cfg.num_layers, cfg.num_kv_heads)
    factors = torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        for layer, row in zip(model.layers, factors.exp().tolist(), strict=True):
            keys = layer.qkv_proj.weight[q_size : q_size + kv_size]
            scale = torch.tensor(row, device=keys.device, dtype=keys.dtype)
            keys.view(cfg.num_kv_heads, cfg.head_dim, -1).mul_(scale[:, None, None])
            if layer.qkv_proj.bias is not None:  # the key bias scales alike (Qwen2's)
                bias = layer.qkv_proj.bias[q_size : q_size + kv_size]
                bias.view(cfg.num_kv_heads, cfg.head_dim).mul_(scale[:, None])


def _hf_shapes(config) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (hidden,),
                f"{p}.post_attention_layernorm.weight": (hidden,),
                f"{p}.self_attn.q_proj.weight": (q, hidden),
                f"{p}.self_attn.k_proj.weight": (kv, hidden),
                f"{p}.self_attn.v_proj.weight": (kv, hidden),
                f"{p}.self_attn.o_proj.weight": (hidden, q),
                f"{p}.mlp.gate_proj.weight": (inter, hidden),
                f"{p}.mlp.up_proj.weight": (inter, hidden),
                f"{p}.mlp.down_proj.weight": (hidden, inter),
            }
        )
        if config.qkv_bias:  # Qwen2's q/k/v biases (no o_proj bias: no Llama here has one)
            shapes.update({f"{p}.self_attn.q_proj.bias": (q,),
                           f"{p}.self_attn.k_proj.bias": (kv,),
                           f"{p}.self_attn.v_proj.bias": (kv,)})  # fmt: skip
    return shapes


def pinned_h2d_bandwidth(num_bytes: int = 2**30) -> float:
    """Host-to-device bytes/s from pinned memory."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    return num_bytes / cuda_time(lambda: device.copy_(host, non_blocking=True), warmup=2, repeat=5)


def ran_view(engine):
    """What :func:`ran_lane` holds, as the engine shows it (``Engine.load()``'s
    :class:`LaneView`: its layout, plan, host bytes, graphs, CPU share)."""
    return engine.load().lane(ran_lane(engine).name)


def ran_lane(engine):
    """The lane that ran a benchmark's requests: the offload lane where its layout offloads
    any head, else the resident (or only) lane."""
    for view in engine.load().lanes:
        if view.name == "offload" and view.plan is not None and view.plan.head_map.num_offloaded:
            return engine.lanes.lane("offload")
    return engine.lanes.resident
