"""trainer.py's support: what a run needs around the GRPO step, not to follow it.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_trainer.py -q

In this file's order: the model and its optimizer; the micro-batches and the tensors of the
shared-prompt forward (trainer.completion_logprobs reads them); the start of a run (the resume
state, the first version); the step's record (statistics, the log line, metrics/ in the bucket);
the command line; the hardening against what a hostile replica (groups) or bucket writer (resume
state) can send. trainer.py names each use; this file never imports it.
"""

import argparse
import hashlib
import hmac
import math
import os
import pickle
import random
import re
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

import grpo_loss
import sync

DELTA = 2.0  # --delta's default: TRL's two-sided clip, on (departure 8); >= 1 + epsilon_high
ABSURD_RATIO = 1e3  # no sampler's honest mismatch: a group with a ratio above it is named (dep. 8)


class TrainerError(Exception):
    """A misconfiguration or a run that cannot go on; the message says what to do."""


# ---- the model and its optimizer

def build_model(model_name, lora_r=16, lora_alpha=32, lora_target="all-linear", seed=0):
    """Base model + fresh LoRA (B = 0, so version 0 is the base policy). bf16 on GPU, fp32 on
    CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gpu = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float32, "cpu")
    base = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(device)
    base.config.use_cache = False
    targets = lora_target if lora_target == "all-linear" \
        else [t.strip() for t in lora_target.split(",")]
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    return get_peft_model(base, lora)  # adapter weights are kept in fp32 (autocast_adapter_dtype)


def lora_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(params, args):
    """AdamW, no weight decay (departure 5); a resume state must match it (state_problem)."""
    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)


# ---- the micro-batches, and the tensors of the shared-prompt forward

def by_group(seqs, idx):
    """Sequence indices -> lists of them, one per group, in first-seen order."""
    groups = {}
    for i in idx:
        groups.setdefault(seqs[i]["group"], []).append(i)
    return list(groups.values())


def make_microbatches(seqs, max_tokens):
    """Split the step into micro-batches of whole groups, at most max_tokens each (padding counted,
    and each group's prompt once: k groups of n completions cost k * longest prompt + n * longest
    completion). Longest first, so that an out-of-memory shows on the first pass; a group over
    budget goes alone. Returns index lists."""
    def cost(gs):
        return (len(gs) * max(len(seqs[g[0]]["prompt_ids"]) for g in gs)
                + sum(map(len, gs)) * max(len(seqs[i]["ids"]) for g in gs for i in g))

    batches = []
    for g in sorted(by_group(seqs, range(len(seqs))), key=lambda g: -cost([g])):
        if batches and cost(batches[-1] + [g]) <= max_tokens:
            batches[-1].append(g)
        else:
            batches.append([g])
    return [[i for g in gs for i in g] for gs in batches]


def collate(seqs, idx, advantages, device):
    """The tensors of the shared-prompt forward of rows idx: the prompts' common prefix once
    (prefix_ids, one row: a chat template's system prompt), the rest of each group's prompt once,
    left-padded after it ([prefix | pad.. rest], k rows), and the n completions right-padded
    ([completion ..pad]), row r continuing prompt row_prompt[r]. Rows keep idx's order. Padding is
    id 0; the masks hide it."""
    groups = by_group(seqs, idx)
    prompts = [seqs[g[0]]["prompt_ids"] for g in groups]
    # the common prefix's length; every prompt's rest keeps >= 1 token
    L = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
    P = max(map(len, prompts)) - L
    C = max(len(seqs[i]["ids"]) for i in idx)
    prompt_ids = torch.zeros((len(groups), P), dtype=torch.long)  # (k, P) the rests of the prompts
    rest_mask = torch.zeros_like(prompt_ids)  # (k, P) 1 on their tokens
    for j, pr in enumerate(prompts):
        prompt_ids[j, P - len(pr) + L:] = torch.tensor(pr[L:])
        rest_mask[j, P - len(pr) + L:] = 1
    prefix_mask = torch.ones((len(groups), L), dtype=torch.long)  # (k, L)
    prompt_mask = torch.cat([prefix_mask, rest_mask], 1)  # (k, L + P)
    group_of = {i: j for j, g in enumerate(groups) for i in g}
    row_prompt = torch.tensor([group_of[i] for i in idx])  # (n,) the prompt row of each completion
    completion_ids = torch.zeros((len(idx), C), dtype=torch.long)  # (n, C)
    old = torch.zeros((len(idx), C))  # (n, C) sampler log-probs, 0 on padding
    mask = torch.zeros((len(idx), C))  # (n, C) 1 on generated tokens (EOS included), from lengths
    for r, i in enumerate(idx):
        ids = seqs[i]["ids"]
        completion_ids[r, :len(ids)] = torch.tensor(ids)
        old[r, :len(ids)] = torch.tensor(seqs[i]["logprobs"])
        mask[r, :len(ids)] = 1.0
    prompt_len = prompt_mask.sum(-1)[row_prompt]  # (n,)
    mb = {"prefix_ids": torch.tensor(prompts[0][:L]).view(1, L),  # (1, L)
          "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
          # (k, P) the rests' positions as if unpadded
          "prompt_positions": L + (rest_mask.cumsum(-1) - 1).clamp(min=0),
          "row_prompt": row_prompt, "completion_ids": completion_ids,
          # (n, C) the completions' positions: they follow their prompt
          "completion_positions": prompt_len.unsqueeze(1) + torch.arange(C),
          "attention_mask": torch.cat([prompt_mask[row_prompt], mask.long()], 1),  # (n, L + P + C)
          "old_logprobs": old, "mask": mask,  # (n, C) (n, C)
          "advantages": advantages[list(idx)]}  # (n,)
    return {k: t.to(device) for k, t in mb.items()}


# ---- the start of a run: the resume state, the model, the first version

def start_run(args, bucket, contract):
    """Everything before the first step. Loads the resume state in the bucket (checked; with env
    TRAINER_STATE_KEY, authenticated), builds the model and AdamW and restores them from it, picks
    the first version (starting_version), starts --report-to. Prints the run's first lines.
    Returns a namespace: bucket, model, optimizer, step, version, must_publish, groups_consumed,
    key, limits (what group_problem checks a group against), reporter."""
    tmp, key = tempfile.TemporaryDirectory(), os.environ.get("TRAINER_STATE_KEY") or None
    state_dir = sync.load_trainer_state(bucket, tmp.name)
    state = load_state(state_dir, key, bucket.url)  # authenticated with a key; checked in any case
    probe = make_optimizer([torch.zeros(1)], args)  # this trainer's AdamW settings
    if state is not None and (why := state_problem(state, probe)):
        raise TrainerError(f"{bucket.url}/trainer: the resume state does not fit this trainer "
                           f"({why}): not written by trainer.py? remove {bucket.url}/trainer to "
                           "start fresh (and set TRAINER_STATE_KEY: an HMAC then shows who wrote "
                           "it)")
    where = f"{bucket.url}/trainer"
    print(f"resumed from step {state['step']}, version {state['version']} (state in {where})"
          if state else f"starting fresh: no trainer state in {bucket.url}")
    print(f"run settings from the proxy: {contract}")
    latest = sync.latest_version(bucket)
    version, must_publish = starting_version(state, latest, sync.versions(bucket))
    if latest is not None and not state:
        print(f"note: {bucket.url} already holds adapters up to v{latest}; this run starts at "
              f"v{version}")
    # --report-to: the trackio or wandb module (both have init/log/finish)
    reporter, kind = None, args.report_to
    if kind != "none":
        try:
            reporter = __import__(kind)
        except ImportError:
            raise TrainerError(f"--report-to {kind} needs the {kind} package: pip install {kind} "
                               "(or --report-to none)")
        reporter.init(project="async-grpo-lora", config=vars(args))
    random.seed(args.seed)
    model = build_model(args.model, args.lora_r, args.lora_alpha, args.lora_target, args.seed)
    model.eval()  # no dropout: the recomputed log-probs must be the policy the sampler ran
    limits = {"num_generations": args.num_generations,
              "reward_range": contract.get("reward_range"),
              "context": getattr(model.config, "max_position_embeddings", None)}
    optimizer = make_optimizer(lora_parameters(model), args)
    step, groups_consumed = (state["step"], state["groups_consumed"]) if state else (0, 0)
    if state:
        try:
            restore_state(model, optimizer, state_dir, state)
        # e.g. a size mismatch: the state belongs to another model
        except (RuntimeError, ValueError) as e:
            saved, why = state.get("args", {}), str(e).strip().splitlines()[0][:160]
            raise TrainerError(f"the state in {bucket.url}/trainer (--model {saved.get('model')}, "
                               f"--lora-r {saved.get('lora_r')}) does not fit --model {args.model} "
                               f"--lora-r {args.lora_r} ({why}): run with that run's settings, or "
                               "another --bucket") from None
    tmp.cleanup()
    return SimpleNamespace(bucket=bucket, model=model, optimizer=optimizer, step=step,
                           version=version, must_publish=must_publish,
                           groups_consumed=groups_consumed, key=key, limits=limits,
                           reporter=reporter)


def restore_state(model, optimizer, state_dir, state):
    """Load the LoRA weights, optimizer and RNGs that publish saved (state_dir:
    load_trainer_state's)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(state_dir, "adapter_model.safetensors"))
    set_peft_model_state_dict(model, weights)
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng_python"])
    torch.set_rng_state(state["rng_torch"])
    if state.get("rng_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


def write_state(folder, state, optimizer, key=None):
    """The resume state into folder (beside the adapter's files): state.pt with the optimizer and
    the RNGs, and with a key (env TRAINER_STATE_KEY) its HMAC tag."""
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    full = dict(state, optimizer=optimizer.state_dict(), rng_python=random.getstate(),
                rng_torch=torch.get_rng_state(), rng_cuda=rng_cuda)
    torch.save(full, os.path.join(folder, "state.pt"))
    if key:
        with open(os.path.join(folder, STATE_TAG), "w") as f:
            f.write(state_tag(key, folder))


def starting_version(state, latest, seen=()):
    """(version, publish?) for a trainer starting with resume state `state` (or None) on a bucket
    whose LATEST is `latest` (or None), holding files of versions `seen` (complete or torn by a kill
    mid-publish). A number the bucket has seen is never published again; LATEST is reused only if
    it holds exactly the saved weights."""
    if state and state["published_step"] == state["step"] \
            and latest == state["version"] >= max(seen, default=-1):
        return state["version"], False
    known = [v for v in (latest, state["version"] if state else None, *seen) if v is not None]
    return (1 + max(known) if known else 0), True


# ---- the step's record: its statistics, the log line, metrics/ in the bucket

STAT_COLUMNS = ("tokens", "approx_kl", "clipped", "ratio_max")  # grpo_loss.offpolicy_stats, per row


class StepStats:
    """The statistics of one step, gathered micro-batch by micro-batch by
    trainer.compute_loss_and_backward (add), over the forwarded completions (result).
    staleness = version - policy_version (0 if no version)."""

    def __init__(self, seqs, version=None, epsilon=0.2, epsilon_high=None, beta=0.0):
        self.seqs, self.version, self.beta = seqs, version, beta
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.sums, self.rows, self.row_groups, self.forwarded = {"loss": 0.0}, [], [], 0

    def add(self, idx, mb, logps, loss, stats):
        """One micro-batch: rows idx, its tensors mb, log-probs (n, C), its weighted loss (a
        float) and policy_loss's stats."""
        self.forwarded += len(by_group(self.seqs, idx))
        self.sums["loss"] += loss
        n = float(mb["mask"].sum())  # the stats: token-weighted means over the micro-batches
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * n
        per_row = grpo_loss.offpolicy_stats(logps, mb["old_logprobs"], mb["mask"], self.epsilon,
                                            self.epsilon_high)  # STAT_COLUMNS, each (n,)
        stale = torch.tensor([0 if self.version is None
                              else self.version - self.seqs[i]["policy_version"]
                              for i in idx])  # (n,)
        columns = [stale.to(per_row["tokens"])] + [per_row[k] for k in STAT_COLUMNS]
        self.rows.append(torch.stack(columns, 1).cpu())  # (n, 5)
        self.row_groups += [self.seqs[i]["group"] for i in idx]

    def result(self):
        """A dict: loss, ratio_mean, clip_low_frac, clip_high_frac, kl (beta > 0), ratio_max
        (ratio_mean and ratio_max are None when no group was forwarded: every advantage was 0),
        approx_kl, clip_frac, by_staleness {"0": {"approx_kl", "clip_frac", "tokens"}, ...},
        groups_forwarded, absurd_ratio {group index: its largest ratio} for the groups whose ratio
        exceeds ABSURD_RATIO."""
        table = torch.cat(self.rows) if self.rows else torch.zeros(0, 5)  # (rows, 5)
        stale, tokens, approx_kl, clipped, ratio_max = table.unbind(1)  # each (rows,)

        def summary(sel):  # (rows,) bool -> token-weighted means over the selected rows
            n = tokens[sel].sum()
            return {"approx_kl": (approx_kl[sel].sum() / n.clamp(min=1)).item(),
                    "clip_frac": (clipped[sel].sum() / n.clamp(min=1)).item(), "tokens": int(n)}

        out = {"ratio_mean": None, "clip_low_frac": 0.0, "clip_high_frac": 0.0,
               **({"kl": 0.0} if self.beta else {}),
               **{k: v if k == "loss" else v / max(float(tokens.sum()), 1.0)
                  for k, v in self.sums.items()},
               **summary(stale >= 0), "ratio_max": ratio_max.max().item() if len(stale) else None,
               "by_staleness": {str(int(s)): summary(stale == s) for s in stale.unique().tolist()},
               "groups_forwarded": self.forwarded}
        del out["tokens"]
        absurd = {}  # group index -> its largest ratio, for the groups over ABSURD_RATIO
        for k, r in zip(self.row_groups, ratio_max.tolist()):
            if r > ABSURD_RATIO:
                absurd[k] = max(r, absurd.get(k, 0.0))
        out["absurd_ratio"] = absurd
        return out


def name_absurd(step, groups, absurd, delta):
    """Name on stderr each group whose ratio no honest sampler gives (departure 8)."""
    for k, r in absurd.items():
        who = f"group {printable(groups[k]['group_id'])} from {printable(groups[k]['worker'])}"
        then = (f"delta {delta:g} leaves such tokens no gradient" if delta
                else "--delta none: it steers this step")
        print(f"step {step + 1}: {who}: importance ratio {r:.3g} > {ABSURD_RATIO:g}, its "
              f"log-probs are not its sampler's; {then}", file=sys.stderr)


def log_step(run, args, groups, seqs, stats, *, step, version, grad_norm, finite, dropped, absurd,
             micro_batches, times):
    """The step's record: metrics/step-S.json in the bucket, --report-to, one line on stdout.
    times: (start, batch in hand, step done) from time.time()."""
    t0, t1, t2 = times
    rewards = torch.tensor([s["reward"] for s in seqs])  # (B,)
    stale = [version - g["policy_version"] for g in groups]
    flat = sum(len({c["reward"] for c in g["completions"]}) == 1 for g in groups)
    tokens = sum(len(s["ids"]) for s in seqs)
    rec = {"step": step, "version": version, "reward_mean": rewards.mean().item(),
           "reward_std": rewards.std().item(), "groups": len(groups),
           "groups_zero_variance": flat,
           "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
           "policy_versions": sorted({g["policy_version"] for g in groups}), "tokens": tokens,
           "truncated": (cut := sum(s["truncated"] for s in seqs)),  # ended without EOS, as TRL
           "clipped_ratio": cut / len(seqs),
           "grad_norm": grad_norm, "skipped_non_finite": not finite,
           "groups_dropped": dropped, "groups_absurd_ratio": len(absurd),
           **stats, "learning_rate": run.optimizer.param_groups[0]["lr"],
           "micro_batches": micro_batches,
           "wait_s": round(t1 - t0, 3), "compute_s": round(t2 - t1, 3),
           "tokens_per_s": round(tokens / max(t2 - t1, 1e-9), 1), "time": time.time()}
    sync.append_metrics(run.bucket, rec)
    if run.reporter:  # the same numbers (lists and dicts left out)
        run.reporter.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    kl = f" kl {rec['kl']:.4f}" if args.beta > 0 else ""
    print(f"step {step} v{version} | reward {rec['reward_mean']:.3f} ± "
          f"{rec['reward_std']:.3f} | groups {len(groups)} ({flat} all-equal) | stale "
          f"{rec['staleness_mean']:.2f}/{rec['staleness_max']} | loss {rec['loss']:.4f} ratio "
          f"{rec['ratio_mean'] or 1:.4f} (max {rec['ratio_max'] or 1:.2f}) approx_kl "
          f"{rec['approx_kl']:.5f} clip {rec['clip_frac']:.3f}{kl} | gnorm {grad_norm:.3f} | "
          f"wait {rec['wait_s']:.2f}s compute {rec['compute_s']:.2f}s "
          f"{rec['tokens_per_s']:.0f} tok/s")


# ---- the command line

def delta_or_none(v):
    return None if v.lower() == "none" else float(v)


def parse_args(argv=None, description=None):
    """trainer.py's flags, checked (a bad value: exit with one line saying what to set)."""
    p = argparse.ArgumentParser(description=description)
    a = p.add_argument
    a("--model", required=True, help="base model: a Hub id or a local folder")
    a("--bucket", required=True, help="a directory (or mounted bucket) or s3://bucket/prefix")
    a("--proxy", required=True,
      help="the proxy's URL, e.g. http://127.0.0.1:8000 (token: env PROXY_TOKEN)")
    # The run's contract comes from the proxy (GET /config); these flags only double-check it.
    a("--num-generations", type=int, help="completions per prompt, G (default: the proxy's)")
    a("--groups-per-step", type=int,
      help="groups (prompts) per optimizer step (default: the proxy's)")
    a("--max-staleness", type=int,
      help="the proxy's staleness bound; sets the versions kept (default: the proxy's)")
    a("--temperature", type=float,
      help="the replicas' sampling temperature; divides logits (default: the proxy's)")
    a("--max-completion-length", type=int,
      help="the longest completion; dr_grpo's normaliser (default: the proxy's)")
    # the loss, as TRL names it
    a("--epsilon", type=float, default=0.2, help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=float, default=None,
      help="upper clip: ratio <= 1 + epsilon_high (default: epsilon)")
    a("--delta", type=delta_or_none, default=DELTA,
      help=f"TRL's two-sided clip: ratio <= delta (>= 1 + epsilon_high) if advantage < 0; "
           f"'none': off (default {DELTA}: one group cannot steer a step)")
    a("--beta", type=float, default=0.0,
      help="KL coefficient against the base model (adapter disabled); 0 = no KL")
    a("--use-bias-correction-kl", action=argparse.BooleanOptionalAction, default=True,
      help="with --beta > 0: multiply the per-token KL by the importance ratio (TRL's default: on)")
    a("--mask-truncated-completions", action="store_true",
      help="leave completions that ended without EOS out of the loss (TRL's; default: off)")
    a("--loss-type", default="dapo", choices=["grpo", "bnpo", "dr_grpo", "dapo"],
      help="loss normalisation, as in TRL")
    a("--scale-rewards", default="group", choices=["group", "batch", "none"],
      help="divide advantages by this std")
    a("--learning-rate", type=float, default=3e-4, help="AdamW's initial learning rate")
    a("--lr-scheduler-type", default="linear", choices=["linear", "constant"],
      help="linear: decays to 0 at --max-steps (TRL's default); constant")
    a("--max-grad-norm", type=float, default=1.0,
      help="clip the LoRA gradient's global norm to this")
    a("--max-steps", type=int, default=500,
      help="stop after this many optimizer steps (counted across restarts)")
    a("--micro-batch-tokens", type=int, default=8192,
      help="tokens (padding counted) per forward/backward pass")
    a("--save-every", type=int, default=10, help="save resume state every this many steps")
    a("--seed", type=int, default=0, help="seed for the LoRA init and torch's/python's RNGs")
    a("--lora-r", type=int, default=16, help="LoRA rank (vLLM wants 1, 8, 16, 32, 64, ...)")
    a("--lora-alpha", type=int, default=32, help="LoRA alpha (scale = alpha / r)")
    a("--lora-target", default="all-linear",
      help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj")
    a("--wait-timeout", type=float, default=1800.0,
      help="seconds with no usable group before giving up (0: never)")
    a("--bucket-retry", type=float, default=300.0,
      help="seconds to retry a bucket that worked before (an outage)")
    a("--report-to", default="none", choices=["none", "trackio", "wandb"],
      help="also send each step's metrics there")
    args = p.parse_args(argv)
    if too_small := [f for f in ("save_every", "micro_batch_tokens") if getattr(args, f) < 1]:
        sys.exit(f"trainer.py: error: --{too_small[0].replace('_', '-')} must be >= 1")
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.delta is not None and not args.delta >= 1 + high:
        sys.exit(f"trainer.py: error: --delta {args.delta:g} must be >= 1 + epsilon_high = "
                 f"{1 + high:g} (raise it, or --delta none to turn TRL's two-sided clip off)")
    return args


# ---- hardening: what a hostile replica (groups) or bucket writer (resume state) can send,
# checked before it can crash, steer or poison the learner

class Waiting:
    """gather_groups' patience: a line every minute saying what the proxy sees, and a
    TrainerError once wait_timeout seconds (0: never) passed without the groups."""

    def __init__(self, client, wait_timeout, bucket_url):
        self.client, self.wait_timeout, self.bucket_url = client, wait_timeout, bucket_url
        self.start = self.last_log = time.time()

    def check(self, have, n):
        waited, timeout = time.time() - self.start, self.wait_timeout
        if (timeout and waited > timeout) or time.time() - self.last_log > 60:
            s = self.client.stats()  # the proxy sees the whole run: say what it sees
            why = (f"the proxy has {s['buffered']} groups buffered, leases {s['leased']}, dropped "
                   f"{s['dropped_stale']} as stale and {s['dropped_zero_variance']} with equal "
                   "rewards; replicas that load no new adapter ('adapter vN loaded' in their logs) "
                   f"are not reading --bucket {self.bucket_url}")
            if timeout and waited > timeout:
                raise TrainerError(f"no groups for {waited:.0f}s (have {have}/{n}): {why}; "
                                   "raise --wait-timeout for slow starts")
            print(f"waiting for groups: {have}/{n} after {waited:.0f}s; {why}")
            self.last_log = time.time()


def usable(g, vocab_size, dropped=None, **limits):
    """True when the trainer can use group g (group_problem); else the group is named on stderr,
    counted in `dropped` (why -> count), and False."""
    if not (problem := group_problem(g, vocab_size, **limits)):
        return True
    if dropped is not None:
        dropped[problem[0]] = dropped.get(problem[0], 0) + 1
    gid, worker = (printable(g.get(k) if isinstance(g, dict) else "?")
                   for k in ("group_id", "worker"))
    print(f"dropped group {gid} from {worker}: {problem[1]}", file=sys.stderr)
    return False


def group_problem(g, vocab_size, num_generations=None, context=None, reward_range=None):
    """(kind, why) when the trainer cannot use group g (the proxy's JSON), else None. The proxy
    checks groups too; this holds on its own: one bad group must not crash or poison a step."""
    def ids_ok(ids):
        return type(ids) is list and all(type(t) is int and 0 <= t < vocab_size for t in ids)

    def number(x, lo=-math.inf, hi=math.inf):  # NaN fails
        return type(x) in (int, float) and lo <= x <= hi and math.isfinite(x)

    lo, hi = reward_range or (-math.inf, math.inf)
    try:
        comps, prompt = g["completions"], g["prompt_ids"]
        if num_generations is not None and len(comps) != num_generations:
            return "num_completions", f"{len(comps)} completions, not {num_generations}"
        if not prompt:
            return "empty_prompt", "no prompt tokens (prompt_ids: [])"
        for j, c in enumerate(comps):
            ids, lps = c["ids"], c["logprobs"]
            if not ids:
                return "empty_completion", f"completion {j} has no tokens (ids: [])"
            if not (ids_ok(prompt) and ids_ok(ids)):
                return "token_id", f"a token id >= the vocabulary size {vocab_size} (or < 0)"
            if len(lps) != len(ids) or not all(map(number, lps)):
                return "logprobs", (f"completion {j}: {len(lps)} log-probs for {len(ids)} ids, "
                                    "or NaN")
            if not number(c["reward"], lo, hi):
                r = str(c["reward"])[:30]
                return "reward", f"completion {j}: reward {r} not in [{lo:g}, {hi:g}]"
        longest = len(prompt) + max(len(c["ids"]) for c in comps)
        if context is not None and longest > context:
            return "too_long", f"{longest} tokens of prompt + completion > the context {context}"
        int(g["policy_version"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return "malformed", "not a group in the proxy's JSON form"
    return None


def printable(v, n=64):
    """A peer's string for a log line: at most n characters, no control character (no fake line)."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(v)[:n])


STATE_TAG = "state.hmac"  # next to state.pt: the state's HMAC under env TRAINER_STATE_KEY
FREE_OPTIMIZER_KEYS = {"params", "lr", "initial_lr", "foreach", "fused", "capturable",
                       "differentiable"}  # AdamW settings a resume state may set as it likes


def state_tag(key, folder):
    """HMAC-SHA256 (hex) under key of every file in folder but the tag: names and sha256s,
    sorted."""
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for name in sorted(os.listdir(folder)):
        if name != STATE_TAG and os.path.isfile(path := os.path.join(folder, name)):
            with open(path, "rb") as f:
                mac.update(f"{name}\0{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    return mac.hexdigest()


def load_state(state_dir, key, where):
    """The resume state load_trainer_state put in state_dir (None: there is none). With a key, it is
    refused unless its HMAC tag matches; it never unpickles code (weights_only). TrainerError."""
    if state_dir is None:
        return None
    fresh = f"remove {where}/trainer to start fresh"
    if key:
        tag_path = os.path.join(state_dir, STATE_TAG)
        tag = open(tag_path, "rb").read().strip() if os.path.exists(tag_path) else None
        if tag is None or not hmac.compare_digest(tag, state_tag(key, state_dir).encode()):
            which = "no" if tag is None else "a wrong"
            raise TrainerError(f"{where}/trainer: the resume state has {which} HMAC tag under "
                               "TRAINER_STATE_KEY: this run's trainer did not write it (or used "
                               f"another key); set the key that run used, or {fresh}")
    try:  # weights_only: a state.pt planted in the bucket cannot run code here
        return torch.load(os.path.join(state_dir, "state.pt"), weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text advises weights_only=False: not repeated
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it calls {found.group(1)}" if found else "not a plain pickle"
        raise TrainerError(f"{where}/trainer/state.pt holds more than tensors and plain values "
                           "(written by something else than trainer.py?): weights only load failed "
                           f"({why}); {fresh}") from None


def state_problem(state, optimizer):
    """Why a resume state does not fit this trainer (counters, its own AdamW settings, finite
    moments with |exp_avg| <= 10 sqrt(exp_avg_sq), as Adam's own updates keep them), or None."""
    try:
        if not all(type(state[k]) is int and state[k] >= 0
                   for k in ("step", "version", "published_step", "groups_consumed")):
            return "step, version, published_step or groups_consumed is not an int >= 0"
        saved = state["optimizer"]["param_groups"]
        if len(saved) != len(optimizer.param_groups):
            return f"{len(saved)} optimizer parameter groups, not {len(optimizer.param_groups)}"
        for theirs, ours in zip(saved, optimizer.param_groups):
            for k in set(ours) - FREE_OPTIMIZER_KEYS:
                if theirs.get(k, ours[k]) != ours[k]:
                    return f"AdamW {k}={str(theirs[k])[:40]}, not this trainer's {ours[k]}"
        for moments in state["optimizer"]["state"].values():
            m, v = moments["exp_avg"].float(), moments["exp_avg_sq"].float()
            if not (torch.isfinite(m).all() and torch.isfinite(v).all() and (v >= 0).all()
                    and (m.abs() <= 10 * v.sqrt() + 1e-12).all()):
                return "AdamW moments that are not finite, or exp_avg beyond 10 sqrt(exp_avg_sq)"
    except (KeyError, TypeError, AttributeError, RuntimeError):
        return "not the dict trainer.py saves"
    return None
