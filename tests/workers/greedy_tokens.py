"""Run by tests/test_gpu.py in a fresh process (its compile caches in new folders): a tiny
Llama-shaped model in bf16 on the GPU, compiled blocks and graphed decode (the defaults),
greedy tokens of one prompt printed as JSON on the last line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' models
from gpu_models import greedy, make_engine, tiny_model  # noqa: E402

prompt = torch.randint(0, 512, (700,), generator=torch.Generator().manual_seed(5))
engine = make_engine(tiny_model("cuda", torch.bfloat16, layers=6))
print(json.dumps(greedy(engine, [prompt])[0]))
