"""Loading a checkpoint: tensors read ahead by threads give the model read in turn, in the
same order of placement, and a bad tensor met by a thread is the same one-line error; a
fast tokenizer loads without the auto-classes, as AutoTokenizer would load it; the compile
cache is kept under the headspace cache; loading imports no Dynamo."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headspace.errors import UserError
from headspace.model.config import config_from_dict, load_config
from headspace.model.loader import build_model, checkpoint_layout


@pytest.fixture(scope="module")
def embedded_state(embedded_dir):
    state = {}
    for path in sorted(embedded_dir.glob("*.safetensors")):
        state.update(load_file(path))
    return load_config(embedded_dir), state


@pytest.mark.parametrize("read_ahead", [1, 3, 8])
def test_tensors_read_ahead_equal_tensors_read_in_turn(embedded_state, read_ahead):
    """Threads read the tensors (each from a thread of the pool, not the caller's), and
    every parameter equals the in-turn load's, with each layer finished in order."""
    config, state = embedded_state
    readers: set[int] = set()

    def get_tensor(name: str) -> torch.Tensor:
        readers.add(threading.get_ident())
        return state[name]

    finished: list[int] = []
    ahead = build_model(
        config, get_tensor, "cpu", torch.float32, lambda i, _: finished.append(i), None, read_ahead
    )
    in_turn = build_model(config, state.__getitem__, "cpu", torch.float32)
    assert threading.get_ident() not in readers and len(readers) <= read_ahead
    assert finished == list(range(config.num_layers))
    mine, theirs = dict(ahead.named_parameters()), dict(in_turn.named_parameters())
    assert mine.keys() == theirs.keys() == set(checkpoint_layout(config))
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_a_missing_tensor_read_ahead_is_one_line_error(embedded_state):
    config, state = embedded_state
    missing = "model.layers.3.mlp.up_proj.weight"

    def get_tensor(name: str) -> torch.Tensor:
        if name == missing:
            raise UserError(f"malformed checkpoint: tensor {name} not found in safetensors files")
        return state[name]

    with pytest.raises(UserError, match="up_proj.weight not found"):
        build_model(config, get_tensor, "cpu", torch.float32, read_ahead=4)


def test_a_malformed_tensor_stops_the_reads_ahead(embedded_state):
    """A tensor of the wrong shape, found as it is placed, is one line naming it, and no
    tensor is read past the parameters queued ahead of it (twice the threads)."""
    config, state = embedded_state
    bad = "model.layers.1.self_attn.o_proj.weight"
    reads: list[str] = []

    def get_tensor(name: str) -> torch.Tensor:
        reads.append(name)
        return state[name][:-1] if name == bad else state[name]

    with pytest.raises(UserError, match=f"malformed checkpoint: {bad} has shape"):
        build_model(config, get_tensor, "cpu", torch.float32, read_ahead=2)
    layout = list(checkpoint_layout(config).values())
    at = next(i for i, sources in enumerate(layout) if bad in sources)
    queued = sum(len(sources) for sources in layout[: at + 1 + 2 * 2])
    assert bad in reads and len(reads) <= queued


def test_a_plain_cuda_device_is_the_callers_current_gpu(monkeypatch):
    """The readers' threads start on GPU 0, so a plain ``cuda`` is pinned to the caller's
    current GPU before they place anything; other devices stay as given."""
    from headspace.model.loader import _on_current_gpu

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _on_current_gpu("cuda") == torch.device("cuda", 3)
    assert _on_current_gpu("cuda:1") == torch.device("cuda", 1)
    assert _on_current_gpu("cpu") == torch.device("cpu")


def test_a_fast_tokenizer_loads_without_auto_classes_and_encodes_alike(embedded_dir, tmp_path):
    """A llama directory that saves a fast tokenizer (tokenizer.json, its class named so)
    loads without transformers' model auto-classes (read by tokenizers alone, or through the
    fast class where that reader steps aside: tests/test_tokenizer.py); its encodings,
    decodings and chat template equal AutoTokenizer's. Another class, or a model type whose
    own tokenizer AutoTokenizer builds (qwen2), goes through AutoTokenizer."""
    import json
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from headspace.model.tokenizer import load_tokenizer, transformers_tokenizer_class

    assert transformers_tokenizer_class(embedded_dir) is PreTrainedTokenizerFast
    direct = load_tokenizer(embedded_dir)
    auto = AutoTokenizer.from_pretrained(embedded_dir)
    texts = ["Hello, world!", "  two  spaces\nand a line", "Ünïcode ✓ 数字 123"]
    ids = [direct(t).input_ids for t in texts]
    assert ids == [auto(t).input_ids for t in texts]
    assert [direct.decode(i) for i in ids] == [auto.decode(i) for i in ids]
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert direct.apply_chat_template(chat, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, add_generation_prompt=True)  # fmt: skip
    code = ("import sys; from pathlib import Path; from headspace.model.tokenizer import "
            f"load_tokenizer; load_tokenizer(Path({str(embedded_dir)!r})); "
            "print('transformers.models.auto.modeling_auto' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
    for name, changes in (
        ("class", {"tokenizer_config.json": {"tokenizer_class": "X"}}),
        ("qwen2", {"config.json": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}}),
        ("qwen2 type", {"config.json": {"model_type": "qwen2"}}),  # AutoTokenizer reads the type
    ):
        other = tmp_path / name
        shutil.copytree(embedded_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
        for file, change in changes.items():
            saved = json.loads((other / file).read_text())
            (other / file).write_text(json.dumps({**saved, **change}))
        assert transformers_tokenizer_class(other) is AutoTokenizer, name


def test_compile_caches_are_kept_under_the_headspace_cache(monkeypatch, tmp_path):
    """Inductor's cache goes under the headspace cache unless one is named already, or the
    headspace cache cannot be written (torch's default then stays)."""
    from headspace.engine.engine import keep_compile_caches

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HEADSPACE_CACHE", str(tmp_path / "a-file"))  # no folder can go there
    keep_compile_caches()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("HEADSPACE_CACHE", str(tmp_path))
    keep_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert (tmp_path / "compile" / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    keep_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_inductor_compiles_in_process_unless_the_user_chose_its_threads(monkeypatch):
    """Inductor's compile workers: none (one thread, in this process) unless the user named
    a number in TORCHINDUCTOR_COMPILE_THREADS, which stays."""
    import torch._inductor.config as inductor_config

    from headspace.engine.engine import compile_in_process

    monkeypatch.setattr(inductor_config, "compile_threads", 7)  # torch's, restored after
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "7")
    compile_in_process()
    assert inductor_config.compile_threads == 7
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    compile_in_process()
    assert inductor_config.compile_threads == 1


def test_loading_on_the_cpu_imports_no_dynamo(embedded_dir):
    """Building the model on the meta device and loading it does not import Dynamo (seconds
    in a fresh process, for an engine that never compiles); a model built on the CPU gets
    nn.Embedding's own seeded init."""
    import subprocess
    import sys

    from headspace.model.llama import LlamaModel

    code = (f"import sys; from headspace import LLM; LLM({str(embedded_dir)!r}); "
            "print('torch._dynamo' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr[-2000:]
    config = config_from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 97,
                               "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4})  # fmt: skip
    torch.manual_seed(3)
    model = LlamaModel(config)
    torch.manual_seed(3)
    assert torch.equal(model.embed_tokens.weight, torch.nn.Embedding(97, 32).weight)
