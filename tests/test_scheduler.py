"""The scheduler alone (no model, no tensors): what each step plan holds as requests arrive,
decode, prefill in pieces, swap and are aborted."""

from __future__ import annotations

from headspace.engine.scheduler import Scheduler, SchedulerSettings, Sequence
from headspace.kv.block_table import GPU, HOST, BlockManager

PAGE = 16


def _scheduler(gpu_pages: int, host_pages: int = 0, chunk: int = 64, step_tokens: int = 16,
               page: int = PAGE, num_layers: int = 1, attention_prefix: int = 1 << 30,
               host_claim=None, **settings) -> Scheduler:  # fmt: skip
    """A scheduler over a fixed layout (no planner): its pools as given; ``settings``: the
    rest of its :class:`SchedulerSettings`."""
    blocks = BlockManager(page, gpu_pages, host_pages)
    settings = SchedulerSettings(
        max_batch=4,
        num_slots=8,
        chunk=chunk,
        step_tokens=step_tokens,
        num_layers=num_layers,
        attention_prefix=attention_prefix,
        **settings,
    )
    return Scheduler(blocks, settings, host_claim=host_claim)


def _ran(plan) -> None:
    """What the engine does after running a plan: each decoded or finished prompt has one
    more token on its way to the host."""
    for seq in plan.decode:
        seq.num_pending += 1
    if plan.prefill is not None and plan.prefill.last:
        plan.prefill.seq.num_pending += 1


def _pieces(plans) -> list[tuple[int, int]]:
    return [(p.prefill.start, p.prefill.end) for p in plans if p.prefill is not None]


def _until_first_token(scheduler: Scheduler, seq: Sequence) -> list:
    """Add ``seq`` and step until its prompt is complete; the plans of those steps."""
    scheduler.add(seq)
    plans = []
    while seq.num_pending == 0:
        plans.append(scheduler.schedule())
        _ran(plans[-1])
    return plans


def test_a_prompt_alone_takes_whole_chunks_and_beside_decoding_ones_pieces():
    scheduler = _scheduler(gpu_pages=32)
    first = Sequence(0, list(range(100)), 110)
    plans = _until_first_token(scheduler, first)
    assert plans[0].admitted is first
    assert _pieces(plans) == [(0, 64), (64, 100)]  # nothing decodes: whole chunks
    assert all(not p.decode for p in plans)
    second = Sequence(1, list(range(50)), 60)
    plans = _until_first_token(scheduler, second)
    assert _pieces(plans) == [(0, 16), (16, 32), (32, 48), (48, 50)]  # between its tokens
    assert all(p.decode == [first] for p in plans)
    assert scheduler.schedule().decode == [first, second]


