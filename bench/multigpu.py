"""Head-parallel balance over several GPUs (Llama-3.1-8B or -70B architecture, random bf16
weights):
per solver, each rank's attention time and their imbalance, prefill and decode throughput
against uniform's, scaling over GPU counts, and the cost model's predicted attention step
against the measured one.

    PYTHONPATH=src python bench/multigpu.py [--gpus 1 2 4] [--context 131072]
        [--solvers uniform greedy ga fairkv copy_search uniform-again]
        [--scenario duo|ada_snapkv|patterns|copies] [--copy-cost PATH] [--copy-seconds S]
        [--sharpen 0.25 4] [--batch 1] [--balance-phase auto|prefill|decode] [--work DIR]
        [--model llama3-8b|llama3-70b|qwen2.5-7b|qwen2.5-3b] [--layers N] [--balance-batch N]
        [--trace DIR] [--kv-budget N] [--warmup-batch N] [--stand-in] [--served-rate]

``--model llama3-70b --layers 40`` is Llama-3.1-70B's shape (64 query heads over 8 kv heads,
hidden 8192) at 40 of its 80 layers: 72 GB of bf16 weights, which every rank builds whole
before the engine shards them, so the layer count is what one GPU holds.

The driver first measures the heads' uneven loads on this model (``--scenario``):

- ``duo`` (the default): DuoAttention's split, half the heads ``streaming(4,1024)`` (sink
  and window only) and the others under Ada-SnapKV at ``kv_budget=0.25``.
- ``ada_snapkv``: every head under Ada-SnapKV at ``kv_budget=0.25``.
- ``patterns``: half the heads ``vertical_slash(1000,2048)`` at prefill.
- ``copies``: FairKV's regime, every head under Ada-SnapKV at 1,024 tokens a head on
  average, decode priced at the batch served (``balance_batch``: ``--batch 64 --decode 160
  --context 4096``). Copies pay where whole heads cannot level a layer, one kv head a rank
  (``--model qwen2.5-7b --gpus 4``; ``--model qwen2.5-3b --gpus 2``), at a large batch
  (``--batch 256 --balance-phase decode``): over the Llama-3.1-8B copies run's shares (its
  first 4 kv heads of 28 layers, each layer's rescaled to a mean of 1), the cost model
  predicts the decode attention step at 3.37 ms uniform and 1.98 ms with copy_search at
  256 rows (0.94 and 0.90 at 64). ``--decode`` must exceed ``--batch`` (a prompt's prefill
  takes a step, in which those before it decode) for the whole batch to decode together in
  the steps timed. Result:
  ``multigpu_copies_<model>_<gpu>x<N>_<date>``, with ``copy_cost_us`` from
  ``bench/profiles/copy_cost.py``'s result (``--copy-cost PATH``, same machine) and
  ``run_to_run_spread`` (``uniform-again`` against ``uniform``); ``--copy-seconds S`` sets
  the engine's ``copy_seconds`` (0: copies free), the result named ``...-copy<S in us>us_...``.

Budgets come with FairKV's statistical profile: the tokens the policy gives each (layer, kv
head) over a prompt of the context's length (another seed than the benchmark's), written as
the profile's budget shares, which the solvers price; at run time the engine compresses by
the same policy. Patterns come with the profile's pattern milliseconds measured on this GPU.
Which heads take a pattern is a ranking by random scores: on random weights no head
retrieves, so the split, not the choice, is what the run shows. Random weights also attend
alike in every head, so a budget policy keeps about as much in each (shares 0.89-1.14 at
128K); ``--sharpen LOW HIGH`` scales each kv head's key rows by a factor drawn log-uniformly
from that range (seeded, the same model for the profile and every run), so heads range from
diffuse to sharp as a trained model's do, and the policy's measured shares differ as
FairKV's profiles do. ``--batch N`` serves N prompts of the context at once: decode then
reads N histories a step against one read of the weights, the regime FairKV measures (its
decode rate: N over the median synchronised step that decodes all N; its prefill rate: the
N prompts over the time to the last one's first token).

Then one ``torchrun --nproc-per-node N`` per GPU count runs every solver in turn, each on a
fresh model (the engine shards it in place), built as a user builds it under torchrun: the
model's context, default options plus the scenario's and ``balance``. Each rank times its
attention (CUDA events around every layer's tiers' submits; the copies' log-sum-exp
exchange excluded; with ``--batch N``, its decode over the steps of all N alone) through one
prompt of ``--context`` tokens and ``--decode`` tokens, after an untimed request of the same
length that compiles and tunes the kernels for its shapes. Writes
``multigpu_<model>-<scenario>_<gpu>x<N>_<date>.json`` (N the most GPUs run) and a PNG of
each rank's attention per solver to bench/results ($OUT when set). ``--work DIR`` keeps the
profile and each GPU count's run of each solver in DIR and reuses those already there, so
a long invocation can be split over several calls (``--gpus 1 2``, then ``--gpus 1 2 4``;
``--solvers uniform greedy``, then all four); a call cut short keeps the solvers it ran.
``--stand-in`` (a budget's scenario) decodes over pages at the lengths the budget's policy
kept of the run's first prompts (``bench/stand_in.py``: measured on one GPU with the
profile, the prompts not computed): the decode figures of a batch whose prefills would take
minutes a solver (256 prompts of 32K), its prefill not measured (``null``).
``--served-rate`` times the batch's decode as the engine runs it, not step by step
synchronised: the median pace from one full-batch step's start to the next's (the host
plans a step while the GPU runs the one before), the rate a server of the batch sees; it
runs without the attention timer (whose reads wait for each step), so the per-rank
attention and imbalance figures come from a synchronised run.
``--trace DIR`` writes a torch profiler trace of three of each solver's timed decode steps
per rank, and a table of its ops (``bench/step_trace.py``).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_timer import AttentionTimer  # noqa: E402
from common import (  # noqa: E402
    NoText,
    environment,
    gpu_tag,
    measure_hbm_bandwidth,
    model_config,
    model_tag,
    ran_view,
    random_model,
    sharpen_heads,
    write_result,
)
from multigpu_args import command_line  # noqa: E402
from multigpu_batch import (  # noqa: E402
    decode_layer_floor_bytes,
    placement_of,
    prompt,
    run_prompts,
    timed_batch,
)
from multigpu_report import (  # noqa: E402
    copies_keys,
    describe,
    plot,
    predicted_loads,
    print_table,
    summarise,
)
from multigpu_work import kept_runs, missing_runs, prepare_work, wanted_solvers  # noqa: E402
from stand_in import KEPT_FILE, MEASURED_PROMPTS, measure_kept, stand_in  # noqa: E402

SCENARIOS = {
    "duo": {"kv_budget": 0.25, "kv_policy": "ada_snapkv", "retrieval_heads": 0.5,
            "sparse_pattern": "streaming(4,1024)"},
    "ada_snapkv": {"kv_budget": 0.25, "kv_policy": "ada_snapkv"},
    "patterns": {"retrieval_heads": 0.5, "sparse_pattern": "vertical_slash(1000,2048)"},
    # FairKV's regime: small absolute budgets, a large batch (attention a large part of it)
    "copies": {"kv_budget": 1024, "kv_policy": "ada_snapkv", "max_batch": 128},
}  # fmt: skip
# ``uniform-again``: uniform run a second time on a fresh engine (the run-to-run spread)
SOLVERS = ("uniform", "greedy", "ga", "fairkv", "copy_search", "uniform-again")


# -- the profile (one GPU) -------------------------------------------------------------------
def make_profile(cfg: dict, scenario: str, context: int, path: Path, sharpen=None,
                 stand_in_prompts: list[list[int]] | None = None) -> dict:  # fmt: skip
    """The scenario's measured loads on the model of config dict ``cfg`` (as
    ``sharpen_heads`` makes it) as a profile at ``path``; returns a summary. With
    ``stand_in_prompts`` (``--stand-in``), their kept counts beside it
    (``stand_in.KEPT_FILE``)."""
    from headspace.budgets import KVBudget
    from headspace.eval.profile import PATTERNS, budget_shares, pattern_costs
    from headspace.planner.profile import Profile, budget_key

    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    scores = torch.rand(layers, kv_heads, generator=torch.Generator().manual_seed(1)).tolist()
    profile = Profile(
        f"{cfg['num_attention_heads']}q/{kv_heads}kv random",
        layers,
        kv_heads,
        scores,
        device="cuda",
    )
    summary, options = {}, SCENARIOS[scenario]
    if "kv_budget" in options:
        budget = KVBudget(options["kv_budget"], options["kv_policy"])
        model = random_model(cfg)
        sharpen_heads(model, sharpen)
        shares = budget_shares(model, [prompt(cfg, context, seed=2)], budget)
        profile.budget_shares[budget_key(budget.policy, budget.value)] = shares.tolist()
        summary = {"budget_shares": {"min": shares.min().item(), "max": shares.max().item(),
                                     "std": shares.std().item(),
                                     "per_entry": shares.tolist()}}  # fmt: skip
        if stand_in_prompts:
            summary["stand_in"] = measure_kept(model, stand_in_prompts, budget,
                                               path.parent / KEPT_FILE)  # fmt: skip
        del model
    if "sparse_pattern" in options:
        chunk = 8192
        heads = cfg["num_attention_heads"] // kv_heads
        ms = pattern_costs(heads, cfg["head_dim"], [context // 4, context], chunk, "cuda",
                           list(PATTERNS), num_kv_heads=kv_heads)  # fmt: skip
        profile.chunk, profile.pattern_ms = chunk, ms
        summary["pattern_ms"] = ms
    profile.save(path)
    torch.cuda.empty_cache()
    return summary


# -- a worker (one rank under torchrun) ------------------------------------------------------
def scenario_options(args) -> dict:
    """The engine options of the scenario as run: its own, the batch decode is priced at
    (``--balance-batch``; the copies scenario's default: ``--batch``, with a ``max_batch``
    that holds it) and ``--copy-seconds``."""
    options = dict(SCENARIOS[args.scenario])
    balance_batch = args.balance_batch
    if args.scenario == "copies":
        balance_batch = balance_batch or args.batch
        options["max_batch"] = max(options["max_batch"], args.batch)
    options["balance_batch"] = balance_batch or 1
    if args.copy_seconds is not None:  # the solvers' price of a copy, in place of the model's
        options["copy_seconds"] = args.copy_seconds
    return options


def attention_per_rank(timer, num_layers: int, stand_in: bool) -> tuple[dict, list[dict]]:
    """This rank's timed attention seconds (none at the served rate; a stand-in's decode
    only: no prompt ran) and every rank's, in rank order."""
    import torch.distributed as dist

    measured = {} if timer is None else timer.seconds(num_layers)
    if stand_in:
        measured = {key: value for key, value in measured.items() if key.startswith("decode")}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return measured, [measured]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measured)
    return measured, per_rank


