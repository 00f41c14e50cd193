"""Benchmark: the trainer's step on CPU, tokens/s and peak memory, and the proof that the memory of
the log-prob computation is bounded by one micro-batch, not by vocab x sequence x batch.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench_trainer.py                 # tiny model + SmolLM2-135M: ~6 min
    .venv/bin/python tests/bench_trainer.py --only throughput --smollm2 ''   # the tiny model only

SmolLM2-135M-Instruct is read from --smollm2 (build it offline with
`python scripts/offline_smollm2.py runs/models/smollm2-135m-instruct`). Every measurement runs in a
fresh worker process (this file with --worker), so that its memory is its own. The worker builds
the model as trainer.py does (trainer.build_model: LoRA r 8 on all linear layers, fp32 on CPU),
makes B synthetic sequences (prompt P + completion C random token ids, rewards alternating within
each group of 8), takes one warm-up step, then --repeats timed steps with trainer.py's own
functions: make_microbatches, compute_loss_and_backward (loss dapo), clip_grad_norm_, AdamW.

  tok/s       completion tokens per second of a step (trainer.py's metric), median over the repeats
  step peak   peak RSS during the timed steps minus RSS before them: after the warm-up step, freed
              memory is handed back (malloc_trim) and the high-water mark reset (/proc/self/clear_refs
              = 5), then VmHWM is read from /proc/self/status after the steps
  proc peak   the worker's ru_maxrss (model loading included)
  other CPU   cores that other processes took during the measurement (load that slows the timings)
  logits/mb   float32 logits of the largest micro-batch, n x (C + 1) x V x 4 bytes; "whole batch" is
              what one tensor of logits for all B sequences would take
  peak, mmap  the same step with MALLOC_MMAP_THRESHOLD_=131072: by default glibc raises its mmap
              threshold as large blocks are freed and then keeps freed memory in its heap, where it
              fragments (the RSS creeps up with the number of micro-batches although nothing is
              held); with a fixed threshold a freed tensor goes back to the OS, so the peak is what
              the step really holds at once (and the step is slower: more page faults)
"""

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from bench_async import cpu_seconds  # noqa: E402  (CPU seconds of all CPUs busy, of this process + children)

MB = 2**20
OTHER_CPU = []  # per measurement: CPU cores that other processes took (load that disturbs the timings)
MMAP_THRESHOLD = 128 * 1024  # "peak, mmap": glibc serves every block >= 128 KiB by mmap and unmaps it on free


def rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(a):
    import torch

    import grpo_loss
    import trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = trainer.build_model(a.model, lora_r=8, lora_alpha=16, seed=0)
    V = model.config.vocab_size
    seqs = [{"prompt_ids": torch.randint(10, V, (a.prompt,)).tolist(), "logprobs": [-2.0] * a.completion,
             "ids": torch.randint(10, V, (a.completion,)).tolist(), "reward": float(i % 2), "policy_version": 0,
             "truncated": False} for i in range(a.seqs)]
    advantages = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), 8)  # (B,)
    params = trainer.lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    model.eval()

    def step():
        optimizer.zero_grad(set_to_none=True)
        mbs = trainer.make_microbatches(seqs, a.micro_batch_tokens)
        trainer.compute_loss_and_backward(model, seqs, advantages, mbs)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return mbs

    mbs = step()  # warm-up: optimizer state, allocator pools
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed memory, so the baseline is what is live
    proc_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base = rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    n_max = max(len(mb) for mb in mbs)
    print(json.dumps({"step_s": statistics.median(times), "tok_s": a.seqs * a.completion / statistics.median(times),
                      "all_tok_s": a.seqs * (a.prompt + a.completion) / statistics.median(times),
                      "micro_batches": len(mbs), "base_mb": base / 1024,
                      "step_peak_mb": (rss_kb("VmHWM") - base) / 1024,
                      "proc_peak_mb": max(proc_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024,
                      "logits_mb": n_max * (a.completion + 1) * V * 4 / MB,
                      "whole_mb": a.seqs * (a.completion + 1) * V * 4 / MB, "vocab": V,
                      "params": sum(p.numel() for p in model.parameters()), "lora": sum(p.numel() for p in params)}))


def measure(model, seqs, prompt, completion, mbt, repeats, **env):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--seqs", str(seqs), "--prompt",
           str(prompt), "--completion", str(completion), "--micro-batch-tokens", str(mbt), "--repeats", str(repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    (busy0, own0), t0 = cpu_seconds(), time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"bench: worker failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    busy, own = (b - a for a, b in zip((busy0, own0), cpu_seconds()))
    OTHER_CPU.append(max(0.0, busy - own) / (time.time() - t0))  # cores other processes took meanwhile
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smollm2", default=os.path.join(ROOT, "runs/models/smollm2-135m-instruct"),
                   help="SmolLM2-135M-Instruct folder ('' to leave it out)")
    p.add_argument("--only", choices=["throughput", "memory"], help="one of the two parts")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per throughput measurement (after a warm-up)")
    p.add_argument("--memory-repeats", type=int, default=1, help="timed steps per memory measurement")
    p.add_argument("--out", default="/tmp/bench_trainer", help="where the tiny model is built")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--seqs", "--prompt", "--completion", "--micro-batch-tokens"):
        p.add_argument(flag, help=argparse.SUPPRESS, type=str if flag == "--model" else int)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    import tiny_model

    tiny = tiny_model.build(os.path.join(a.out, "tiny"))
    smol = a.smollm2 if a.smollm2 and os.path.isdir(a.smollm2) else None
    if a.smollm2 and not smol:
        print(f"note: no {a.smollm2}; build it with: python scripts/offline_smollm2.py {a.smollm2}")
    print(f"{os.cpu_count()} CPUs, 1 thread per worker, fp32, LoRA r 8 all-linear, loss dapo; 1 warm-up step, then "
          f"{a.repeats} (throughput) / {a.memory_repeats} (memory) timed", flush=True)

    if a.only != "memory":
        print("\ntrainer step throughput (B sequences of P prompt + C completion tokens, --micro-batch-tokens 8192)")
        print(f"{'model':<10}{'params':>8}{'LoRA':>8}{'B x (P + C)':>19}{'mbs':>5}{'step s':>8}{'tok/s':>8}"
              f"{'all tok/s':>10}{'step peak':>11}{'proc peak':>11}{'other CPU':>10}")
        cases = [("tiny", tiny, 64, 32, 64), ("tiny", tiny, 64, 32, 128)]
        if smol:
            cases += [("SmolLM2", smol, 32, 40, 32), ("SmolLM2", smol, 32, 40, 64)]
        for name, path, B, P, C in cases:
            r = measure(path, B, P, C, 8192, a.repeats)
            print(f"{name:<10}{r['params'] / 1e6:>7.1f}M{r['lora'] / 1e6:>7.2f}M{f'{B} x ({P} + {C})':>19}"
                  f"{r['micro_batches']:>5}{r['step_s']:>8.2f}{r['tok_s']:>8.0f}{r['all_tok_s']:>10.0f}"
                  f"{r['step_peak_mb']:>8.0f} MB{r['proc_peak_mb']:>8.0f} MB{OTHER_CPU[-1]:>10.2f}", flush=True)

    if a.only != "throughput":
        model, name = (smol, "SmolLM2-135M") if smol else (tiny, "tiny")
        P, C = 16, 32
        header = (f"{'B':>5}{'mb tokens':>11}{'mbs':>5}{'logits/mb':>11}{'whole batch':>13}{'step peak':>11}"
                  f"{'step s':>8}{'peak, mmap':>12}{'step s':>8}{'base':>9}{'other CPU':>10}")
        for title, cases in [("batch size B grows, --micro-batch-tokens fixed at 384 (8 sequences)",
                              [(8, 384), (16, 384), (32, 384), (64, 384)]),
                             ("B fixed at 32, --micro-batch-tokens grows (the control: memory must follow it)",
                              [(32, 192), (32, 384), (32, 768), (32, 1536)])]:
            print(f"\nlog-prob memory, {name} (vocab V), P={P}, C={C}: {title}\n{header}")
            for B, mbt in cases:
                r = measure(model, B, P, C, mbt, a.memory_repeats)
                m = measure(model, B, P, C, mbt, a.memory_repeats, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
                print(f"{B:>5}{mbt:>11}{r['micro_batches']:>5}{r['logits_mb']:>8.1f} MB{r['whole_mb']:>10.1f} MB"
                      f"{r['step_peak_mb']:>8.0f} MB{r['step_s']:>8.2f}{m['step_peak_mb']:>9.0f} MB{m['step_s']:>8.2f}"
                      f"{r['base_mb']:>6.0f} MB{max(OTHER_CPU[-2:]):>10.2f}", flush=True)
    print(f"\nother processes took up to {max(OTHER_CPU):.2f} CPU cores during a measurement (mean "
          f"{statistics.mean(OTHER_CPU):.2f})")


if __name__ == "__main__":
    main()
