"""The Python API: ``LLM`` and ``SamplingParams``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from headspace.engine.config import EngineConfig
from headspace.engine.engine import Engine, RequestOutput
from headspace.engine.hooks import EngineHooks
from headspace.engine.ranks import join
from headspace.engine.sampling import SamplingParams
from headspace.model.source import resolve_model_dir
from headspace.parallel.dist import rank_zero_first


class LLM:
    """A loaded model ready to generate.

    ``model``: a checkpoint directory (config.json + safetensors + tokenizer), a ``.gguf``
    file, or None for the embedded SmolLM2-135M-Instruct. ``device``: "cpu" or "cuda[:N]".
    ``dtype``: "float32", "bfloat16" or "float16" (default: float32 on CPU, bfloat16 on GPU).
    Other keyword options are the fields of the engine's option groups, given flat
    (:meth:`headspace.engine.config.EngineConfig.of`: ``offload``, ``gpu_memory``,
    ``kv_budget``, ...), and ``balance``, ``replicas``, ``balance_phase``,
    ``copy_seconds``, ``balance_batch`` of :class:`headspace.parallel.config.ParallelConfig`
    (how kv heads are spread over the ranks when the script runs under ``torchrun``, which
    sets their number). ``hooks``: seams for tests and benchmarks
    (:class:`headspace.engine.hooks.EngineHooks`).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        hooks: EngineHooks | None = None,
        **engine_options,
    ):
        # under torchrun: the process group and this rank's GPU; rank 0 converts a model
        # (the embedded one for a new dtype, a .gguf) before the others look for it
        self.config = join(EngineConfig.of(device=device, dtype=dtype, **engine_options))
        dtype = self.config.runtime.dtype
        self.model_dir = rank_zero_first(lambda: resolve_model_dir(model, dtype))
        self.engine = Engine(self.model_dir, self.config, hooks)
        self.last_output: RequestOutput | None = None

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer as transformers loads it (at first use: the engine
        reads the same ids and text without transformers where it can)."""
        return self.engine.transformers_tokenizer

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.encode(prompt, chat)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
        use_tqdm: bool = False,
        on_finish: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns one RequestOutput per prompt.

        A prompt is text (tokenized exactly as ``tokenizer(prompt)``, or by the chat
        template with ``chat=True``) or a list of token ids. All prompts run as one batch
        over the shared KV page pool (continuous batching, shared prefixes reuse pages);
        ``params`` is one SamplingParams for all or a list with one per prompt;
        ``use_tqdm`` shows a progress bar of finished requests on stderr;
        ``on_finish(position, output)`` is called as each prompt's request ends (its
        position in ``prompts``): what finished before a Ctrl-C is not lost.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            return []
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        ids = [self._prompt_ids(prompt, chat) for prompt in prompts]
        with tqdm(total=len(ids), unit="request", disable=not use_tqdm) as bar:

            def finished(position: int, output: RequestOutput) -> None:
                bar.update()
                output.prompt = prompts[position]
                if on_finish is not None:
                    on_finish(position, output)

            outputs = self.engine.generate_batch(ids, params_list, on_finish=finished)
        self.last_output = outputs[-1]
        return outputs

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[str]:
        """Yield generated text pieces as they are produced (``last_output`` holds the result;
        after Ctrl-C, the request as it stood, ended "interrupted")."""
        stream = self.engine.stream(self._prompt_ids(prompt, chat), params or SamplingParams())
        while True:
            try:
                yield next(stream)
            except StopIteration as done:
                done.value.prompt = prompt
                self.last_output = done.value
                return
            except KeyboardInterrupt:  # the request as it stood (aborted as the stream ends)
                self.last_output = self.engine.stream_output
                if self.last_output is not None:
                    self.last_output.prompt = prompt
                    self.last_output.stats.ended = "interrupted"
                raise

    def logits(self, token_ids: list[int] | torch.Tensor, decode_tokens: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` through the same chunked prefill path; the
        last ``decode_tokens`` rows through decode steps fed the given tokens (teacher
        forcing: what generation runs, e.g. the hybrid tier's CPU attention)."""
        return self.engine.logits([int(t) for t in token_ids], decode_tokens)