def run_solver(solver: str, args, profile: str) -> dict | None:
    """One solver's run on this rank; rank 0 returns what every rank measured."""
    import torch.distributed as dist

    from headspace.engine.config import EngineConfig
    from headspace.engine.engine import Engine
    from headspace.engine.hooks import EngineHooks
    from headspace.engine.ranks import join
    from headspace.parallel.balance import balanced_phases

    options = scenario_options(args)
    balance = solver.removesuffix("-again")
    config = join(EngineConfig.of(device="cuda", profile=profile, balance=balance,
                                  balance_phase=args.balance_phase, **options))  # fmt: skip
    cfg = model_config(args.model, args.layers)
    model = random_model(cfg, device=config.runtime.device)
    sharpen_heads(model, args.sharpen)
    prompts = run_prompts(cfg, args, args.batch)
    # in the engine before the warm-up captures the graphs; none at the served rate (reading
    # a graph's events waits for its step, which would hold the host back from the next)
    timer = None if args.served_rate else AttentionTimer()
    hooks = EngineHooks(attention_hook=timer)
    if args.stand_in:  # decode over pages at measured lengths, prompts not computed
        hooks.prompt_stand_in = stand_in(Path(profile).parent / KEPT_FILE, prompts)
    engine = Engine.from_model(model, NoText(), config, hooks)
    length, batch = args.context - args.decode, args.batch
    every, prefill_s, decode_tok_s, steps = timed_batch(engine, timer, args, cfg, prompts, solver)
    stats = every[0]  # peak memory and KV held: the batch's, alike in every request
    entries = ran_view(engine).plan.head_map.entries
    floor_bytes = decode_layer_floor_bytes(engine, args, options, profile)
    hbm = measure_hbm_bandwidth()
    measured, per_rank = attention_per_rank(timer, model.config.num_layers, args.stand_in)
    world = len(per_rank)
    result = {
        "solver": solver,
        "prefill_tok_s": None if args.stand_in else batch * length / prefill_s,
        "decode_tok_s": decode_tok_s,
        "attention_seconds": {key: [r[key] for r in per_rank] for key in measured},
        "decode_steps_timed": len(steps) if timer is None else timer.num_steps,
        "decode_step_seconds": steps,  # rank 0's steps of the whole batch (--served-rate: paces)
        "peak_gpu_gib": stats.peak_gpu_bytes / 2**30,
        "kv_held_fraction": stats.kv_held_fraction,
        "head_map": ran_view(engine).layout,
        # each entry's layer, kv head, ranks and (for a copied head) each rank's share
        "placement": placement_of(entries),
        # the decode floor: rank 0's weights and, each layer, the K/V its slowest rank reads
        # at the batch's end (bytes), once a step at the measured HBM rate
        "decode_layer_floor_bytes": floor_bytes,
        "decode_layer_floor_tok_s": batch * hbm / floor_bytes,
        "hbm_bytes_per_s": hbm,
    }
    if engine.ranks is not None and dist.get_rank() == 0:
        result["predicted"] = predicted_loads(engine, config, world, batch)
        result["balanced_phase"] = "+".join(balanced_phases(config.parallel.balance_phase))
    if timer is not None:
        timer.close()
    del engine, model, timer, every
    gc.collect()
    torch.cuda.empty_cache()  # the next solver's model and arena size from what is free
    return result


