"""How fast ours could reach the race's target at all: each seed of a finished race replayed at
this CPU's compute floor, against TRL's measured time.

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python bench/race_floor.py runs/race-5seeds

For each seed of a race written by bench/bench_vs_trl.py, ours' own logs say what it computed up
to the step of its first checkpoint at the target: every batch its replicas generated with the
adapters before that step (rollout-*.log: the groups, each a prompt and G samples of T tokens;
the logs do not name the prompts, so their lengths are the task's first 64 chat-templated
prompts', in turn) and every trainer step (its groups and completion tokens, the bucket's
metrics). Each is priced at the
floor (bench/bench_generate.py's: the matmuls that must be done over the best fp32 rate this CPU
reaches on each of them, here the best over 64-512 rows and the three layouts, in CPU seconds,
divided by --threads cores). A trainer step is priced as twice its forward (the backward through
the frozen base maps costs one forward; the LoRA, attention and the rest are left out). Nothing
else counts: no model load, HTTP, adapter publishing, evaluation, or waiting. So each number is
below what any implementation of ours' algorithm and settings could take here.

  made      groups generated before the target step (the leases' overshoot included: the run's
            stale share is printed; a lease policy with no overshoot saves at most that)
  floor s   generation + trainer floor, wall seconds at --threads cores
  start s   the training banner to the trainer's first wait for groups (imports, model load)
  ours s    ours' measured time to the target; "of floor": floor s / ours s
  bound     floor s / TRL's measured time to the target: ours' ratio could not be lower
  last line the median bound, and the least fraction of the floor both roles must run at for the
            median ratio to reach --ratio: with nothing else, and with ours' start-up as measured
            ("> 1": not even at the floor)
"""

import argparse
import ast
import glob
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import torch  # noqa: E402

from support import buckets
from bench_generate import linear_rate, model_shapes, work  # noqa: E402

BATCH = re.compile(r"batch \d+ v(\d+) \(trainer v\d+\) (\d+) groups .* gen [\d.]+s")


def best_rates(config, rows=(64, 128, 256, 384, 512)):
    """{(in, out): the best FLOP/s in CPU time of any measured row count and layout}."""
    layer, head = model_shapes(config)
    layouts = ("linear", "columns") + (("packed",) if torch.backends.mkl.is_available() else ())
    return {(i, o): max(linear_rate(r, i, o, trials=3, layout=lay) for r in rows for lay in layouts)
            for i, o in set(layer) | {head}}


def floor_cpu_s(mm, attn_flops, best):
    """CPU seconds of {(rows, in, out): count} and the attention FLOPs at the best rates."""
    return (sum(2 * r * i * o * c / best[(i, o)] for (r, i, o), c in mm.items())
            + attn_flops / max(best.values()))


def seed_floor(run_dir, metrics, step, prompt_lens, prefix, config, best, G, T):
    """(groups made, generation CPU s, trainer CPU s) of ours before its checkpoint `step`, from
    its replicas' logs in run_dir and its trainer's `metrics` (buckets.read_metrics)."""
    made = []
    for path in glob.glob(os.path.join(run_dir, "rollout-*.log")):
        with open(path) as f:
            made += [int(m.group(2)) for m in map(BATCH.search, f) if m and int(m.group(1)) < step]
    gen = 0.0
    for n in made:  # n prompts (the run's prompts' lengths, in turn), G rows each, T tokens
        lens = [prompt_lens[k % len(prompt_lens)] for k in range(n)]
        gen += floor_cpu_s(*work(config, lens, prefix, n * G, T), best)
    layer, head = model_shapes(config)
    train = 0.0
    for m in (m for m in metrics if m["step"] <= step):
        # the step's forward: each prompt once (the common prefix once), every completion token;
        # the LM head on the completion tokens; the backward through the frozen maps as much again
        rows = prefix + sum(n - prefix for n in prompt_lens[:m["groups"]]) + m["tokens"]
        mm = {(m["tokens"], *head): 1}
        for i, o in layer:
            mm[(rows, i, o)] = mm.get((rows, i, o), 0) + config.num_hidden_layers
        train += 2 * floor_cpu_s(mm, 0, best)
    return sum(made), gen, train


