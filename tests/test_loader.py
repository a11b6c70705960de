"""The checkpoint loader: tensors read ahead by threads give the model read in turn, in the
same order of placement, and a bad tensor met by a thread is the same one-line error."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from headspace.errors import UserError
from headspace.model.config import load_config
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
