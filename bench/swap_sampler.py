"""The swap: trainer.py's update fed by transformers' own sampling, in one process.

    # SmolLM2 on arith at jobs.sh's local settings, synchronous; one file a seed, resumable
    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python bench/swap_sampler.py --seeds 0 1 2 \\
        --model runs/models/smollm2-135m-instruct --out runs/swap
    # the whole path on the tiny model, in about a minute
    .venv/bin/python tests/tiny_model.py /tmp/tiny
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/swap_sampler.py --seeds 0 \\
        --model /tmp/tiny --task toy --steps 3 --eval-limit 20 --out /tmp/swap

TRL's GRPOTrainer without vLLM samples with transformers' `generate` in its own process, one
step after the other; ours samples with its replica (support/engines.py). This runs trainer.py's
update (`trainer.grpo_update`, trainer.py's flags and AdamW, its LoRA: trainer_state.build_model
with the seed) on batches that transformers' sampling makes from the current weights, each step:
GROUPS_PER_STEP prompts in the replica's order (tasks.shard_order with the seed), NUM_GENERATIONS
completions each from `model.generate` (do_sample, top_k 0, top_p 1, the temperature: TRL's
path), cut at the first EOS, scored as the replica scores them (rewards.make_task), their
log-probs the policy's own (trainer.plain_logprobs: staleness 0, as TRL's). After STEPS steps the
adapter is scored by `rollout.py --eval` on the held-out problems (bench_vs_trl.evaluate, the
command jobs.sh uses). Each seed's record, OUT/swap-seedS.json, has the side name
"ours-trainer-transformers-sampling": `bench/race_seeds.py table OUT docs/race-seeds` sets it
beside ours' replica runs and TRL's.
"""

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import torch  # noqa: E402

import bench_vs_trl  # noqa: E402
import race_seeds  # noqa: E402
import sync  # noqa: E402
import trainer  # noqa: E402
from support import cli, rewards, tasks, trainer_state  # noqa: E402


def train(a, settings, seed, bucket):
    """STEPS synchronous steps; the adapter published to `bucket` as version STEPS. Returns the
    per-step mean rewards."""
    G, B = int(settings["NUM_GENERATIONS"]), int(settings["GROUPS_PER_STEP"])
    T, C = float(settings["TEMPERATURE"]), int(settings["MAX_NEW_TOKENS"])
    args = cli.trainer_args([
        "--model", a.model, "--bucket", bucket, "--proxy", "http://127.0.0.1:9",
        "--num-generations", str(G), "--groups-per-step", str(B), "--max-staleness", "0",
        "--temperature", str(T), "--max-completion-length", str(C),
        "--learning-rate", settings["LEARNING_RATE"], "--max-steps", str(a.steps),
        "--lr-scheduler-type", settings["LR_SCHEDULER_TYPE"], "--lora-r", settings["LORA_R"],
        "--lora-alpha", settings["LORA_ALPHA"], "--loss-type", settings["LOSS_TYPE"],
        "--beta", settings["BETA"], "--seed", str(seed)])
    torch.manual_seed(seed)
    model = trainer_state.build_model(a.model, args.lora_r, args.lora_alpha, args.lora_target,
                                      seed)
    optimizer = trainer_state.make_optimizer(trainer_state.lora_parameters(model), args)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id} - {None})
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    task = rewards.make_task({"task": settings["TASK"]}, say=lambda *_: None)
    rows = task.rows("train")
    order, curve = tasks.shard_order(len(rows), seed, 0, 1), []
    for step in range(a.steps):
        t0, groups = time.time(), []
        for i in [next(order) for _ in range(B)]:
            prompt = rewards.templated(tok, rows[i]["prompt"])[1]
            x = torch.tensor([prompt])  # (1, P)
            with torch.no_grad():
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                     top_k=0, top_p=1.0, temperature=T, max_new_tokens=C,
                                     num_return_sequences=G, eos_token_id=eos_ids,
                                     pad_token_id=pad, use_cache=True)
            ids = []
            for row in out[:, len(prompt):].tolist():  # (G, <= C) cut at the first EOS
                end = next((k + 1 for k, t in enumerate(row) if t in eos_ids), None)
                ids.append(row[:end] if end else row)
            texts = [tasks.completion_text(tok, r) for r in ids]
            got, _ = task.score(rows[i], texts, ids, f"train row {i}")
            seqs = [{"prompt_ids": prompt, "ids": r} for r in ids]
            with torch.no_grad():  # the policy's own log-probs: on-policy, as TRL's
                logps = trainer.plain_logprobs(model, seqs, range(G), T)
            groups.append({"prompt_ids": prompt, "policy_version": step, "completions": [
                {"ids": r, "logprobs": logps[j, :len(r)].tolist(), "reward": got[j],
                 "finish_reason": "stop" if r[-1] in eos_ids else "length"}
                for j, r in enumerate(ids)]})
        t1 = time.time()
        _, _, _, grad_norm, _ = trainer.grpo_update(model, optimizer, groups, args, step, step)
        reward = sum(c["reward"] for g in groups for c in g["completions"]) / (B * G)
        curve.append(round(reward, 4))
        print(f"step {step + 1}: reward {reward:.3f}, grad norm {grad_norm:.3f}, sampling "
              f"{t1 - t0:.1f} s, update {time.time() - t1:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        sync.publish_adapter(bucket, d, a.steps, keep=None, step=a.steps)
    return curve


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--out", required=True, help="a folder: swap-seedS.json, seed-S/")
    p.add_argument("--model", default=bench_vs_trl.SMOLLM2)
    p.add_argument("--task", help="TASK (default: jobs.sh's local one, arith)")
    p.add_argument("--steps", type=int, help="STEPS (default: jobs.sh's local 30)")
    p.add_argument("--eval-limit", type=int, default=0, help="held-out problems (0: all)")
    p.add_argument("--commit", help="the commit the code is from (default: git's HEAD)")
    a = p.parse_args(argv)
    settings = bench_vs_trl.jobs_defaults()
    settings["TASK"] = a.task or settings["TASK"]
    a.steps, a.model = a.steps or int(settings["STEPS"]), os.path.abspath(a.model)
    os.makedirs(a.out, exist_ok=True)
    for seed in a.seeds:
        path = os.path.join(a.out, f"swap-seed{seed}.json")
        if os.path.exists(path):
            print(f"seed {seed}: {path} is there, skipped")
            continue
        work = os.path.join(a.out, f"seed-{seed}")
        bucket, t0 = os.path.join(work, "bucket"), time.time()
        curve = train(a, settings, seed, bucket)
        train_s = time.time() - t0
        result = bench_vs_trl.evaluate(argparse.Namespace(model=a.model, eval_limit=a.eval_limit),
                                       settings, bucket, a.steps,
                                       os.path.join(work, "eval-final.json"))
        record = {"side": "ours-trainer-transformers-sampling", "seed": seed,
                  "accuracy": result["accuracy"], "n": result["n"],
                  "correct": bench_vs_trl.scored(result)["correct"], "steps": a.steps,
                  "train_s": round(train_s, 1), "rewards": curve,
                  "commit": race_seeds.commit(a.commit), "machine": race_seeds.machine()}
        with open(path, "w") as f:
            json.dump(record, f)
        print(f"seed {seed}: {100 * record['accuracy']:.1f}% on {record['n']} held-out problems "
              f"after {train_s:.0f} s -> {path}", flush=True)


if __name__ == "__main__":
    main()
