"""The generation engine: tokenizer, model and runner, one request at a time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from headspace.engine.config import EngineConfig
from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.runner import ModelRunner
from headspace.engine.sampling import SamplingParams, make_generator, sample
from headspace.errors import UserError
from headspace.model.config import load_config
from headspace.model.loader import load_model

PROGRESS_MIN_TOKENS = 4096  # show a prefill progress bar from this prompt length on


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
    """Loads a checkpoint directory and generates from token ids."""

    def __init__(self, model_dir: Path, config: EngineConfig):
        self.config = config
        load_config(model_dir)  # refuse a bad directory before the slower loads
        self.tokenizer = _load_tokenizer(model_dir)
        self.model = load_model(model_dir, config.device, config.torch_dtype)
        self.runner = ModelRunner(self.model, config)
        model_cfg = self.model.config
        self.max_context = config.max_context or model_cfg.max_context
        eos = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._batch = None  # the paged batch generator, made on first use

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

    def _check_budget(self, num_tokens: int) -> None:
        """The single-sequence cache must fit ``gpu_memory`` too (the pool path sizes itself)."""
        if self.config.gpu_memory is None:
            return
        from headspace.engine.memory import device_total_bytes, parse_memory

        device = torch.device(self.config.device)
        budget = parse_memory(self.config.gpu_memory, device_total_bytes(device))
        element = torch.empty((), dtype=self.config.torch_dtype).element_size()
        kv_bytes = num_tokens * self.model.config.kv_bytes_per_token // 2 * element
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if weights + kv_bytes > budget:
            raise UserError(
                f"memory budget too small: {num_tokens} tokens need {kv_bytes / 2**30:.2f} GiB "
                f"of KV beside {weights / 2**30:.2f} GiB of weights, over the "
                f"{budget / 2**30:.2f} GiB budget"
            )

    def _sync(self) -> None:
        if self.config.on_gpu:
            torch.cuda.synchronize(self.config.device)

    def _prefill(self, ids: torch.Tensor, stats: GenerationStats) -> torch.Tensor:
        show = self.config.progress and len(ids) >= PROGRESS_MIN_TOKENS
        with tqdm(total=len(ids), desc="prefill", unit="tok", disable=not show, leave=False) as bar:
            start = time.perf_counter()
            logits = self.runner.prefill(ids, on_chunk=bar.update)
            self._sync()
            stats.prefill_seconds = time.perf_counter() - start
        return logits

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Yield text pieces as tokens are produced; returns the RequestOutput at the end."""
        self.check_length(len(prompt_ids))
        total = min(len(prompt_ids) + params.max_new_tokens, self.max_context)
        self._check_budget(total)
        if self.config.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.config.device)
        self.runner.reserve(total)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        generator = make_generator(params, self.runner.device)
        streamer = StopStringStreamer(self.tokenizer, params.stop)
        logits = self._prefill(torch.tensor(prompt_ids, dtype=torch.long), stats)
        generated: list[int] = []
        finish_reason = "length"
        decode_start = time.perf_counter()
        for position in range(len(prompt_ids), total):
            token = sample(logits, params, generator)
            token_id = int(token.item())
            generated.append(token_id)
            if token_id in self.eos_token_ids and not params.ignore_eos:
                finish_reason = "stop"
                break
            piece = streamer.update(generated)
            if piece:
                yield piece
            if streamer.stopped:
                finish_reason = "stop"
                break
            if position + 1 < total:
                logits = self.runner.decode(token, position)
        tail = streamer.finish()
        if tail:
            yield tail
        self._sync()
        stats.decode_seconds = time.perf_counter() - decode_start
        stats.generated_tokens = len(generated)
        if self.config.on_gpu:
            stats.peak_gpu_bytes = torch.cuda.max_memory_allocated(self.config.device)
        return RequestOutput(prompt_ids, streamer.text, generated, finish_reason, stats)

    def generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        """Generate for many prompts as one batch over the shared KV page pool."""
        from headspace.engine.batch import BatchGenerator

        if self._batch is None:
            self._batch = BatchGenerator(self)
        return self._batch.run(prompts, params)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Generate to the end without streaming."""
        stream = self.stream(prompt_ids, params)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the chunked prefill path."""
        self.check_length(len(token_ids) - 1 if token_ids else 0)
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        self.runner.reserve(len(ids))
        return self.runner.prefill(ids, all_logits=True)
