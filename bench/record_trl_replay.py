"""Record a short TRL GRPOTrainer trajectory on the tiny test model: tests/data/trl_replay.pt.

    .venv/bin/python bench/record_trl_replay.py          # ~1 min once TRL's venv exists
    .venv/bin/python bench/record_trl_replay.py --out /tmp/x.pt --record-steps 3

TRL 1.16's GRPOTrainer (in runs/.venv-trl, bench_vs_trl.ensure_trl_venv: trl==1.16.0 with this
project's torch, transformers and peft) trains the tiny model (tests/tiny_model.py, built fresh)
with the race's config at a tiny scale: GROUPS prompts x G completions per step, fp32, no
dropout, AdamW without weight decay, lr LR with linear decay over MAX_STEPS steps (only the first
RECORD_STEPS are run and kept, so the schedule is mid-way, as in a real run), `dapo`, beta 0,
epsilon 0.2 and trainer.py's `delta`, max_grad_norm 0.5 (below the gradient norms, 0.74-0.82:
the clip is in the path). The reward is the share of a
completion's characters that are digits: on the random tiny model some groups earn 0 everywhere
(equal rewards: kept, as TRL does) and the others differ.

Kept, per step: each row's prompt and completion ids (unpadded), reward and TRL's advantage;
TRL's gradient norm before clipping (its log); the LoRA weights after the step. Also the initial
LoRA (only A: B starts at 0) and a fingerprint of the base model's weights, so that a tiny model
built differently is named, not replayed. tests/test_trl_replay.py feeds the batches to
trainer.py's grpo_update from the same initial LoRA and compares the weights after every step.
"""

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"groups": 4, "num_generations": 4, "max_completion_length": 8, "temperature": 1.0,
          "learning_rate": 1e-3, "max_steps": 10, "record_steps": 5, "lora_r": 4, "lora_alpha": 8,
          "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "max_grad_norm": 0.5, "seed": 0}
PROMPTS = ["Say a digit.", "Count to three.", "Name a number.", "Write 12.", "Pick one: 4 or 9.",
           "What is 2 + 2?", "Say seven.", "Spell 5."]


def base_fingerprint(model):
    """(sum, sum of squares) of the base model's weights, in float64: the same tiny model or not."""
    import torch

    ws = [p.detach().double() for n, p in model.named_parameters() if "lora_" not in n]
    return [float(sum(w.sum() for w in ws)), float(sum((w * w).sum() for w in ws))]


def digit_share(completions, **_):  # completions: [[{"role": "assistant", "content": text}]]
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def record(cfg, out):
    """In TRL's venv: train, keep, torch.save to out."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import tiny_model
    from support import cli

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="trl-replay-")
    path = tiny_model.build(os.path.join(work, "tiny"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    G, B = cfg["num_generations"], cfg["groups"]
    config = GRPOConfig(
        output_dir=work, max_steps=cfg["max_steps"], seed=cfg["seed"], use_cpu=True,
        report_to="none", per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=cfg["max_completion_length"],
        temperature=cfg["temperature"], top_p=1.0, top_k=0, use_vllm=False,
        learning_rate=cfg["learning_rate"], lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=cfg["max_grad_norm"], loss_type=cfg["loss_type"],
        beta=cfg["beta"], epsilon=cfg["epsilon"], delta=cli.DELTA, scale_rewards="group",
        num_iterations=1, bf16=False, gradient_checkpointing=False, disable_dropout=True,
        model_init_kwargs={"dtype": torch.float32}, logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    lora = LoraConfig(r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    after, batches = [], []

    class Keep(TrainerCallback):  # the LoRA after each optimizer step; stop after record_steps
        def on_step_end(self, args, state, control, model=None, **kw):
            after.append({k: v.detach().clone() for k, v in
                          get_peft_model_state_dict(model).items()})
            control.should_training_stop = state.global_step >= cfg["record_steps"]

    trainer = GRPOTrainer(model=path, reward_funcs=digit_share, args=config,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
                          callbacks=[Keep()])
    initial = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    generate, score, last = trainer._generate_and_score_completions, trainer._calculate_rewards, []

    def keep_rewards(*a, **kw):  # called inside _generate_and_score_completions
        rewards = score(*a, **kw)  # (B * G, reward functions)
        last[:] = rewards.sum(1).tolist()
        return rewards

    def keep_batch(inputs):
        b = generate(inputs)
        rows = []
        for r in range(b["prompt_ids"].shape[0]):  # TRL's padded rows, group = r // G
            pm, cm = b["prompt_mask"][r].bool(), b["completion_mask"][r].bool()
            rows.append({"prompt_ids": b["prompt_ids"][r][pm].tolist(),
                         "ids": b["completion_ids"][r][cm].tolist(), "reward": last[r],
                         "advantage": float(b["advantages"][r])})
        batches.append(rows)
        return b

    trainer._calculate_rewards, trainer._generate_and_score_completions = keep_rewards, keep_batch
    fingerprint = base_fingerprint(trainer.model)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "grad_norm" in r]
    if any(k.split(".lora_")[1].startswith("B") and v.abs().max() > 0 for k, v in initial.items()):
        sys.exit("record_trl_replay.py: TRL's initial LoRA B is not 0")
    import trl
    torch.save({"config": dict(cfg, delta=cli.DELTA, eos_token_id=tokenizer.eos_token_id,
                               trl=trl.__version__, torch=str(torch.__version__)),
                "base_fingerprint": fingerprint,
                "initial_A": {k: v for k, v in initial.items() if ".lora_A." in k},
                "lora_keys": sorted(initial),
                "batches": batches, "grad_norm": [float(r["grad_norm"]) for r in logs],
                "after": after}, out)
    rewards = ", ".join(f"{sum(r['reward'] for r in b) / len(b):.3f}" for b in batches)
    norms = ", ".join(f"{r['grad_norm']:.3f}" for r in logs)
    print(f"recorded {len(after)} steps (mean rewards {rewards}; grad norms {norms}) -> {out} "
          f"({os.path.getsize(out) / 1e3:.0f} kB)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "tests/data/trl_replay.pt"))
    p.add_argument("--record-steps", type=int, default=CONFIG["record_steps"])
    p.add_argument("--trl-venv", default=os.path.join(ROOT, "runs/.venv-trl"))
    p.add_argument("--in-trl", action="store_true", help=argparse.SUPPRESS)  # the second half
    a = p.parse_args(argv)
    cfg = dict(CONFIG, record_steps=a.record_steps)
    if a.in_trl:
        return record(cfg, os.path.abspath(a.out))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_vs_trl  # noqa: E402  (.venv's versions pin TRL's venv)
    py = bench_vs_trl.ensure_trl_venv(a.trl_venv)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONHASHSEED="0")
    sys.exit(subprocess.run([py, os.path.abspath(__file__), "--in-trl", "--out", a.out,
                             "--record-steps", str(a.record_steps)], env=env).returncode)


if __name__ == "__main__":
    main()