def test_one_prompt_is_prefilled_at_a_time_in_arrival_order():
    scheduler = _scheduler(gpu_pages=32)
    seqs = [Sequence(i, list(range(40)), 45) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    admitted = []
    for _ in range(6):
        plan = scheduler.schedule()
        admitted += [plan.admitted.seq_id] if plan.admitted is not None else []
        assert plan.prefill is None or plan.prefill.seq is seqs[len(admitted) - 1]
        _ran(plan)
    assert admitted == [0, 1, 2]


def _admission_order(scheduler: Scheduler, seqs: list[Sequence]) -> list[int]:
    """Add ``seqs`` at once and step until every one is admitted: their ids in that order."""
    for seq in seqs:
        scheduler.add(seq)
    admitted = []
    while len(admitted) < len(seqs):
        plan = scheduler.schedule()
        admitted += [plan.admitted.seq_id] if plan.admitted is not None else []
        _ran(plan)
    return admitted


def test_the_shortest_waiting_prompt_goes_first_but_none_is_passed_over_past_its_bound():
    lengths = [60, 20, 30, 10]  # (the scheduler's batch: 4)

    def order(passes: int) -> list[int]:
        seqs = [Sequence(i, list(range(n)), n + 2) for i, n in enumerate(lengths)]
        return _admission_order(_scheduler(gpu_pages=64, passes=passes), seqs)

    assert order(0) == [0, 1, 2, 3]  # arrival order
    assert order(16) == [3, 1, 2, 0]  # shortest first
    # the 60-token prompt is passed over by the 10 and the 20, then goes first
    assert order(2) == [3, 1, 0, 2]


def test_abort_mid_prefill_frees_its_pages_and_the_next_prompt_starts():
    scheduler = _scheduler(gpu_pages=32)
    long, short = Sequence(0, list(range(200)), 210), Sequence(1, list(range(20)), 30)
    scheduler.add(long)
    scheduler.add(short)
    plan = scheduler.schedule()
    assert plan.admitted is long and plan.prefill.end == 64
    scheduler.abort(long)
    assert long.finish_reason == "abort"
    assert scheduler.blocks.pools[GPU].num_free == 32
    plan = scheduler.schedule()
    assert plan.admitted is short and (plan.prefill.start, plan.prefill.end) == (0, 20)


def test_a_waiting_request_aborted_never_runs():
    scheduler = _scheduler(gpu_pages=32)
    first, second = Sequence(0, list(range(20)), 30), Sequence(1, list(range(20)), 30)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.abort(second)
    plans = [scheduler.schedule() for _ in range(3)]
    assert [p.admitted for p in plans if p.admitted is not None] == [first]
    assert not scheduler.waiting


def test_a_prefilling_prompt_is_never_swapped_out():
    """Optimistic admission: a decoding sequence that needs a page swaps out one past its
    prompt, never the one being prefilled (its pages are being written)."""
    scheduler = _scheduler(gpu_pages=13, host_pages=16, step_tokens=4, page=4,
                           host_claim=lambda pages, rows, keep: True)  # fmt: skip
    scheduler.tiers, scheduler.optimistic = (GPU,), True
    old = Sequence(0, list(range(8)), 40)  # two pages of 4 tokens, one more every 4 tokens
    _until_first_token(scheduler, old)
    new = Sequence(1, list(range(40)), 44)  # ten pages, prefilled 4 tokens a step
    scheduler.add(new)
    for _ in range(10):
        plan = scheduler.schedule()
        assert new not in scheduler.swapped
        _ran(plan)
        if plan.swap_out:
            break
    assert old in scheduler.swapped and plan.prefill.seq is new  # still being prefilled
    assert plan.prefill.start == 16 and not plan.decode  # its next piece, a whole chunk now
    assert len(plan.swap_out) == 3 and scheduler.blocks.pools[HOST].num_free == 13


def test_a_sequence_with_no_room_to_swap_out_ends_alone_and_its_pages_go_back():
    """Optimistic admission where the host budget has no room for a victim's pages: that
    sequence ends (finish reason "error", in the plan's ``ended``), never the step or the
    others; the pages it held go back and the others take their next token."""
    scheduler = _scheduler(gpu_pages=5, host_pages=1,
                           host_claim=lambda pages, rows, keep: pages <= 1)  # fmt: skip
    scheduler.tiers, scheduler.optimistic = (GPU,), True
    first, second = Sequence(0, list(range(30)), 80), Sequence(1, list(range(30)), 80)
    _until_first_token(scheduler, first)
    _until_first_token(scheduler, second)  # 2 pages each, one free
    ended = []
    for _ in range(40):
        plan = scheduler.schedule()
        _ran(plan)
        ended += plan.ended
        if ended:
            break
    assert ended == [second] and second.finish_reason == "error"
    assert plan.decode == [first] and not plan.swap_out
    assert second not in scheduler.running and not scheduler.swapped
    pool = scheduler.blocks.pools[GPU]
    assert pool.num_pages - pool.num_free == len(scheduler.blocks.table(0, GPU).pages) == 3


def test_two_lanes_short_of_pages_at_once_never_plan_the_same_host_bytes():
    """Two lanes' schedulers share one host budget with room for one victim's pages, and
    both run short of GPU pages before either lane grows its arena (they schedule on their
    own threads): the first swaps its victim out, the second's victim ends alone, and both
    growths then fit (before claims, both planned the swap and the second growth raised
    inside its step, stopping the engine)."""
    import torch

    from headspace.kv.host_store import HostKVArena, HostLedger
    from headspace.kv.spec import KVSpec

    spec = KVSpec(2, 2, 4, 8, 4)
    ledger = HostLedger(3 * spec.full_page_bytes)  # a victim's 2 pages and the scratch page
    lanes = []
    for _ in range(2):
        arena = HostKVArena(spec, torch.float32, pin=False, budget=ledger)
        scheduler = _scheduler(gpu_pages=5, host_claim=arena.claim)
        scheduler.tiers, scheduler.optimistic = (GPU,), True
        first, second = Sequence(0, list(range(30)), 80), Sequence(1, list(range(30)), 80)
        _until_first_token(scheduler, first)
        _until_first_token(scheduler, second)  # 2 pages each, one free
        lanes.append((scheduler, arena, []))
    for _ in range(40):  # both lanes step; no arena grows yet
        for scheduler, _, plans in lanes:
            plans.append(scheduler.schedule())
            _ran(plans[-1])
    (_, first_arena, first_plans), (_, second_arena, second_plans) = lanes
    assert sum(len(p.swap_out) for p in first_plans) == 2 and not any(p.ended for p in first_plans)
    assert [s.seq_id for p in second_plans for s in p.ended] == [1]
    assert not any(p.swap_out for p in second_plans)
    for plans, arena in ((first_plans, first_arena), (second_plans, second_arena)):
        for plan in plans:
            arena.ensure(plan.host_pages)  # raised for the second lane before claims
    assert first_arena.num_pages == 2 and second_arena.num_pages == 0


def test_where_the_layout_allows_a_chunk_runs_a_few_layers_a_step_beside_decoding_ones():
    """Layer slices: a new prompt beside a decoding one keeps whole chunks (one compiled
    shape) and spreads each chunk's layers over steps, as many a step as its prompt work
    allows (the work of the prompt's first ``step_tokens`` tokens through every layer;
    fewer layers as the prefix grows); alone, a chunk takes every layer at once."""
    scheduler = _scheduler(gpu_pages=64, step_tokens=32, num_layers=8, attention_prefix=64)
    scheduler.layer_slices = True
    first = Sequence(0, list(range(100)), 400)
    plans = _until_first_token(scheduler, first)
    assert [p.prefill.layers for p in plans] == [(0, 8), (0, 8)]  # alone: whole chunks
    second = Sequence(1, list(range(200)), 210)
    plans = _until_first_token(scheduler, second)
    assert all(p.decode == [first] for p in plans)  # its token at every step
    slices = [(p.prefill.start, p.prefill.end, p.prefill.layers) for p in plans]
    # a step's work: tokens 0..31 through 8 layers, 8 x 32 x (1 + 16/64) = 320; a layer
    # of tokens 0..63 costs 64 x (1 + 32/64) = 96: three layers a step
    assert slices[:3] == [(0, 64, (0, 3)), (0, 64, (3, 6)), (0, 64, (6, 8))]
    # tokens 64..127: 64 x (1 + 96/64) = 160 a layer, two a step; 128..191: one a step
    assert slices[3:5] == [(64, 128, (0, 2)), (64, 128, (2, 4))]
    assert slices[7:9] == [(128, 192, (0, 1)), (128, 192, (1, 2))]
    assert slices[15:] == [(192, 200, (0, 8))]  # 8 tokens: every layer fits
    assert [p.prefill.last for p in plans] == [False] * (len(plans) - 1) + [True]


def test_an_abort_part_way_through_a_chunks_layers_starts_the_next_prompt_afresh():
    scheduler = _scheduler(gpu_pages=64, step_tokens=16, num_layers=4)
    scheduler.layer_slices = True
    first = Sequence(0, list(range(20)), 40)
    _until_first_token(scheduler, first)
    long, short = Sequence(1, list(range(100)), 110), Sequence(2, list(range(30)), 40)
    scheduler.add(long)
    scheduler.add(short)
    plan = scheduler.schedule()
    assert plan.prefill.seq is long and plan.prefill.layers == (0, 1)
    _ran(plan)
    scheduler.abort(long)
    plan = scheduler.schedule()
    assert plan.prefill.seq is short and plan.prefill.layers == (0, 2)  # 30 a layer, 64 a step
    assert (plan.prefill.start, plan.prefill.end) == (0, 30)


def test_attention_prefix_of_llama3_8b_by_hand():
    """A prompt token's linear layers in one layer of Llama-3-8B: 2 x (4096 x 48 x 128
    (q/k/v) + 4096 x 4096 (o) + 3 x 4096 x 14336 (MLP)) = 436,207,616 FLOPs; its attention:
    4 x 32 x 128 = 16,384 FLOPs a key, so the two match at a prefix of 26,624 tokens."""
    from headspace.engine.memory import attention_prefix
    from headspace.model.config import config_from_dict
    from test_planner import LLAMA3_8B

    assert attention_prefix(config_from_dict(LLAMA3_8B)) == 26624


def test_deep_in_a_long_prompt_a_chunk_is_halved_until_one_layer_fits_a_step():
    """Beside a decoding sequence, a chunk whose single layer would cost more than a step's
    prompt work is halved (down to a page), so that no step carries more than its work;
    halved pieces are not the recurring shape (they run the shape compiled for any
    length)."""
    scheduler = _scheduler(gpu_pages=128, step_tokens=16, num_layers=2, attention_prefix=16)
    scheduler.layer_slices = True
    first = Sequence(0, list(range(20)), 200)
    _until_first_token(scheduler, first)
    long = Sequence(1, list(range(256)), 260)
    plans = _until_first_token(scheduler, long)
    work = 2 * 16 * (1 + 8 / 16)  # tokens 0..15 through both layers: 48
    pieces = [p.prefill for p in plans]
    # tokens 0..63: a layer costs 64 x (1 + 32/16) = 192 > 48, 32 tokens 32 x 2 = 64 > 48,
    # 16 tokens 16 x 1.5 = 24: one page, two layers a step
    assert (pieces[0].start, pieces[0].end, pieces[0].layers) == (0, 16, (0, 2))
    assert not pieces[0].recurs
    for piece in pieces:
        first_layer, end_layer = piece.layers
        cost = (piece.end - piece.start) * (1 + (piece.start + piece.end) / 2 / 16)
        assert (end_layer - first_layer) * cost <= work or piece.end - piece.start == PAGE
    # deep in the prompt a page's single layer exceeds the work: one page, one layer a step
    assert all(p.end - p.start == PAGE and p.layers[1] - p.layers[0] == 1 for p in pieces[-4:])
    assert [(p.start, p.end) for p in pieces if p.through] == [
        (s, s + PAGE) for s in range(0, 256, PAGE)
    ]


def test_a_short_prompt_beside_decoding_ones_is_not_halved_for_tokens_it_lacks():
    """The halving prices what the chunk covers: 40 tokens left of a 64-token chunk cost
    40, within a step's work of 48, so they run as one piece (not 32 + 8)."""
    scheduler = _scheduler(gpu_pages=64, step_tokens=48)
    scheduler.layer_slices = True  # one layer; attention priced as free (a huge prefix)
    first = Sequence(0, list(range(20)), 200)
    _until_first_token(scheduler, first)
    plans = _until_first_token(scheduler, Sequence(1, list(range(40)), 60))
    assert _pieces(plans) == [(0, 40)] and plans[0].decode == [first]


def test_where_the_prefix_streams_a_chunk_is_never_halved():
    """A streamed layout stages each piece's whole prefix from host pages: halving would
    multiply what crosses PCIe, so chunks keep their size (a layer a step deep in)."""
    scheduler = _scheduler(gpu_pages=128, step_tokens=16, num_layers=2, attention_prefix=16)
    scheduler.layer_slices = True
    scheduler.prefix_streams = True
    _until_first_token(scheduler, Sequence(0, list(range(20)), 200))
    plans = _until_first_token(scheduler, Sequence(1, list(range(256)), 260))
    pieces = [p.prefill for p in plans]
    assert {(p.start, p.end) for p in pieces} == {(s, s + 64) for s in range(0, 256, 64)}
    assert all(p.layers[1] - p.layers[0] == 1 and p.recurs for p in pieces)


def _first_queued_piece(slices: bool, slowdown: float, queued: bool):
    """The first piece of a 192-token prompt beside one decoding sequence, with another
    prompt waiting behind it or not: 8 layers, attention free, a step's work that of 16
    tokens (128), a decode step's 8 x 100 (each layer's weights as long as 100 tokens)."""
    scheduler = _scheduler(gpu_pages=64, chunk=256, step_tokens=16, num_layers=8,
                           decode_rates=(100.0, 0.0), prefill_slowdown=slowdown)  # fmt: skip
    scheduler.layer_slices = slices
    _until_first_token(scheduler, Sequence(0, list(range(20)), 400))
    scheduler.add(Sequence(1, list(range(192)), 200))
    if queued:
        scheduler.add(Sequence(2, list(range(40)), 50))
    plan = scheduler.schedule()
    assert plan.decode and plan.prefill.seq.seq_id == 1
    return plan.prefill


def test_while_prompts_wait_a_step_carries_prompt_work_up_to_the_slowdown():
    """With a prompt waiting, the step beside decoding sequences takes up to
    ``prefill_slowdown`` times the decode step's work (here (3 - 1) x 800 = 1,600 against
    128): layer slices of a chunk run more layers a step, and a piece through every layer
    more tokens (whole pages). Nothing waiting, or a slowdown of 1: the step as before."""
    sliced = _first_queued_piece(slices=True, slowdown=3, queued=True)
    assert (sliced.start, sliced.end, sliced.layers) == (0, 192, (0, 8))  # 192 x 8 <= 1,600
    for slowdown, queued in ((3, False), (1, True)):
        piece = _first_queued_piece(slices=True, slowdown=slowdown, queued=queued)
        # a layer of 192 tokens costs more than 128: halved to 64 tokens, one layer a step
        # (two would cost a hair more than 128, attention's 32 / 2^30 a token included)
        assert (piece.start, piece.end, piece.layers) == (0, 64, (0, 1))
    piece = _first_queued_piece(slices=False, slowdown=3, queued=True)
    assert (piece.end, piece.layers) == (192, (0, 8))  # 16 x 1,600 / 128 = 200: 192
    for slowdown, queued in ((3, False), (1, True)):
        piece = _first_queued_piece(slices=False, slowdown=slowdown, queued=queued)
        assert (piece.end, piece.layers) == (16, (0, 8))


def _first_mixed_piece(slowdown: float, queued: bool, context: int = 30, paced: bool = False,
                       floor: int = 0):  # fmt: skip
    """The first piece of a 640-token prompt beside one decoding sequence (of ``context``
    tokens) in a layout that mixes them, another prompt waiting or not, for requests given
    at once or arriving one by one (``paced``, a piece of at least ``floor`` tokens' work):
    8 layers, chunks of 512, a step's work that of 16 tokens, a layer's weights as long as
    100 tokens' linear layers and a context token's K/V as 0.5 of one."""
    scheduler = _scheduler(gpu_pages=128, chunk=512, step_tokens=16, num_layers=8,
                           decode_rates=(100.0, 0.5), prefill_slowdown=slowdown,
                           mixed_slowdown=slowdown, mixed_floor=floor)  # fmt: skip
    scheduler.mixes, scheduler.paced = True, paced
    _until_first_token(scheduler, Sequence(0, list(range(context)), context + 200))
    scheduler.add(Sequence(1, list(range(640)), 650))
    if queued:
        scheduler.add(Sequence(2, list(range(40)), 50))
    plan = scheduler.schedule()
    assert plan.decode and plan.prefill.seq.seq_id == 1 and plan.mixed
    assert plan.prefill.layers == (0, 8)  # through every layer, in the decode rows' forward
    return plan.prefill


def test_a_mixed_step_carries_the_piece_that_keeps_it_within_the_slowdown():
    """A piece run in one forward with the decode rows shares their weights' read: while a
    prompt waits, the step may take ``prefill_slowdown`` times the decode step alone, a
    layer of which costs max(100, 1 row) + 0.5 x 31 context tokens = 115.5 (in prompt
    tokens' work): (3 - 1) x 115.5 + the 99 tokens hidden under the weights' read = 330, 20
    whole pages; with a slowdown of 1 those 99 (6 pages) alone; nothing waiting: the step's
    16. A longer context leaves more (its K/V read is as long whatever the piece): 700 at
    401, capped by the chunk."""
    assert (lambda p: (p.start, p.end))(_first_mixed_piece(3, queued=True)) == (0, 320)
    assert _first_mixed_piece(1, queued=True).end == 96
    assert _first_mixed_piece(3, queued=False).end == 16
    assert _first_mixed_piece(3, queued=True, context=400).end == 512


def test_for_requests_arriving_one_by_one_a_mixed_step_is_capped_whether_prompts_wait_or_not():
    """A server's requests (``paced``): the piece beside the decode rows keeps the step
    within ``mixed_slowdown`` times their decode step alone whether prompts wait or not,
    the step tokens no floor unless given (``mixed_floor``): 320 tokens at a slowdown of 3
    (as above), 96 (the tokens hidden under the weights' read) at 1, queued or not; a floor
    of 200 tokens' work: 192 (whole pages of it)."""
    for queued in (True, False):
        assert _first_mixed_piece(3, queued, paced=True).end == 320
        assert _first_mixed_piece(1, queued, paced=True).end == 96
    assert _first_mixed_piece(1, False, paced=True, floor=200).end == 192


def test_piece_size_by_hand():
    """Whole pages whose layer costs at most the work, attention over the prefix counted
    (here a token's attention over 100 earlier tokens costs as much as its linear layers)."""
    from headspace.engine.piece_work import layer_cost, piece_size

    # from 200: 16 tokens cost 16 x (1 + 208 / 100) = 49.3; 32 cost 32 x 3.16 = 101.1
    assert layer_cost(200, 216, 100) < 100 < layer_cost(200, 232, 100)
    assert piece_size(200, 1000, 100.0, 16, 512, 100) == 16
    assert piece_size(200, 210, 100.0, 16, 512, 100) == 10  # the prompt ends first
    assert piece_size(0, 1000, 1.0, 16, 512, 1 << 30) == 16  # at least a page
    assert piece_size(0, 1000, 1e9, 16, 40, 1 << 30) == 40  # at most ``most``


def test_decode_rates_of_llama3_8b_by_hand():
    """Llama-3-8B in bf16 at 790 TFLOP/s and 3 TB/s: a layer's weights (2 bytes a
    parameter) read in the time a prompt token's linear layers take 790 / 3 = 263.3 times
    over; a context token's K/V (2 x 8 x 128 x 2 = 4,096 bytes) in 1.365 ns against a prompt
    token's 436,207,616 FLOPs there, 552.2 ns: 0.00247."""
    import pytest

    from headspace.engine.memory import decode_rates
    from headspace.model.config import config_from_dict
    from test_planner import LLAMA3_8B

    weights, kv = decode_rates(config_from_dict(LLAMA3_8B), 2, 790e12, 3.0e12)
    assert weights == pytest.approx(263.33, abs=0.01)
    assert kv == pytest.approx(4096 / 3.0e12 / (436207616 / 790e12), rel=1e-3)


def test_a_layout_whose_host_pages_another_lane_claimed_meanwhile_waits_and_is_planned_again():
    """The layout step claims its plan's host pages at once; where another lane claimed
    them since the plan was chosen, the step is empty (nothing laid out, nothing admitted)
    and the next step plans again, then lays out once the claim is granted."""
    from types import SimpleNamespace

    class Planner:
        chosen = 0

        def choose(self, queue):
            self.chosen += 1
            return SimpleNamespace(num_host_pages=6, host_rows=0), None

    grants = iter([False, True])
    claims = []

    def host_claim(pages, rows, keep):
        claims.append((pages, rows, keep))
        return next(grants)

    scheduler = _scheduler(gpu_pages=8, host_pages=0, host_claim=host_claim)
    scheduler.planner = planner = Planner()
    scheduler.add(Sequence(0, list(range(30)), 40))
    first = scheduler.schedule()
    assert first.layout is None and first.admitted is None and not first.decode
    second = scheduler.schedule()
    assert second.layout is not None and second.host_pages == 6
    assert planner.chosen == 2 and claims == [(6, None, False), (6, None, False)]


def test_a_layout_with_room_only_if_the_cached_host_prefixes_go_drops_them():
    """Cached prefixes in host pages are kept (copied over) as the arena grows for a new
    layout, unless keeping them is what leaves no room: the layout is then laid out over
    a fresh arena and the host pool forgets them."""
    from types import SimpleNamespace

    class Planner:
        def choose(self, queue):
            return SimpleNamespace(num_host_pages=6, host_rows=0), None

    claims = []

    def host_claim(pages, rows, keep):
        claims.append(keep)
        return not keep  # room only without the old arena beside the new one

    scheduler = _scheduler(gpu_pages=8, host_pages=4, host_claim=host_claim)
    scheduler.planner = Planner()
    host = scheduler.blocks.pools[HOST]
    page = host.allocate()
    host.register(page, b"a cached prefix")
    host.release(page)
    assert host.num_kept == 1
    scheduler.add(Sequence(0, list(range(30)), 40))
    plan = scheduler.schedule()
    assert plan.layout is not None and plan.host_kept is False and claims == [True, False]
    assert host.num_kept == 0 and host.lookup(b"a cached prefix") is None


def test_a_refused_host_growth_ends_the_prompt_it_was_for_and_moves_a_new_token_below():
    """Heads stream (every sequence in both tiers): a prompt admitted onto host pages grew
    the host pool, and in the same step a decoding sequence's new token took one of the
    new pages. The arena cannot grow after all (page-locking refused): the prompt ends,
    the decoding one keeps going on a page the arena holds, the pool shrinks back; its
    piece was to run in the decode rows' forward (a layout that mixes them): the step is a
    plain decode step now."""
    scheduler = _scheduler(gpu_pages=32, host_pages=4, host_claim=lambda pages, rows, keep: True)
    scheduler.tiers, scheduler.mixes = (GPU, HOST), True
    first = Sequence(0, list(range(16)), 40)  # its prompt fills host page 0
    _until_first_token(scheduler, first)
    second = Sequence(1, list(range(100, 148)), 60)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert plan.admitted is second and plan.host_pages > 4 and plan.decode == [first]
    assert scheduler.blocks.table(0, HOST).pages[-1] >= 4  # a new page for its token
    assert plan.mixed
    scheduler.host_refused(4, plan)
    assert plan.ended == [second] and second.finish_reason == "error"
    assert plan.admitted is None and plan.prefill is None and plan.host_pages == 0
    assert not plan.mixed
    assert plan.decode == [first] and max(plan.decode_pages[HOST][0]) < 4
    host = scheduler.blocks.pools[HOST]
    assert host.num_pages == 4 and host.num_free == 2


def test_the_widest_mixed_piece_is_the_first_piece_the_cap_gives():
    """What a server's warm-up captures mixed graphs for: the piece a prompt's first step
    takes beside so many decode rows of so much context (as in the tests above: 320 tokens
    at a slowdown of 3 beside one row of 31 tokens, 96 at 1), growing with their context
    (their K/V read as long whatever the piece: the chunk's 512 at 401)."""
    scheduler = _scheduler(gpu_pages=128, chunk=512, step_tokens=16, num_layers=8,
                           decode_rates=(100.0, 0.5), mixed_slowdown=3)  # fmt: skip
    assert scheduler.widest_mixed_piece(1, 31) == 320
    assert scheduler.widest_mixed_piece(1, 401) == 512
    slow = _scheduler(gpu_pages=128, chunk=512, num_layers=8, decode_rates=(100.0, 0.5))
    assert slow.widest_mixed_piece(1, 31) == 96