def worker(args) -> None:
    """This rank's part of each solver's run (``single`` on one GPU); rank 0 adds each run to
    ``args.out`` as it finishes, so a call cut short keeps the solvers it finished."""
    import torch.distributed as dist

    solvers = args.solvers if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ["single"]
    out = Path(args.out)
    for solver in solvers:
        result = run_solver("uniform" if solver == "single" else solver, args, args.profile)
        if not dist.is_initialized() or dist.get_rank() == 0:
            kept = json.loads(out.read_text()) if out.exists() else []
            out.write_text(json.dumps([*kept, {**result, "solver": solver}], indent=1))


# -- the driver --------------------------------------------------------------------------------
def runs_of(num_gpus: int, args, work: Path) -> list[dict]:
    """Each wanted solver's run on ``num_gpus`` GPUs: those kept in ``work``, the others
    measured by one torchrun and added there."""
    missing = missing_runs(num_gpus, args, work)
    if missing:
        launch(num_gpus, args, work / f"runs{num_gpus}.json", missing)
    kept = kept_runs(num_gpus, work)
    return [kept[s] for s in wanted_solvers(num_gpus, args)]


def launch(num_gpus: int, args, out: Path, solvers: list[str]) -> None:
    """One torchrun of ``num_gpus`` workers over ``solvers``, each run added to ``out``
    (beside the profile) as it finishes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={num_gpus}", __file__, "--worker", "--out", str(out),
               "--profile", str(out.parent / "profile.json"), "--context", str(args.context),
               "--decode", str(args.decode), "--scenario", args.scenario,
               "--batch", str(args.batch), "--balance-phase", args.balance_phase,
               "--model", args.model]  # fmt: skip
    command += ["--solvers", *solvers] if num_gpus > 1 else []
    command += ["--layers", str(args.layers)] if args.layers else []
    command += ["--sharpen", *map(str, args.sharpen)] if args.sharpen else []
    command += ["--copy-seconds", str(args.copy_seconds)] if args.copy_seconds is not None else []
    command += ["--balance-batch", str(args.balance_batch)] if args.balance_batch else []
    command += ["--kv-budget", str(args.kv_budget)] if args.kv_budget else []
    command += ["--warmup-batch", str(args.warmup_batch)] if args.warmup_batch else []
    command += ["--trace", args.trace] if args.trace else []
    command += ["--stand-in"] if args.stand_in else []
    command += ["--served-rate"] if args.served_rate else []
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "4"})


def main() -> None:
    args = command_line(__doc__.split("\n\n")[0], tuple(SCENARIOS), SOLVERS).parse_args()
    if args.kv_budget:  # the profile, the workers and the result all read the scenario
        SCENARIOS[args.scenario] = {**SCENARIOS[args.scenario], "kv_budget": args.kv_budget}
    if args.worker:
        return worker(args)
    if args.stand_in and "kv_budget" not in SCENARIOS[args.scenario]:
        raise SystemExit(f"--stand-in gives prompts a budget's kept counts: the {args.scenario} "
                         "scenario has no budget")  # fmt: skip
    cfg = model_config(args.model, args.layers)  # a layer count it lacks: refused here
    work = Path(args.work or tempfile.mkdtemp())
    stand_ins = run_prompts(cfg, args, MEASURED_PROMPTS) if args.stand_in else None
    measured = prepare_work(
        work,
        args,
        lambda path: make_profile(cfg, args.scenario, args.context, path, args.sharpen, stand_ins),
    )
    available = torch.cuda.device_count()
    gpus = [n for n in args.gpus if n <= available or not missing_runs(n, args, work)]
    if gpus != args.gpus:
        print(f"this machine has {available} GPUs: running {gpus}")
    runs = {n: runs_of(n, args, work) for n in gpus}  # each run written as it finishes
    env = environment()
    gpu = gpu_tag(env)
    most = max(gpus)
    variant = ("-sharp" if args.sharpen else "") + (f"-b{args.batch}" if args.batch > 1 else "")
    variant += f"-{args.balance_phase}" if args.balance_phase != "auto" else ""
    variant += f"-copy{args.copy_seconds * 1e6:g}us" if args.copy_seconds is not None else ""
    variant += f"-kv{args.kv_budget}" if args.kv_budget else ""
    variant += "-standin" if args.stand_in else ""
    variant += "-served" if args.served_rate else ""
    tag = model_tag(args.model, args.layers)
    name = f"multigpu_{tag}-{args.scenario}{variant}_{gpu}x{most}_{env['date']}"
    if args.scenario == "copies":
        name = f"multigpu_copies_{tag}{variant}_{gpu}x{most}_{env['date']}"
    result = {
        "environment": env,
        # the machine that measured the profile and the first GPU counts' runs (--work)
        "profile_environment": json.loads((work / "environment.json").read_text()),
        "config": {"model": describe(args.model, args.layers), "model_config": cfg,
                   "context": args.context, "decode_tokens": args.decode,
                   "batch": args.batch, "warmup_batch": args.warmup_batch or args.batch,
                   "stand_in": args.stand_in, "served_rate": args.served_rate,
                   "sharpen": args.sharpen,
                   "balance_phase": args.balance_phase, "copy_seconds": args.copy_seconds,
                   "scenario": args.scenario, "options": scenario_options(args)},
        "profile": measured,
        **copies_keys(args.copy_cost, runs[most]),
        **summarise(runs),
        "runs": {str(n): rs for n, rs in runs.items()},
    }  # fmt: skip
    path = write_result(name + ".json", result)
    plot(runs[most], path.with_suffix(".png"))  # (none where nothing was timed: served rate)
    print_table(result, runs)


if __name__ == "__main__":
    main()
