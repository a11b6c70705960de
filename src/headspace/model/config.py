"""Model configuration: the subset of a Hugging Face config the lean decoder needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from headspace.errors import UserError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    All lengths are in tokens; ``rope`` holds the rope parameters (``rope_type``,
    ``rope_theta`` and the scaling fields of that type).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: dict = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def family(self) -> str:
        """The model type of its architecture: llama, mistral or qwen2."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes per token over all layers, in bf16/fp16 (2 bytes per value)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def max_context(self) -> int:
        """Longest context the model was trained for (sliding-window models: the window)."""
        if self.sliding_window and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings


def _rope_parameters(hf: dict) -> dict:
    """Rope parameters in transformers 5 form (``rope_parameters``), from either form."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"unsupported rope type {params['rope_type']!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return params


def _eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def config_from_dict(hf: dict) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict; refuses other families."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        named = ", ".join(archs) or hf.get("model_type", "unknown")
        raise UserError(
            f"unsupported architecture {named} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_kv = int(hf.get("num_key_value_heads") or num_heads)
        family = SUPPORTED_ARCHITECTURES[arch]
        window = hf.get("sliding_window") if family == "mistral" else None
        if family == "qwen2" and hf.get("use_sliding_window"):
            window = hf.get("sliding_window")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_parameters(hf),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(hf),
            sliding_window=int(window) if window else None,
        )
    except KeyError as exc:
        raise UserError(f"malformed config.json: missing field {exc.args[0]!r}") from None


def load_config(model_dir: Path) -> ModelConfig:
    """Read ``model_dir/config.json`` into a ModelConfig (UserError when missing/malformed)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"model directory {model_dir} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"malformed config.json in {model_dir}: {exc}") from None
    if not isinstance(hf, dict):
        raise UserError(f"malformed config.json in {model_dir}: not a JSON object")
    config = config_from_dict(hf)
    if config.num_heads % config.num_kv_heads:
        raise UserError(
            f"malformed config.json: {config.num_heads} heads not divisible by "
            f"{config.num_kv_heads} kv heads"
        )
    return config
