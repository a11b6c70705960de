"""``headspace profile``: what each head does on this model, and what each pattern costs on
this device, in one JSON file (:class:`headspace.planner.profile.Profile`) that ``plan``
reads to fill the head map's patterns.

- Retrieval scores (the attention-head pattern report): needles hidden in a long real text;
  the needle's answer is fed after the question (teacher forcing), and each head's score is
  the attention weight its queries give the needle token that the next answer token copies,
  averaged over the answer and the cases. A kv head scores its best query head's value.
  Heads that retrieve need the whole context; the others can be made sparse.
- Runtime costs (the runtime profile): milliseconds of one kv head's attention (its query
  heads, one prefill chunk at the end of the context) under each pattern and context length,
  measured with a layer's kv heads in one call as the engine runs them.
- Budget shares (FairKV's statistical profile): the tokens Ada-SnapKV gives each (layer, kv
  head) over the same prompts, as a multiple of an even share; what the head-parallel cost
  model reads for the heads' uneven loads.
"""

from __future__ import annotations

import time
import warnings

import torch

from headspace.attention import attend
from headspace.attention.patterns import estimate
from headspace.attention.sparse_prefill import sparse_prefill_attention
from headspace.budgets import POLICIES, KVBudget, observation_scores
from headspace.errors import UserError
from headspace.kv.spec import Pattern

PATTERNS = ("full", "streaming(4,1024)", "vertical_slash(1000,2048)", "block_sparse(8)")


RECORD_CHUNK = 16384  # prompt tokens per forward while recording: a long prompt's
# activations stay those of one chunk (a 128K prompt in one forward overflows an 80 GB GPU)


class _Recorder:
    """A dense attention callback for the lean model, called chunk by chunk over one prompt:
    keeps, per layer, every key and value ``[kv heads, keys, dim]`` and the last ``rows``
    queries ``[heads, rows, dim]``."""

    def __init__(self, rows: int):
        self.rows, self.queries, self.keys, self.values = rows, {}, {}, {}

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        q_first = q.transpose(0, 1)  # [heads, tokens, dim]
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [kv heads, tokens, dim]
        if layer in self.keys:  # the prompt so far, then this chunk
            k = torch.cat([self.keys[layer], k], 1)
            v = torch.cat([self.values[layer], v], 1)
            recent = torch.cat([self.queries[layer], q_first], 1)
        else:
            recent = q_first
        last = recent[:, -self.rows :].clone()  # not a view that keeps the chunk's queries
        self.queries[layer], self.keys[layer], self.values[layer] = last, k, v
        out, _ = attend(q_first, k, v, causal=True)
        return out.transpose(0, 1)

    def weights(self, layer: int) -> torch.Tensor:
        """Each head's softmax weights of the last queries ``[heads, rows, keys]`` (causal)."""
        q, k = self.queries[layer].float(), self.keys[layer].float()
        group, num_keys = q.shape[0] // k.shape[0], k.shape[1]
        logits = q @ k.repeat_interleave(group, 0).transpose(1, 2) * q.shape[-1] ** -0.5
        rows = torch.arange(num_keys - self.rows, num_keys, device=q.device)
        logits = logits.masked_fill(torch.arange(num_keys, device=q.device) > rows[:, None],
                                    float("-inf"))  # fmt: skip
        return torch.softmax(logits, dim=-1)


def _record(model, ids: list[int], rows: int, chunk: int = RECORD_CHUNK) -> _Recorder:
    """Run the prompt ``ids`` through ``model`` ``chunk`` tokens at a time, recording it."""
    recorder, device = _Recorder(rows), next(model.parameters()).device
    tokens = torch.tensor(ids, device=device)
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        model(tokens[start:end], torch.arange(start, end, device=device), recorder)
    return recorder


def _find(haystack: list[int], piece: list[int]) -> int:
    for start in range(len(haystack) - len(piece), -1, -1):
        if haystack[start : start + len(piece)] == piece:
            return start
    return -1


@torch.inference_mode()
def retrieval_scores(model, tokenizer, encode, lengths: list[int], depths: list[float],
                     needle=None, chunk: int = RECORD_CHUNK,
                     ) -> tuple[torch.Tensor, list[dict], list[list[int]]]:  # fmt: skip
    """``[layers, kv heads]`` retrieval scores averaged over needle cases of ``lengths`` x
    ``depths``, one record per case, and the cases' prompts (each run ``chunk`` tokens at a
    time)."""
    from headspace.eval.data import haystack_text
    from headspace.eval.niah import Needle, build_case

    needle = needle or Needle()
    haystack = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    config, device = model.config, next(model.parameters()).device
    total, cases, prompts = torch.zeros(config.num_layers, config.num_heads), [], []
    for length in lengths:
        for depth in depths:
            case = build_case(tokenizer, encode, haystack, length, depth, needle)
            prompt = case.prompt_ids
            prompts.append(prompt)
            answer = tokenizer(" " + needle.answer, add_special_tokens=False)["input_ids"]
            source = _find(prompt, answer)
            if source < 0:
                raise UserError(f"the needle's answer {needle.answer!r} is not a token run "
                                "of the prompt; choose another needle")  # fmt: skip
            recorder = _record(model, prompt + answer[:-1], len(answer), chunk)
            # the query before answer token i predicts it; its source is source + i
            columns = torch.arange(source, source + len(answer), device=device)
            rows = torch.arange(len(answer), device=device)
            per_layer = torch.stack([recorder.weights(layer)[:, rows, columns].mean(1).cpu()
                                     for layer in range(config.num_layers)])  # fmt: skip
            total += per_layer
            cases.append({"length": len(prompt), "depth": depth, "source": source,
                          "answer_tokens": len(answer)})  # fmt: skip
    per_query_head = total / len(cases)
    group = config.num_heads // config.num_kv_heads
    scores = per_query_head.view(config.num_layers, config.num_kv_heads, group).amax(2)
    return scores, cases, prompts


