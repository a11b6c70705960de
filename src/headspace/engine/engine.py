"""The generation engine: tokenizer, model, and the batch generator over the page pool."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from headspace.engine.config import EngineConfig
from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError
from headspace.model.config import load_config
from headspace.model.loader import load_model


@dataclass
class GenerationStats:
    """Counts and timings of one request (seconds, bytes)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_gpu_bytes: int | None = None

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tok_s(self) -> float:
        return max(self.generated_tokens - 1, 0) / max(self.decode_seconds, 1e-9)

    def summary(self) -> str:
        parts = [
            f"prompt {self.prompt_tokens} tokens",
            f"prefill {self.prefill_tok_s:,.0f} tok/s",
            f"decode {self.decode_tok_s:,.1f} tok/s ({self.generated_tokens} tokens)",
        ]
        if self.peak_gpu_bytes is not None:
            parts.append(f"peak GPU memory {self.peak_gpu_bytes / 2**30:.2f} GiB")
        return " | ".join(parts)


@dataclass
class RequestOutput:
    """One finished request: generated text and token ids (prompt excluded)."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((model_dir / name).is_file() for name in names):
        raise UserError(f"model directory {model_dir} has no tokenizer files")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises several kinds for a bad tokenizer
        raise UserError(f"cannot load the tokenizer from {model_dir}: {exc}") from None


class Engine:
    """Loads a checkpoint directory and generates from token ids over the KV page pool."""

    def __init__(self, model_dir: Path, config: EngineConfig):
        self.config = config
        load_config(model_dir)  # refuse a bad directory before the slower loads
        self.tokenizer = _load_tokenizer(model_dir)
        self.model = load_model(model_dir, config.device, config.torch_dtype)
        model_cfg = self.model.config
        self.max_context = config.max_context or model_cfg.max_context
        eos = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._batch = None  # the batch generator and its page pool, made on first use

    @property
    def batch(self):
        from headspace.engine.batch import BatchGenerator

        if self._batch is None:
            self._batch = BatchGenerator(self)
        return self._batch

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``: exactly ``tokenizer(prompt)``, or the chat template's."""
        if not chat:
            return list(self.tokenizer(prompt)["input_ids"])
        if not self.tokenizer.chat_template:
            raise UserError("chat mode needs a tokenizer with a chat template; this one has none")
        messages = [{"role": "user", "content": prompt}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def check_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise UserError("the prompt is empty")
        if num_prompt_tokens >= self.max_context:
            raise UserError(
                f"the prompt has {num_prompt_tokens} tokens, which does not fit the context of "
                f"{self.max_context} tokens (raise it explicitly with max_context / --max-context)"
            )

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Yield text pieces as tokens are produced; returns the RequestOutput at the end."""
        on_gpu = self.config.on_gpu
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.config.device)
        output = yield from self.batch.stream(prompt_ids, params)
        if on_gpu:
            output.stats.peak_gpu_bytes = torch.cuda.max_memory_allocated(self.config.device)
        return output

    def generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams], on_finish=None
    ) -> list[RequestOutput]:
        """Generate for many prompts as one batch over the shared KV page pool."""
        return self.batch.run(prompts, params, on_finish)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Generate for one prompt, alone."""
        return self.batch.run([prompt_ids], [params])[0]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the chunked prefill path."""
        self.check_length(len(token_ids) - 1 if token_ids else 0)
        return self.batch.logits(token_ids)
