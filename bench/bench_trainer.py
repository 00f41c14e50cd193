"""Benchmark: the trainer's step on CPU, the shared-prompt forward against the plain one it replaced
(time and peak memory), and the proof that the memory of the log-prob computation is bounded by
one micro-batch, not by vocab x sequence x batch.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_trainer.py                 # tiny model + SmolLM2-135M
    .venv/bin/python bench/bench_trainer.py --only throughput --smollm2 ''   # the tiny model only

SmolLM2-135M-Instruct is read from --smollm2 (build it offline with
`python scripts/offline_smollm2.py runs/models/smollm2-135m-instruct`). Every measurement runs in a
fresh worker process (this file with --worker), so that its memory is its own. The worker builds
the model as trainer.py does (trainer_state.build_model: LoRA r 8 on all linear layers, fp32 on CPU),
makes N groups of G synthetic completions (one random prompt of S + P token ids per group, the first S
the same in every group, as a chat template's system prompt is; random completions of C ids, rewards
alternating within each group), takes one warm-up step, then --repeats timed steps (loss dapo,
clip_grad_norm_, AdamW) with one of two paths:

  new         trainer.py: make_microbatches (whole groups, each prompt counted once),
              compute_loss_and_backward (the common prefix forwarded once, each group's rest of the
              prompt once, the KV caches repeated for the G completions)
  old         the plain path it replaced: rows [prompt | completion] packed by rows, every prompt
              forwarded G times (trainer.plain_logprobs, the reference of the exactness test)

  step s      seconds per step, median over the repeats; speed-up = old / new
  cpu s       CPU seconds of the worker per step (median): less disturbed than step s by other load
  tok/s       completion tokens per second of a step (trainer.py's metric)
  step peak   peak RSS during the timed steps minus RSS before them: after the warm-up step, freed
              memory is handed back (malloc_trim) and the high-water mark reset (/proc/self/clear_refs
              = 5), then VmHWM is read from /proc/self/status after the steps
  other CPU   cores that other processes took during the measurement (load that slows the timings)
  logits/mb   float32 logits of the largest micro-batch, n x C x V x 4 bytes; "whole batch" is
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


def old_microbatches(seqs, max_tokens):
    """The plain path's packing: rows, each costing its prompt + its completion, padding counted."""
    def cost(idx):
        return len(idx) * (max(len(seqs[i]["prompt_ids"]) for i in idx) + max(len(seqs[i]["ids"]) for i in idx))

    batches = []
    for i in sorted(range(len(seqs)), key=lambda i: -(len(seqs[i]["prompt_ids"]) + len(seqs[i]["ids"]))):
        if batches and cost(batches[-1] + [i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def old_loss_and_backward(model, seqs, advantages, microbatches):
    """The plain path's step (loss dapo): each row [pad.. prompt | completion ..pad] forwarded whole."""
    import grpo_loss
    import trainer

    total_tokens = sum(len(s["ids"]) for s in seqs)
    for idx in microbatches:
        old, mask = trainer.completion_tensors(seqs, idx, "cpu")  # (n, C) (n, C): the same
        logps = trainer.plain_logprobs(model, seqs, idx, 1.0)  # (n, C)
        loss, _ = grpo_loss.policy_loss(logps, old, advantages[idx], mask, num_tokens=total_tokens)
        loss.backward()


def worker(a):
    import torch

    import grpo_loss
    import trainer
    from support import shared_prompt, trainer_state

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = trainer_state.build_model(a.model, lora_r=8, lora_alpha=16, seed=0)
    V = model.config.vocab_size
    seqs = []
    shared = torch.randint(10, V, (a.shared,)).tolist()  # the prompts' common prefix
    for k in range(a.groups):  # one prompt per group; rewards alternate within it
        prompt = shared + torch.randint(10, V, (a.prompt - a.shared,)).tolist()
        seqs += [{"prompt_ids": prompt, "ids": torch.randint(10, V, (a.completion,)).tolist(), "group": k,
                  "logprobs": [-2.0] * a.completion, "reward": float(i % 2), "policy_version": 0, "truncated": False}
                 for i in range(a.group_size)]
    advantages = grpo_loss.group_advantages(torch.tensor([s["reward"] for s in seqs]), a.group_size)  # (B,)
    params = trainer_state.lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    model.eval()

    def step():
        optimizer.zero_grad(set_to_none=True)
        if a.path == "new":
            mbs = shared_prompt.make_microbatches(seqs, a.micro_batch_tokens)
            trainer.compute_loss_and_backward(model, seqs, advantages, mbs)
        else:
            mbs = old_microbatches(seqs, a.micro_batch_tokens)
            old_loss_and_backward(model, seqs, advantages, mbs)
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
    times, cpu = [], []
    for _ in range(a.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    B, n_max = len(seqs), max(len(mb) for mb in mbs)
    print(json.dumps({"step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
                      "tok_s": B * a.completion / statistics.median(times),
                      "micro_batches": len(mbs), "base_mb": base / 1024,
                      "step_peak_mb": (rss_kb("VmHWM") - base) / 1024,
                      "proc_peak_mb": max(proc_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024,
                      "logits_mb": n_max * a.completion * V * 4 / MB, "whole_mb": B * a.completion * V * 4 / MB,
                      "params": sum(p.numel() for p in model.parameters()), "lora": sum(p.numel() for p in params)}))


def measure(model, path, groups, prompt, completion, mbt, repeats, group_size=8, shared=0, **env):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--path", path, "--groups",
           str(groups), "--group-size", str(group_size), "--prompt", str(prompt), "--shared", str(shared), "--completion", str(completion),
           "--micro-batch-tokens", str(mbt), "--repeats", str(repeats)]
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
    p.add_argument("--only", choices=["throughput", "default", "memory"],
                   help="one part; 'default': the throughput rows of the default task's shape only")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per throughput measurement (after a warm-up)")
    p.add_argument("--memory-repeats", type=int, default=1, help="timed steps per memory measurement")
    p.add_argument("--out", default="/tmp/bench_trainer", help="where the tiny model is built")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=["old", "new"], help=argparse.SUPPRESS)
    for flag in ("--model", "--groups", "--group-size", "--prompt", "--shared", "--completion", "--micro-batch-tokens"):
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
        print("\ntrainer step, old (plain) path vs new (shared-prompt) path: N groups x G completions of S+P prompt "
              "tokens (S common to every prompt) + C completion tokens, --micro-batch-tokens 8192")
        print(f"{'model':<10}{'params':>8}{'LoRA':>8}{'N x G x (S+P + C)':>22}{'mbs':>6}{'step s old':>11}{'new':>7}"
              f"{'speed-up':>9}{'cpu s old':>10}{'new':>7}{'speed-up':>9}{'tok/s new':>10}{'step peak old':>14}"
              f"{'new':>8}{'other CPU':>10}")
        # the default run's shape: 4 prompts x 8 completions, ~38 + 12 tokens (arith), 27 of the 38 the
        # chat template's part before the question (SmolLM2's system prompt), the same in every prompt
        default = [(4, 38, 12, 27)]
        shapes = default if a.only == "default" else default + [(8, 32, 64, 0)]
        cases = [("tiny", tiny, *s) for s in shapes] + [("SmolLM2", smol, *s) for s in shapes if smol]
        for name, path, N, P, C, S in cases:
            old = measure(path, "old", N, P, C, 8192, a.repeats, shared=S)
            new = measure(path, "new", N, P, C, 8192, a.repeats, shared=S)
            print(f"{name:<10}{new['params'] / 1e6:>7.1f}M{new['lora'] / 1e6:>7.2f}M{f'{N} x 8 x ({S}+{P - S} + {C})':>22}"
                  f"{old['micro_batches']:>3}/{new['micro_batches']:<2}{old['step_s']:>11.2f}{new['step_s']:>7.2f}"
                  f"{old['step_s'] / new['step_s']:>8.2f}x{old['cpu_s']:>10.2f}{new['cpu_s']:>7.2f}"
                  f"{old['cpu_s'] / new['cpu_s']:>8.2f}x{new['tok_s']:>10.0f}{old['step_peak_mb']:>11.0f} MB"
                  f"{new['step_peak_mb']:>5.0f} MB{max(OTHER_CPU[-2:]):>10.2f}", flush=True)

    if a.only not in ("throughput", "default"):
        model, name = (smol, "SmolLM2-135M") if smol else (tiny, "tiny")
        P, C = 16, 32  # a group costs P + 8 C = 272 tokens of --micro-batch-tokens
        header = (f"{'B':>5}{'mb tokens':>11}{'mbs':>5}{'logits/mb':>11}{'whole batch':>13}{'step peak':>11}"
                  f"{'step s':>8}{'peak, mmap':>12}{'step s':>8}{'base':>9}{'other CPU':>10}")
        for title, cases in [("batch size B grows, --micro-batch-tokens fixed at 384 (1 group of 8)",
                              [(1, 384), (2, 384), (4, 384), (8, 384)]),
                             ("B fixed at 32, --micro-batch-tokens grows (the control: memory must follow it)",
                              [(4, 272), (4, 544), (4, 1088), (4, 2176)])]:
            print(f"\nlog-prob memory (new path), {name} (vocab V), P={P}, C={C}: {title}\n{header}")
            for N, mbt in cases:
                r = measure(model, "new", N, P, C, mbt, a.memory_repeats)
                m = measure(model, "new", N, P, C, mbt, a.memory_repeats, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
                print(f"{N * 8:>5}{mbt:>11}{r['micro_batches']:>5}{r['logits_mb']:>8.1f} MB{r['whole_mb']:>10.1f} MB"
                      f"{r['step_peak_mb']:>8.0f} MB{r['step_s']:>8.2f}{m['step_peak_mb']:>9.0f} MB{m['step_s']:>8.2f}"
                      f"{r['base_mb']:>6.0f} MB{max(OTHER_CPU[-2:]):>10.2f}", flush=True)
    print(f"\nother processes took up to {max(OTHER_CPU):.2f} CPU cores during a measurement (mean "
          f"{statistics.mean(OTHER_CPU):.2f})")


if __name__ == "__main__":
    main()
