"""Why ours ended below TRL at TRL's settings: two checks (docs/race.md, "At TRL's settings").

    # ours at TRL's settings (synchronous, equal-reward groups kept), one seed per run:
    for s in 0 1 2 3 4; do MODEL=runs/models/smollm2-135m-instruct MAX_STALENESS=0 SEED=$s \
        NAME=gap-sync-keep-seed$s bash jobs.sh --local; done
    .venv/bin/python bench/gap_vs_trl.py runs runs/gap-sync-keep-seed{0,1,2,3,4} \
        --trl 70.3 64.7 74.2 62.3 71.8        # TRL's finals at seeds 0-4 (docs/race.md)
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/gap_vs_trl.py sampler --prompts 64

`runs`: each run's final held-out accuracy (its summary.md), what it trained on per third of the
run (bench_vs_trl.batches: the race's own rows) and the exact rank-sum test of TRL's finals
against ours (race_stats.rank_test). `sampler`: the base model's completions for the same
prompts from ours' hf engine (the fast decode loop, and transformers' generate with our draw)
and from transformers' own sampling (do_sample, top_k 0, top_p 1: TRL's path without vLLM):
the share that ends with EOS, the reward, the length. Equal within noise: the two sides start
from the same distribution.
"""

import argparse
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import bench_vs_trl  # noqa: E402
import race_stats  # noqa: E402


def runs(dirs, trl, G=8, steps=30):
    finals = []
    for d in dirs:
        with open(os.path.join(d, "summary.md")) as f:
            finals.append(float(re.search(r"final adapter\s*\|\s*([\d.]+)%", f.read()).group(1)))
    print("ours' finals:", " / ".join(f"{a:.1f}%" for a in finals),
          f"(median {sorted(finals)[len(finals) // 2]:.1f}%)")
    rows = [b for d in dirs for b in bench_vs_trl.batches({"run_dir": d}, "ours", G)]
    for field, what in bench_vs_trl.BATCH_ROWS:
        spans = bench_vs_trl.spans_of(steps)
        print(f"{what}, ours: " + " | ".join(bench_vs_trl.span_means(rows, field, spans)))
    if trl:
        p = race_stats.rank_test([t / 100 for t in trl], [a / 100 for a in finals])
        print(f"TRL's finals {' / '.join(f'{t:.1f}%' for t in trl)} (median "
              f"{sorted(trl)[len(trl) // 2]:.1f}%): one-sided exact rank-sum p {p:.2f} "
              "(TRL's runs end above ours)")


def sampler(prompts, n=8, max_new_tokens=12,
            model=os.path.join(ROOT, "runs/models/smollm2-135m-instruct")):
    import torch

    from support import tasks
    from support.engines import HFEngine
    from support.rewards import templated

    items = tasks.load_task("arith", "train")[:prompts]
    for name in ("ours, fast decode", "ours, generate + draw_tokens", "transformers sampling"):
        eng = HFEngine(model, seed=0, fast=name == "ours, fast decode")
        ids = [templated(eng.tokenizer, it["prompt"])[1] for it in items]
        t0, done = time.time(), []  # (item, text, ended with EOS, length)
        if name.startswith("ours"):
            for it, samples in zip(items, eng.generate(ids, n, max_new_tokens, 1.0)):
                done += [(it, s.text, s.finish_reason == "stop", len(s.ids)) for s in samples]
        else:
            torch.manual_seed(0)
            for it, p in zip(items, ids):
                x = torch.tensor([p])  # (1, P)
                out = eng.model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                         top_k=0, top_p=1.0, temperature=1.0,
                                         max_new_tokens=max_new_tokens, num_return_sequences=n,
                                         eos_token_id=eng.eos_ids, pad_token_id=eng.pad_id)
                for row in out[:, len(p):].tolist():  # (n, T) the completions
                    end = next((i + 1 for i, t in enumerate(row) if t in eng.eos_ids), None)
                    row = row[:end] if end else row
                    done.append((it, eng.tokenizer.decode(row, skip_special_tokens=True),
                                 end is not None, len(row)))
        k = len(done)
        eos = sum(d[2] for d in done) / k
        reward = sum(tasks.number_reward([d[1]], [d[0]["answer"]])[0] for d in done) / k
        print(f"{name:30s} {k} completions: ended with EOS {eos:.3f} (se "
              f"{(eos * (1 - eos) / k) ** 0.5:.3f}), reward {reward:.3f} (se "
              f"{(reward * (1 - reward) / k) ** 0.5:.3f}), mean length "
              f"{sum(d[3] for d in done) / k:.2f} tokens, {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("runs", help="ours' runs: finals, batches per third, rank test vs TRL")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--trl", nargs="*", type=float, default=[], help="TRL's final accuracies (%)")
    s = sub.add_parser("sampler", help="the base model's samples: ours' engine vs transformers")
    s.add_argument("--prompts", type=int, default=64)
    a = ap.parse_args()
    if a.cmd == "runs":
        runs(a.dirs, a.trl)
    else:
        sampler(a.prompts)