@torch.inference_mode()
def budget_shares(model, prompts: list[list[int]], budget: KVBudget,
                  chunk: int = RECORD_CHUNK) -> torch.Tensor:  # fmt: skip
    """``[layers, kv heads]`` tokens ``budget``'s policy keeps per entry over ``prompts``, each
    a multiple of the even share (1.0: what snapkv keeps), averaged over the prompts (each
    run ``chunk`` tokens at a time)."""
    config = model.config
    total = torch.zeros(config.num_layers, config.num_kv_heads)
    for prompt in prompts:
        window = min(budget.window, len(prompt))
        selectable = budget.tokens(len(prompt)) - window
        if selectable <= 0 or budget.tokens(len(prompt)) >= len(prompt):
            total += 1.0  # the budget keeps everything, or only the window: even
            continue
        total += (kept_counts(model, prompt, budget, chunk) - window).float() / selectable
    return total / len(prompts)


def kept_counts(model, prompt: list[int], budget: KVBudget,
                chunk: int = RECORD_CHUNK) -> torch.Tensor:  # fmt: skip
    """``[layers, kv heads]`` tokens (int64) ``budget``'s policy keeps of each entry after
    ``prompt`` (its observation window included; the whole prompt where the budget covers
    it), the prompt run ``chunk`` tokens at a time."""
    config = model.config
    shape = (config.num_layers, config.num_kv_heads)
    window = min(budget.window, len(prompt))
    selectable = budget.tokens(len(prompt)) - window
    if budget.tokens(len(prompt)) >= len(prompt):
        return torch.full(shape, len(prompt))
    if selectable <= 0:
        return torch.full(shape, window)
    recorder = _record(model, prompt, window, chunk)
    scores = [observation_scores(recorder.queries[layer], recorder.keys[layer],
                                 pool=budget.pool).cpu()
              for layer in range(config.num_layers)]  # fmt: skip
    counts = POLICIES[budget.policy](scores, selectable)
    return torch.stack([c.long().cpu() for c in counts]) + window


def pattern_costs(num_heads: int, head_dim: int, contexts: list[int], chunk: int, device: str,
                  patterns=PATTERNS, repeat: int = 3,
                  num_kv_heads: int = 1) -> dict[str, dict[str, float]]:  # fmt: skip
    """Milliseconds of one kv head's attention (its ``num_heads`` query heads) under each
    pattern over the last ``chunk`` queries of each context, estimation included: a layer's
    ``num_kv_heads`` kv heads in one call, as the engine runs them, divided between them (a
    call's fixed work, its block mask and launches, is shared by a layer's heads; timed
    alone, one streaming kv head was charged all of it and cost more than a full one). On a
    GPU the device's time (:func:`call_ms`); the median of ``repeat`` calls after one that
    compiles."""
    costs: dict[str, dict[str, float]] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    for text in patterns:
        per_head = [Pattern.parse(text)] * (num_kv_heads * num_heads)
        for context in contexts:
            queries = min(chunk, context)
            q = torch.randn(num_kv_heads * num_heads, queries, head_dim, generator=gen,
                            device=device, dtype=dtype)  # fmt: skip
            k = torch.randn(num_kv_heads, context, head_dim, generator=gen, device=device,
                            dtype=dtype)  # fmt: skip

            def call(q=q, k=k, per_head=per_head):
                sparse_prefill_attention(q, k, k, estimate(per_head, q, k))

            call()  # compiles
            times = [call_ms(call, device) for _ in range(repeat)]
            costs.setdefault(text, {})[str(context)] = sorted(times)[len(times) // 2] / num_kv_heads
    return costs


SLEEP_CYCLES = 2**24  # the first wait queued ahead of a timed call (~10 ms), doubled as needed
MAX_DOUBLINGS = 4


def call_ms(fn, device: str) -> float:
    """Milliseconds of one ``fn()``: on a GPU its device time, from events around it queued
    behind a wait long enough that the host has issued all of it when the wait ends (the
    host's issuing is hidden, as a long prefill's queue hides it); on a CPU its wall time.
    A ``fn`` that waits for the device cannot be issued ahead: it warns and returns the
    span with the host's gaps in it."""
    if not device.startswith("cuda"):
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    with torch.cuda.device(torch.device(device)):
        for cycles in (SLEEP_CYCLES << n for n in range(MAX_DOUBLINGS + 1)):
            torch.cuda.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            torch.cuda._sleep(cycles)
            marks[1].record()
            issued = time.perf_counter()
            fn()
            issue_ms = 1000 * (time.perf_counter() - issued)
            marks[2].record()
            torch.cuda.synchronize()
            # issued well before the wait ended (a call that waits for the GPU returns just
            # after the wait, so its issue time is the wait's, never half of it)
            if 2 * issue_ms < marks[0].elapsed_time(marks[1]):
                return marks[1].elapsed_time(marks[2])
    warnings.warn("the timed call waits for the GPU: its time includes the host's", stacklevel=2)
    return marks[1].elapsed_time(marks[2])
