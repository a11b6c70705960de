"""The CPU attention kernel against its reference twin: shapes, GQA ratios, ragged lengths,
both K/V layouts (GPU-pool order and host-arena order), threads."""

from __future__ import annotations

import pytest
import torch

from headspace.attention.cpu_decode import (
    cpu_paged_decode,
    cpu_paged_decode_reference,
    kernel_isa,
)

PAGE = 16


def _problem(num_seqs, num_kv_heads, group, dim, lengths, dtype, host_layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) for n in lengths) + 3
    slots = num_pages * PAGE
    if host_layout:  # [kv_heads, 2, slots, dim]: K and V of a head adjacent
        kv = torch.randn(num_kv_heads, 2, slots, dim, generator=gen).to(dtype)
        k, v = kv[:, 0], kv[:, 1]
    else:  # [2, kv_heads, slots, dim]
        kv = torch.randn(2, num_kv_heads, slots, dim, generator=gen).to(dtype)
        k, v = kv[0], kv[1]
    order = torch.randperm(num_pages, generator=gen)  # pages scattered over the pool
    width = max(-(-n // PAGE) for n in lengths) + 1
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lengths):
        count = -(-n // PAGE)
        tables[row, :count] = order[used : used + count].to(torch.int32)
        used += count
    q = torch.randn(num_seqs, num_kv_heads * group, dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.int32)


def test_kernel_builds_here():
    assert kernel_isa() is not None  # CI and the device have a compiler: no silent fallback


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host_layout", [False, True])
@pytest.mark.parametrize(
    "num_kv_heads,group,dim,lengths",
    [(2, 4, 64, [1, 700, 33]), (3, 1, 32, [16, 17]), (1, 7, 128, [1000]), (4, 2, 48, [0, 5]),
     (2, 3, 40, [300]), (1, 9, 80, [129, 2])],
)  # fmt: skip
def test_kernel_equals_reference(portable, dtype, host_layout, num_kv_heads, group, dim,
                                 lengths):  # fmt: skip
    q, k, v, tables, ends = _problem(len(lengths), num_kv_heads, group, dim, lengths, dtype,
                                     host_layout)  # fmt: skip
    out, lse = cpu_paged_decode(q, k, v, tables, ends, PAGE, block_tokens=64, portable=portable)
    ref_out, ref_lse = cpu_paged_decode_reference(q, k, v, tables, ends, PAGE)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    empty = ends == 0
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()


def test_kernel_token_ranges():
    """Tokens start..end-1 only (the part of a history a CPU thread is given)."""
    q, k, v, tables, ends = _problem(3, 2, 4, 64, [500, 300, 40], torch.bfloat16, True)
    starts = torch.tensor([100, 299, 40], dtype=torch.int32)
    out, lse = cpu_paged_decode(q, k, v, tables, ends, PAGE, starts=starts)
    ref_out, ref_lse = cpu_paged_decode_reference(q, k, v, tables, ends, PAGE, starts=starts)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("portable", [False, True])
def test_threads_give_the_same_bits(portable):
    q, k, v, tables, ends = _problem(2, 2, 4, 64, [3000, 1234], torch.bfloat16, False)
    results = [cpu_paged_decode(q, k, v, tables, ends, PAGE, num_threads=n, portable=portable)
               for n in (1, 2, 3)]  # fmt: skip
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_softmax_weights(portable, dtype):
    """``probs``: each query head's weight of every token attended, as the twin computes
    them, summing to 1 per query (what the hybrid tier's sparse selection reads)."""
    lengths = [300, 0, 45]
    q, k, v, tables, ends = _problem(3, 2, 4, 64, lengths, dtype, host_layout=True)
    starts = torch.tensor([20, 0, 3], dtype=torch.int32)
    probs, ref_probs = torch.full((3, 8, 290), -1.0), torch.full((3, 8, 290), -1.0)
    cpu_paged_decode(q, k, v, tables, ends, PAGE, starts=starts, block_tokens=64,
                     portable=portable, probs=probs)  # fmt: skip
    cpu_paged_decode_reference(q, k, v, tables, ends, PAGE, starts=starts, probs=ref_probs)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs[0, :, :280].sum(-1), torch.ones(8))
    assert (probs[0, :, 280:] == -1).all() and (probs[1] == -1).all()  # past the counts
    with pytest.raises(ValueError, match="probs"):
        cpu_paged_decode(q, k, v, tables, ends, PAGE, starts=starts, probs=torch.zeros(3, 8, 10))


def test_float16_pages_take_the_twin():
    q, k, v, tables, ends = _problem(2, 2, 2, 32, [40, 7], torch.float16, True)
    out, lse = cpu_paged_decode(q, k, v, tables, ends, PAGE)
    ref_out, ref_lse = cpu_paged_decode_reference(q, k, v, tables, ends, PAGE)
    torch.testing.assert_close(out.float(), ref_out.float())
    torch.testing.assert_close(lse, ref_lse)


def test_rejects_what_it_cannot_read():
    q, k, v, tables, ends = _problem(1, 2, 2, 32, [10], torch.float32, False)
    with pytest.raises(ValueError, match="int32"):
        cpu_paged_decode(q, k, v, tables.long(), ends, PAGE)
    with pytest.raises(ValueError, match="dtypes differ"):
        cpu_paged_decode(q, k, v.half(), tables, ends, PAGE)
    with pytest.raises(ValueError, match="group"):
        cpu_paged_decode(q[:, :3], k, v, tables, ends, PAGE)
    with pytest.raises(ValueError, match="past its block table"):
        cpu_paged_decode(q, k, v, tables, ends + 10 * PAGE, PAGE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_background_jobs_wait_for_their_flag_and_equal_the_kernel(dtype):
    """A job queued before its query's values exist starts only when its flag reaches its
    value, then gives the kernel's exact result; jobs finish in order, each with its own."""
    import threading

    from headspace.attention.cpu_jobs import BackgroundDecode

    jobs = BackgroundDecode()
    problems = [_problem(3, 2, 4, 64, [700, 1, 300], dtype, True, seed=s) for s in (1, 2)]
    flag = torch.zeros(1, dtype=torch.int64)
    queries = [torch.zeros(q.shape) for q, *_ in problems]  # filled only after the submits
    tickets = [
        jobs.submit(query, k, v, tables, ends, PAGE, flag, value, num_threads=2)
        for query, (_, k, v, tables, ends), value in zip(queries, problems, (1, 2), strict=True)
    ]

    def produce():  # what a GPU stream does: the query, then the flag
        for value, (query, (q, *_)) in enumerate(zip(queries, problems, strict=True), 1):
            query.copy_(q.float())
            flag.fill_(value)

    producer = threading.Timer(0.05, produce)
    producer.start()
    for ticket, (q, k, v, tables, ends) in zip(tickets, problems, strict=True):
        out, lse = jobs.wait(ticket)
        expected_out, expected_lse = cpu_paged_decode(q.float(), k, v, tables, ends, PAGE)
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    producer.join()


def test_background_jobs_refuse_bad_arguments():
    from headspace.attention.cpu_jobs import BackgroundDecode

    q, k, v, tables, ends = _problem(1, 1, 2, 32, [20], torch.float32, True)
    jobs, flag = BackgroundDecode(), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="flag"):
        jobs.submit(q, k, v, tables, ends, PAGE, flag.int(), 1)
    with pytest.raises(ValueError, match="fp32 query"):
        jobs.submit(q.bfloat16(), k, v, tables, ends, PAGE, flag, 1)


def test_background_runners_start_and_stop_without_a_lost_wake_up():
    """Freeing a runner whose thread is about to wait must not hang (a lost wake-up)."""
    import threading

    from headspace.attention.cpu_jobs import BackgroundDecode

    def cycle():
        for _ in range(300):
            BackgroundDecode()  # freed at once: its thread stops and is joined

    worker = threading.Thread(target=cycle, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()


def test_a_job_whose_query_never_lands_surfaces_the_check_and_is_drained():
    """A wait runs ``check`` between slices (a GPU error raises there instead of hanging);
    a job left behind is drained once its flag comes."""
    from headspace.attention.cpu_jobs import BackgroundDecode

    q, k, v, tables, ends = _problem(1, 1, 2, 32, [40], torch.float32, True)
    jobs, flag = BackgroundDecode(), torch.zeros(1, dtype=torch.int64)
    ticket = jobs.submit(q.float(), k, v, tables, ends, PAGE, flag, 1, num_threads=1)
    calls = []

    def check():
        calls.append(1)
        raise RuntimeError("device error")

    with pytest.raises(RuntimeError, match="device error"):
        jobs.wait(ticket, check)
    assert calls == [1] and ticket in jobs._jobs
    flag.fill_(1)
    jobs.drain()
    assert not jobs._jobs
    with pytest.raises(ValueError, match="failed"):  # a ticket that was never queued
        jobs._jobs[99] = (None,) * 8
        jobs.wait(99)