def needed(rows, ratio, with_start):
    """The least fraction e of the floor at which the median of (floor / e [+ start]) / TRL's
    time is at most `ratio` (bisection: the median falls as e grows); "> 1": not even at it."""
    def median_at(e):
        return statistics.median((f / e + with_start * s) / t for f, s, t in rows)
    if median_at(1.0) > ratio:
        return f"> 1 (median {median_at(1.0):.3f}x at the floor)"
    lo, hi = 1e-3, 1.0
    for _ in range(50):
        lo, hi = (lo, (lo + hi) / 2) if median_at((lo + hi) / 2) <= ratio else ((lo + hi) / 2, hi)
    return f"{hi:.2f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("race", help="a bench_vs_trl.py --out folder (its result.json)")
    p.add_argument("--model", default=os.path.join(ROOT, "runs/models/smollm2-135m-instruct"),
                   help="the race's --model")
    p.add_argument("--threads", type=int, default=2, help="cores the floor's CPU time spreads on")
    p.add_argument("--ratio", type=float, default=0.2, help="the median ratio asked for")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    with open(os.path.join(a.race, "result.json")) as f:
        race = json.load(f)
    from transformers import AutoConfig, AutoTokenizer

    from support.rewards import templated
    from support.tasks import load_task
    config, tok = AutoConfig.from_pretrained(a.model), AutoTokenizer.from_pretrained(a.model)
    G, T = int(race["settings"]["NUM_GENERATIONS"]), int(race["settings"]["MAX_NEW_TOKENS"])
    prompts = [templated(tok, row["prompt"])[1] for row in load_task(race["settings"]["TASK"],
                                                                      "train")[:64]]
    prefix = len(os.path.commonprefix(prompts))
    best = best_rates(config)
    print(f"{a.model}: best fp32 rates in CPU time, GFLOP/s: " + ", ".join(
        f"{i}->{o} {v / 1e9:.0f}" for (i, o), v in sorted(best.items())) + f"; {a.threads} cores")
    print("| seed | step | made | stale share | generation s | trainer s | floor s | start s "
          "| ours s | of floor | TRL s | bound | measured |")
    print("|---" * 13 + "|")
    rows = []
    for seed, row in sorted(race["per_seed"].items(), key=lambda kv: int(kv[0])):
        step, t_trl = row["ours_step_to_target"], row["trl_time_to_target"]
        if step is None or t_trl is None:
            print(f"| {seed} | not reached by one side: no bound |" + " |" * 11)
            continue
        with open(os.path.join(a.race, f"seed-{seed}", "ours.json")) as f:
            ours = json.load(f)
        metrics = buckets.read_metrics(os.path.join(ours["run_dir"], "bucket"))
        made, gen, train = seed_floor(ours["run_dir"], metrics, step, [len(x) for x in prompts],
                                      prefix, config, best, G, T)
        with open(os.path.join(ours["run_dir"], "proxy.log")) as f:
            counts = re.search(r"stopped: ({.*?})", f.read())
        c = ast.literal_eval(counts.group(1)) if counts else {}
        stale = c.get("dropped_stale", 0) / max(1, c.get("received", 0))
        # the start-up: the training banner to the trainer's first wait for groups
        first = next(m for m in metrics if m["step"] == 1)
        start = ours["curve"][0]["t"] - first["wait_s"] - first["compute_s"]
        floor = (gen + train) / a.threads
        rows.append((floor, start, t_trl))
        print(f"| {seed} | {step} | {made} | {stale:.2f} | {gen / a.threads:.1f} | "
              f"{train / a.threads:.1f} | {floor:.1f} | {start:.1f} | "
              f"{row['ours_time_to_target']:.1f} | {floor / row['ours_time_to_target']:.2f} | "
              f"{t_trl:.1f} | {floor / t_trl:.3f}x | {row['ratio']:.3f}x |")
    if rows:
        print(f"median bound {statistics.median(f / t for f, _, t in rows):.3f}x over {len(rows)} "
              f"seeds (measured {race['median_ratio']:.3f}x). For a median of {a.ratio}x "
              f"both roles must run at {needed(rows, a.ratio, False)} of the floor with nothing "
              f"else; {needed(rows, a.ratio, True)} with ours' start-up as measured")




if __name__ == "__main__":
    main()
