"""The generation engine: tokenizer, model, and the batch generator over the page pool."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path

import torch

from headspace.engine.config import EngineConfig
from headspace.engine.hooks import EngineHooks
from headspace.engine.lane_setup import kv_sizes
from headspace.engine.lanes import Lanes
from headspace.engine.memory import with_gpu_budget
from headspace.engine.outputs import EngineLoad, GenerationStats, RequestOutput
from headspace.engine.ranks import join, plan_ranks, setup_ranks
from headspace.engine.sampling import SamplingParams
from headspace.engine.warm_shapes import (
    WARM_UP_DECODE_TOKENS,
    WARM_UP_PIECE,
    warm_shapes,
    warm_up_batches,
    warm_up_request,
)
from headspace.engine.weight_stream import WeightStream, weights_streamed
from headspace.errors import UserError
from headspace.model.compile_meter import COMPILE_METER
from headspace.model.config import load_config
from headspace.model.llama import LlamaModel
from headspace.model.loader import load_model
from headspace.model.source import cache_root
from headspace.model.tokenizer import (
    JsonTokenizer,
    chat_ids,
    empty_message_tokens,
    load_tokenizer,
    tokens_at_least,
    transformers_tokenizer,
)
from headspace.planner.memory import weight_bytes
from headspace.planner.profile import Profile

__all__ = ["Engine", "EngineLoad", "GenerationStats", "RequestOutput"]


def keep_compile_caches() -> None:
    """Inductor's compile cache (its Triton kernels included) under the headspace cache
    (``compile/inductor``), which outlives the temporary directory torch's default lies in,
    unless the user or an earlier compilation in this process named one, or the headspace
    cache cannot be written (torch's default stays)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    folder = cache_root() / "compile" / "inductor"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def compile_in_process() -> None:
    """Inductor compiles in this process, without its pool of worker processes, unless the
    user set ``TORCHINDUCTOR_COMPILE_THREADS`` (a process-wide setting, for a process that
    runs one request, as ``headspace generate`` does): such a process compiles a few fused
    blocks, and spent more on starting and stopping the pool than it saved (on an H100
    host: a first process's warm-up 22.1 s with the pool, 15.2 s without; a second's exit
    waited 9.4 s for the pool's workers; ``bench/NOTES.md``). A server, which compiles a
    decode step per batch size as they arrive, keeps the pool."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


class Engine:
    """A model, its tokenizer and the batch generator over the KV tiers."""

    def __init__(self, model_dir: Path, config: EngineConfig, hooks: EngineHooks | None = None):
        model_cfg = load_config(model_dir)  # refuse a bad directory before the slower loads
        config = join(config)  # under torchrun: the process group, this rank's GPU
        # free memory read once, before the weights load (which the budget counts in)
        to_load = weight_bytes(model_cfg, config.runtime.torch_dtype.itemsize)
        config = with_gpu_budget(config, 0, to_load)
        started = time.perf_counter()
        tokenizer = load_tokenizer(model_dir)
        self.tokenizer_seconds = time.perf_counter() - started  # its imports included
        self.model_dir: Path | None = model_dir
        self._read_profile(model_cfg, config)
        # under torchrun: the heads balanced over the ranks; each layer sharded for this
        # one as it loads (the whole model never sits on its GPU)
        ranks = plan_ranks(model_cfg, config, self.profile, self._max_context(model_cfg, config))
        streamed = weights_streamed(model_cfg, config, ranks)  # then layers stay on the host
        started = time.perf_counter()
        model = load_model(model_dir, config.runtime.device, config.runtime.torch_dtype,
                           None if ranks is None else ranks.keep_heads,
                           "cpu" if streamed else None)  # fmt: skip
        self.load_seconds = time.perf_counter() - started  # reading and placing the weights
        if streamed:
            WeightStream(model, config.runtime.device, delay=hooks and hooks.weight_delay)
        self._setup(model, tokenizer, config, ranks, hooks)

    @classmethod
    def from_model(cls, model: LlamaModel, tokenizer, config: EngineConfig,
                   hooks: EngineHooks | None = None) -> Engine:  # fmt: skip
        """An engine over a model built in memory (benchmarks with random weights); the
        tokenizer needs only ``decode`` when prompts are token ids. Under torchrun the model
        is sharded in place; its layers move to pinned host memory if they stream."""
        engine = cls.__new__(cls)
        engine.load_seconds = engine.tokenizer_seconds = 0.0  # built in memory: nothing read
        engine.model_dir = None
        engine._read_profile(model.config, config)
        max_context = cls._max_context(model.config, config)
        ranks = setup_ranks(model, config, engine.profile, max_context)
        on_device = sum(p.nbytes for p in model.parameters() if p.device.type != "cpu")
        config = with_gpu_budget(config, on_device)  # free memory read once, now
        if weights_streamed(model.config, config, ranks, on_device):
            WeightStream(model, config.runtime.device, delay=hooks and hooks.weight_delay)
        engine._setup(model, tokenizer, config, ranks, hooks)
        return engine

    def _read_profile(self, model_cfg, config: EngineConfig) -> None:
        self.profile = None  # read once; one of another model is refused now, in one line
        if config.budgets.profile is not None:
            self.profile = Profile.load(config.budgets.profile)
            self.profile.check(model_cfg.num_layers, model_cfg.num_kv_heads)

    @staticmethod
    def _max_context(model_cfg, config: EngineConfig) -> int:
        return config.runtime.max_context or model_cfg.max_context

    def _setup(self, model: LlamaModel, tokenizer, config: EngineConfig, ranks,
               hooks: EngineHooks | None) -> None:  # fmt: skip
        self.config, self.model, self.tokenizer, self.ranks = config, model, tokenizer, ranks
        if config.runtime.on_gpu:  # before anything compiles
            keep_compile_caches()
            COMPILE_METER.install()  # (what compiles outside the warm-up is told apart)
        self.hooks = hooks
        model_cfg = model.config
        self.max_context = self._max_context(model_cfg, config)
        eos = set(model_cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._lanes: Lanes | None = None  # made on first use
        if ranks is None:  # the budget the lanes will split, refused now rather than then
            kv_sizes(model, config, self.max_context)
        self.stream_output: RequestOutput | None = None  # stream's request, as it stands

    @cached_property
    def transformers_tokenizer(self):
        """The checkpoint's tokenizer as transformers loads it, for callers that want its
        whole interface (``LLM.tokenizer``): the engine's own where it is transformers',
        else loaded at first use (the engine's reads the same ids and text without
        transformers' import)."""
        if self.model_dir is None or not isinstance(self.tokenizer, JsonTokenizer):
            return self.tokenizer
        return transformers_tokenizer(self.model_dir)

    @property
    def lanes(self) -> Lanes:
        """The lanes requests run in, over the KV arena (made at first use)."""
        if self._lanes is None:
            self._lanes = Lanes(self.model, self.tokenizer, self.config, self.eos_token_ids,
                                self.max_context, self.profile, self.ranks, self.hooks)  # fmt: skip
        return self._lanes

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``: exactly ``tokenizer(prompt)``, or the chat template's."""
        if not chat:
            return list(self.tokenizer(prompt)["input_ids"])
        return self.encode_chat([{"role": "user", "content": prompt}])

    def check_text(self, texts: list[str], least: int = 0) -> None:
        """Refuse (UserError) ``texts`` (a prompt, or a conversation's messages) whose tokens
        cannot fit the context, found without tokenizing them whole (a few of the context's
        worth of tokens at most); ``least``: tokens known to come besides them."""
        for text in texts:  # (a prompt of the whole context may take one new token)
            if least > self.max_context:
                break
            least += tokens_at_least(self.tokenizer, text, self.max_context - least)
        if least > self.max_context:
            raise UserError(f"the prompt has at least {least} tokens, which does not fit "
                            f"the context of {self.max_context} tokens")  # fmt: skip

    def check_chat(self, messages: list[dict]) -> None:
        """:meth:`check_text` for a conversation: each message past the first adds at least
        the tokens the chat template gives an empty one of its role (:attr:`message_tokens`),
        and a conversation of more messages than the context has tokens is refused, so that
        half a million empty messages of any role are refused before the template renders
        them."""
        if len(messages) > self.max_context:
            raise UserError(f"the conversation has {len(messages)} messages, which does not fit "
                            f"the context of {self.max_context} tokens")  # fmt: skip
        added = self.message_tokens
        least = sum(added.get(message.get("role"), 0) for message in messages[1:])
        self.check_text([message["content"] for message in messages], least)

    @cached_property
    def message_tokens(self) -> dict[str, int]:
        """Tokens the chat template gives an empty message of each role
        (:func:`~headspace.model.tokenizer.empty_message_tokens`, measured once)."""
        return empty_message_tokens(self.tokenizer)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation (``{"role", "content"}`` dicts) through the
        tokenizer's chat template, ready for the assistant's turn."""
        if not self.tokenizer.chat_template:
            raise UserError("chat mode needs a tokenizer with a chat template; this one has none")
        try:
            return chat_ids(self.tokenizer, messages, add_generation_prompt=True)
        except Exception as exc:  # jinja raises its own kinds for messages it cannot render
            raise UserError(f"the chat template cannot render these messages: {exc}") from None

    # -- stepping --------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    prompt: str | list[int] | None = None) -> int:  # fmt: skip
        """Queue a request (token ids; ``prompt`` is what outputs show, default the ids);
        it joins the running batch at a coming step. Returns its id. Refuses (UserError,
        with the numbers) a prompt past the context or one that no plan can hold."""
        return self.lanes.add(prompt_ids, params or SamplingParams(), prompt)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse now (UserError, with the numbers) what ``add_request`` would refuse: an
        empty prompt, one past the context, one that no plan can hold."""
        self.lanes.check(prompt_ids, params)

    def load(self) -> EngineLoad:
        """What the engine holds now: requests by state, KV pages in use per tier, the head
        map's entries per tier, swaps so far."""
        return self.lanes.load()

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; its GPU and host pages go back to their pools at
        once (the offload lane's between two of its steps), and a coming step returns it
        with ``finish_reason`` "abort". False if the id is unknown or the request was
        already returned finished. The offload lane steps on a thread of its own: a request
        there may end before the abort reaches it, and is then returned as it ended (its
        tokens whole, "length" or "stop"). Under torchrun every rank adds and aborts the
        same requests between the same steps (their schedulers decide alike)."""
        return self.lanes.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One step of every running request (and a piece of a prompt being prefilled);
        returns the requests that advanced, each with its text so far and what this step
        added, finished ones marked (``finish_reason``)."""
        return self.lanes.step()

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or has tokens on their way."""
        return self.lanes.has_unfinished()

    def prefilling(self) -> int | None:
        """The id of the request whose prompt is being prefilled now, if any (metrics)."""
        return self.lanes.prefilling()

    # -- loops over step() ---------------------------------------------------------------
    def generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams], on_finish=None
    ) -> list[RequestOutput]:
        """Generate for many prompts (token ids) as one batch over the shared KV pages; the
        final RequestOutputs in order. ``on_finish(position, output)`` is called as each
        request ends, with its prompt's position in ``prompts``."""
        self._alone(before="generate")
        finals: dict[int, RequestOutput] = {}
        with self.lanes.given_at_once():
            try:
                ids = [self.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
                position = {request: i for i, request in enumerate(ids)}
                while self.has_unfinished():
                    for output in self.step():
                        if output.finished:
                            finals[output.request_id] = output
                            if on_finish:
                                on_finish(position[output.request_id], output)
            finally:  # stopped early (an error, Ctrl-C): every page goes back
                self.lanes.abort_all()
        return [finals[i] for i in ids]

    def _alone(self, before: str) -> None:
        """Refuse ``before`` while requests added with add_request run; where all were
        aborted, step until what they left is taken (a read in flight, an end still coming
        from the offload lane), so that nothing of theirs comes out of the new steps."""
        if self.lanes.has_requests():
            raise UserError("requests added with add_request are still running: step them "
                            f"to the end (or abort them) before {before}")  # fmt: skip
        while self.has_unfinished():
            self.step()
        self.lanes.reset_peaks()  # (each run's peaks are its own)
        if self.config.runtime.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.config.runtime.device)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Yield text pieces as tokens are produced; returns the final RequestOutput. A
        stream closed early aborts its request; ``stream_output`` holds the request as it stood
        after the last step (its stats so far, when interrupted)."""
        self._alone(before="stream")
        self.stream_output = None
        with self.lanes.given_at_once():  # (alone, as generate's: no reserve, no pacing)
            try:
                self.add_request(prompt_ids, params)
                while self.has_unfinished():
                    for output in self.step():
                        self.stream_output = output
                        if output.new_text:
                            yield output.new_text
            finally:
                self.lanes.abort_all()
        return self.stream_output

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Generate for one prompt, alone."""
        return self.generate_batch([prompt_ids], [params])[0]

    def warm_up(self, prompt_len: int = 0, decode: bool = True, batch: int = 1,
                report: Callable[[str], None] | None = None, offload: bool = False,
                shapes: bool = False, alone: int | None = None) -> float:  # fmt: skip
        """Run a request alone, so that compilation and CUDA graph capture happen before the
        first real one (whose timings then leave them out); its seconds. Without
        ``prompt_len``, a short request; with it, one whose prefill takes the shapes a prompt
        of that many tokens takes (:func:`warm_up_request`). ``decode``: whether it
        decodes too (compiling and capturing the decode step): False for a request that
        ends at its first token. ``batch``: then batches of short requests, so that the
        decode step of every batch bucket up to ``batch`` is compiled too
        (:func:`warm_up_batches`; a server passes its bound on concurrent requests), each
        batch told to ``report`` (a progress line) as it starts. ``offload``: then, where
        the engine has an offload lane, the same prompt through it, laid out as the requests
        that follow will be: ``alone``, the tokens (prompt and new) of the one request given
        alone after it (the CLI's); None, requests of up to the whole context arriving one
        by one (a server's) (:meth:`_warm_up_offload`). ``shapes`` (a server's): before
        that, the decode graph of every batch bucket and width a prompt of up to the
        warm-up's meets, and cuDNN's plan of every causal square of a prompt of up to a
        chunk (:func:`~headspace.engine.warm_shapes.warm_shapes`); not for the CLI's one."""
        started = time.perf_counter()
        length, new_tokens = warm_up_request(prompt_len, self.lanes.chunk, decode)
        vocab = self.model.config.vocab_size
        ids = [(7 + 31 * i) % vocab for i in range(length)] if length else self.encode("Warm-up.")
        self.run(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        sizes = warm_up_batches(batch, self.config.runtime.max_batch) if decode else []
        for done, size in enumerate(sizes):
            if report is not None:
                report(f"warm-up: decode batch {size} ({done + 1} of {len(sizes)}, "
                       f"{time.perf_counter() - started:.0f} s so far)")  # fmt: skip
            # (admitted one a step: the first ones still decode when the last one starts)
            short = SamplingParams(max_new_tokens=size + WARM_UP_DECODE_TOKENS, ignore_eos=True)
            prompts = [[(11 + 31 * (i + row)) % vocab for i in range(WARM_UP_PIECE)]
                       for row in range(size)]  # fmt: skip
            self.generate_batch(prompts, [short] * size)
        if shapes:
            warm_shapes(self.lanes, self.model, len(ids), sizes, report, started)
        if offload:
            self._warm_up_offload(ids, report, alone, decode)
        return time.perf_counter() - started

    def _warm_up_offload(self, ids: list[int], report: Callable[[str], None] | None,
                         alone: int | None, decode: bool) -> None:  # fmt: skip
        """``ids`` as a request that may grow to ``alone`` tokens, given alone (None: to the
        whole context, one of requests arriving one by one), which the arena does not hold
        resident: it runs in the offload lane, laid out as such a request is (its heads
        streamed or attended on the CPU, its host pages allocated), prefills, decodes
        WARM_UP_DECODE_TOKENS tokens where ``decode`` (else stops at its first), and is
        aborted. The kernels of that layout compile here rather than at a long request's
        first steps, and the host pages are page-locked once. Nothing happens without an
        offload lane, where ``tokens`` fit resident, or where no plan holds them (the host
        budget too small: such a request is refused with the numbers when it comes)."""
        tokens = min(alone or self.max_context, self.max_context)
        room = tokens - len(ids)
        if room < 1 or not self.lanes.offloads(tokens):
            return
        params = SamplingParams(max_new_tokens=room, ignore_eos=True)
        with self.lanes.given_at_once(alone is not None):
            try:
                request_id, decoded = self.add_request(ids, params), 0
            except UserError:
                return
            if report is not None:
                what = "the whole context" if tokens == self.max_context else f"{tokens:,} tokens"
                report(f"warm-up: the offload lane, laid out for {what}")
            wanted = WARM_UP_DECODE_TOKENS if decode else 1
            try:
                while decoded < wanted and self.has_unfinished():
                    for output in self.step():
                        if output.request_id == request_id:
                            decoded += len(output.new_token_ids)
            finally:
                self.abort(request_id)
                while self.has_unfinished():
                    self.step()

    def logits(self, token_ids: list[int], decode_tokens: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the chunked prefill path,
        the last ``decode_tokens`` rows through decode steps fed the given tokens."""
        return self.lanes.logits(token_ids, decode_tokens)
