"""The learner: pull scored groups from the proxy, take GRPO steps on the LoRA weights, publish.

    python trainer.py --model Qwen/Qwen2.5-0.5B-Instruct --bucket /bucket --proxy https://JOB--8000.hf.jobs

The whole system on one CPU machine with the tiny test model (what tests/test_trainer.py runs;
the toy reward goes from ~0.05 to ~0.9 in these 24 steps, ~20 s):

    python tests/tiny_model.py /tmp/tiny
    export PROXY_TOKEN=secret OMP_NUM_THREADS=1
    python proxy.py --port 8000 --max-staleness 2 --num-generations 8 &
    python rollout.py --engine hf --task toy --model /tmp/tiny --bucket runs/toy --proxy http://127.0.0.1:8000 \
        --num-generations 8 --prompts-per-batch 4 --max-new-tokens 6 --max-staleness 2 &
    python trainer.py --model /tmp/tiny --bucket runs/toy --proxy http://127.0.0.1:8000 --num-generations 8 \
        --groups-per-step 4 --learning-rate 1e-3 --lora-r 8 --lora-alpha 16 --max-staleness 2 \
        --max-completion-length 6 --max-steps 24
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_trainer.py -q   # the tests

The token for the proxy comes from PROXY_TOKEN. The trainer never generates: rollout.py replicas
do, with the adapter versions this file publishes to the bucket (adapters/v{N:06d}, LATEST).
Killed at any moment (SIGKILL, preemption), the same command resumes from the last saved state
(bucket trainer/), loses at most the steps since that save, and never publishes a version twice.
Logs on stdout: the first line says "resumed from step S, version V" or "starting fresh"; then
"step N vV | reward ...", "published vV at step N", "saved state at step N (version V)", "done: ...".

Where this departs from the GRPO paper (DeepSeekMath) and TRL's GRPOTrainer:
1. The old policy is the replica's sampler: ratio = exp(logpi_theta - logp_sampler), with the
   log-probs vLLM returned, not recomputed here (as TRL's AsyncGRPOTrainer). The ratio so also
   absorbs the small mismatch between the inference engine's numerics and the trainer's.
2. Groups may be up to --max-staleness versions old (the proxy drops older ones); a version is one
   adapter publication, so with --sync-every 1 staleness counts optimizer steps.
3. One optimizer step per batch (TRL's num_iterations = 1, mu = 1 in the paper).
4. Zero-variance groups (all rewards equal) are skipped and more pulled until --groups-per-step
   usable ones are in hand (DAPO's dynamic sampling; TRL keeps them, with zero advantage, in the
   normaliser). So that a solved task cannot stall the run, 4 x --groups-per-step skipped groups
   with no usable one make a step with no update (and nothing new to publish).
5. Constant learning rate, no warmup (TRL decays linearly by default); AdamW, no weight decay.
6. The reference policy for --beta > 0 is the base model, i.e. the same weights with the adapter
   disabled (what TRL does with PEFT), not a frozen copy of a starting checkpoint.
7. Completions longer than --max-completion-length are cut to it (the replica's --max-new-tokens
   should not exceed it); the cut ones are counted in the metrics as `truncated`.
"""

import argparse
import os
import random
import sys
import tempfile
import time

import torch

import grpo_loss
import sync
from proxy import ProxyClient, ProxyError

GUARD_WINDOW = 3  # steps the newest policy_version must stand still before the guard speaks


class TrainerError(Exception):
    """A misconfiguration or a run that cannot go on; the message says what to do."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="base model: a Hub id or a local folder")
    a("--bucket", required=True, help="a directory (or mounted bucket) or s3://bucket/prefix")
    a("--proxy", required=True, help="the proxy's URL, e.g. http://127.0.0.1:8000 (token: env PROXY_TOKEN)")
    a("--num-generations", type=int, default=8, help="completions per prompt (G); other group sizes are an error")
    a("--groups-per-step", type=int, default=16, help="usable groups (prompts) per optimizer step")
    a("--epsilon", type=float, default=0.2, help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=float, default=None, help="upper clip: ratio <= 1 + epsilon_high (default: epsilon)")
    a("--beta", type=float, default=0.0, help="KL coefficient against the base model (adapter disabled); 0 = no KL")
    a("--loss-type", default="dapo", choices=["grpo", "bnpo", "dr_grpo", "dapo"], help="loss normalisation, as in TRL")
    a("--scale-rewards", default="group", choices=["group", "batch", "none"],
      help="divide advantages by the group's std, the batch's, or nothing")
    a("--max-completion-length", type=int, default=256, help="longer completions are cut; dr_grpo's normaliser")
    a("--temperature", type=float, default=1.0, help="the replicas' sampling temperature: logits are divided by it")
    a("--learning-rate", type=float, default=1e-5, help="AdamW learning rate (constant)")
    a("--max-grad-norm", type=float, default=1.0, help="clip the LoRA gradient's global norm to this")
    a("--max-steps", type=int, default=500, help="stop after this many optimizer steps (counted across restarts)")
    a("--max-staleness", type=int, default=4, help="the proxy's staleness bound; sets how many versions to keep")
    a("--micro-batch-tokens", type=int, default=8192, help="tokens (padding counted) per forward/backward pass")
    a("--sync-every", type=int, default=1, help="publish the adapter every this many steps")
    a("--save-every", type=int, default=10, help="save resume state every this many steps (a multiple of --sync-every)")
    a("--seed", type=int, default=0, help="seed for the LoRA init and torch's/python's RNGs")
    a("--lora-r", type=int, default=16, help="LoRA rank (vLLM wants 1, 8, 16, 32, 64, ...)")
    a("--lora-alpha", type=int, default=32, help="LoRA alpha (scale = alpha / r)")
    a("--lora-target", default="all-linear", help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj")
    a("--wait-timeout", type=float, default=1800.0, help="seconds with no usable group before giving up (0: never)")
    a("--bucket-retry", type=float, default=300.0, help="seconds to retry a bucket that worked before (an outage)")
    a("--report-to", default="none", choices=["none", "trackio", "wandb"], help="also send each step's metrics there")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- model

def build_model(model_name, lora_r=16, lora_alpha=32, lora_target="all-linear", seed=0):
    """Base model + fresh LoRA (B = 0, so version 0 is the base policy). bf16 on GPU, fp32 on CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    base = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.bfloat16 if cuda else torch.float32)
    base = base.to("cuda" if cuda else "cpu")
    base.config.use_cache = False
    targets = lora_target if lora_target == "all-linear" else [t.strip() for t in lora_target.split(",")]
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=targets,
                        task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    return get_peft_model(base, config)  # adapter weights are kept in fp32 (autocast_adapter_dtype)


def lora_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- batch

def check_group(g, num_generations):
    """A group must hold G completions (the proxy has checked one log-prob per generated id)."""
    n = len(g["completions"])
    if n != num_generations:
        raise TrainerError(f"group {g.get('group_id')} from worker {g.get('worker')} has {n} completions but "
                           f"the trainer runs --num-generations {num_generations}: start rollout.py with "
                           f"--num-generations {num_generations} (or change the trainer's)")


def flatten_groups(groups, num_generations, max_completion_length):
    """Groups (proxy JSON) -> one record per completion, in group order."""
    seqs = []
    for g in groups:
        check_group(g, num_generations)
        for c in g["completions"]:
            cut = len(c["ids"]) > max_completion_length
            seqs.append({"prompt_ids": list(g["prompt_ids"]), "ids": list(c["ids"][:max_completion_length]),
                         "logprobs": list(c["logprobs"][:max_completion_length]), "reward": float(c["reward"]),
                         "policy_version": int(g["policy_version"]), "truncated": cut})
    return seqs


def make_microbatches(seqs, max_tokens):
    """Split sequence indices into micro-batches of at most max_tokens each, padding counted:
    a micro-batch costs n * (longest prompt + longest completion). Longest first, so an
    out-of-memory shows up on the first pass; a sequence over the budget goes alone."""
    def cost(idx):
        return len(idx) * (max(len(seqs[i]["prompt_ids"]) for i in idx) + max(len(seqs[i]["ids"]) for i in idx))

    batches = []
    for i in sorted(range(len(seqs)), key=lambda i: -(len(seqs[i]["prompt_ids"]) + len(seqs[i]["ids"]))):
        if batches and cost(batches[-1] + [i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def collate(seqs, idx, advantages, device):
    """Left-pad prompts and right-pad completions, so every completion starts at the same column
    (as TRL lays out its batch): [pad.. prompt | completion ..pad]. Padding is id 0; the masks hide it."""
    P = max(len(seqs[i]["prompt_ids"]) for i in idx)
    C = max(len(seqs[i]["ids"]) for i in idx)
    input_ids = torch.zeros((len(idx), P + C), dtype=torch.long)  # (n, P+C)
    attn = torch.zeros_like(input_ids)  # (n, P+C) 1 on prompt and completion tokens
    old = torch.zeros((len(idx), C))  # (n, C) sampler log-probs, 0 on padding
    mask = torch.zeros((len(idx), C))  # (n, C) 1 on generated tokens (EOS included), from lengths
    for r, i in enumerate(idx):
        pr, ids = seqs[i]["prompt_ids"], seqs[i]["ids"]
        input_ids[r, P - len(pr):P + len(ids)] = torch.tensor(list(pr) + list(ids))
        attn[r, P - len(pr):P + len(ids)] = 1
        old[r, :len(ids)] = torch.tensor(seqs[i]["logprobs"])
        mask[r, :len(ids)] = 1.0
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # (n, P+C) positions as if unpadded
    mb = {"input_ids": input_ids, "attention_mask": attn, "position_ids": position_ids,
          "completion_ids": input_ids[:, P:],  # (n, C) the completion columns, 0 after each one's end
          "old_logprobs": old, "mask": mask, "advantages": advantages[list(idx)]}
    return {k: t.to(device) for k, t in mb.items()}


def completion_logprobs(model, mb, temperature=1.0):
    """Current log-probs of the completion tokens; logits only for completion positions."""
    C = mb["completion_ids"].shape[1]
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"],
                   logits_to_keep=C + 1, use_cache=False).logits  # (n, C+1, V)
    logits = logits[:, :-1, :]  # (n, C, V) position j predicts completion token j (a view, no copy)
    return grpo_loss.token_logprobs(logits, mb["completion_ids"], temperature)  # (n, C) logits / temperature


def compute_loss_and_backward(model, seqs, advantages, microbatches, loss_type="dapo", epsilon=0.2,
                              epsilon_high=None, beta=0.0, max_completion_length=None, temperature=1.0):
    """Accumulate the full-batch GRPO gradient over micro-batches; returns the batch's loss and stats.
    Each micro-batch's loss is scaled (grpo_loss.microbatch_weight) so the sum equals the full batch's."""
    device = next(model.parameters()).device
    total_tokens = sum(len(s["ids"]) for s in seqs)
    sums = {"loss": 0.0}
    for idx in microbatches:
        mb = collate(seqs, idx, advantages, device)
        logps = completion_logprobs(model, mb, temperature)  # (n, C)
        ref = None
        if beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref = completion_logprobs(model, mb, temperature)  # (n, C) base model
        loss, stats = grpo_loss.policy_loss(
            logps, mb["old_logprobs"], mb["advantages"], mb["mask"], epsilon=epsilon, epsilon_high=epsilon_high,
            loss_type=loss_type, max_completion_length=max_completion_length,
            num_tokens=total_tokens if loss_type == "dapo" else None, ref_logprobs=ref, beta=beta)
        weight = grpo_loss.microbatch_weight(loss_type, mb["mask"], len(seqs), total_tokens)  # dapo: 1
        (loss * weight).backward()
        sums["loss"] += loss.item() * weight
        share = float(mb["mask"].sum()) / max(total_tokens, 1)  # token-weighted mean of the stats
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v * share
    return sums


# ----------------------------------------------------------------------------- guard

def guard_check(history, max_staleness, starved=False, window=GUARD_WINDOW):
    """The silent failure of async RL: replicas that never pick up new adapters. history: one dict
    per step (version, newest_policy, ratio_mean, clip_low_frac, clip_high_frac, staleness_mean).
    A newest policy_version standing still is normal at start-up or with slow replicas; it is a
    failure only when the trainer then starves (`starved`: the proxy drops every group as too
    stale). Returns the reasons to warn, [] when all is well."""
    reasons = []
    if starved and len(history) >= window:
        last = history[-window:]
        newest = last[-1]["newest_policy"]
        behind = last[-1]["version"] - newest
        if all(h["newest_policy"] == newest for h in last) and behind >= max(2, max_staleness):
            reasons.append(f"the newest policy_version in the batches has stayed at {newest} for {window} steps "
                           f"while the trainer published up to version {last[-1]['version']}")
    if history:
        h = history[-1]
        if h["staleness_mean"] > 0 and h["ratio_mean"] == 1.0 and h["clip_low_frac"] == 0 and h["clip_high_frac"] == 0:
            reasons.append("ratio_mean is exactly 1.0 with no clipping although the groups are stale "
                           f"(mean staleness {h['staleness_mean']:.2f}): the old log-probs cannot be the sampler's")
    return reasons


def guard_message(reasons, bucket_url):
    lines = ["", "=" * 78, "WARNING: the replicas may not be following the trainer's adapters:"]
    lines += [f"  - {r}" for r in reasons]
    lines += ["Check:",
              f"  1. every rollout.py replica runs with --bucket {bucket_url} (the same path or URL),",
              "  2. the replicas can read adapters/LATEST there (mount, credentials, AWS_ENDPOINT_URL),",
              "  3. the replicas' logs show 'adapter v<N> loaded' lines with N rising,",
              "  4. the replicas send the sampler's log-probs of the tokens they generated.", "=" * 78]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- data

def gather_groups(client, n, version, max_staleness, wait_timeout, bucket_url, on_starved=None):
    """Long-poll the proxy until n usable groups (rewards not all equal) are in hand, or 4n skipped
    ones and no usable one (a solved task). Returns (usable, skipped): skipped ones have no signal.
    Groups more than max_staleness behind `version` are dropped: only a proxy restarted since the
    last POST /version hands them out. on_starved() is called once when the wait passes starve_s."""
    groups, skipped = [], []
    start = last_log = time.time()
    starve_s = min(30.0, wait_timeout / 2) if wait_timeout else 30.0
    while len(groups) < n and (groups or len(skipped) < 4 * n):
        waited = time.time() - start
        if wait_timeout and waited > wait_timeout:
            raise TrainerError(f"no usable groups for {waited:.0f}s (have {len(groups)}/{n}, {len(skipped)} skipped "
                               "with equal rewards): check that rollout.py replicas run against this proxy and "
                               f"--bucket {bucket_url}, and their logs; raise --wait-timeout for slow starts")
        if time.time() - last_log > 60:
            r = [c["reward"] for g in skipped for c in g["completions"]]
            print(f"waiting for groups: {len(groups)}/{n} after {waited:.0f}s; {len(skipped)} skipped with equal "
                  f"rewards (their mean {sum(r) / max(len(r), 1):.3f}: 1.0 means the task is solved for this policy)")
            last_log = time.time()
        if on_starved and waited >= starve_s:
            on_starved()
            on_starved = None
        poll = max(0.5, min(30.0, (wait_timeout or 1e9) - waited, starve_s - waited if on_starved else 30.0))
        batch = client.get_batch(n - len(groups), timeout=poll)["groups"]
        fresh = [g for g in batch if version - g["policy_version"] <= max_staleness]
        if len(fresh) < len(batch):
            print(f"dropped {len(batch) - len(fresh)} groups more than --max-staleness {max_staleness} "
                  f"behind v{version} (the proxy restarted and did not know the trainer's version yet)")
        for g in fresh:
            rewards = [c["reward"] for c in g["completions"]]
            (skipped if max(rewards) == min(rewards) else groups).append(g)
    return groups, skipped


# ----------------------------------------------------------------------------- state

def publish(model, bucket, version, keep, base_model, step):
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        sync.publish_adapter(bucket, d, version, keep=keep, base_model=base_model, step=step)


def save_state(model, optimizer, bucket, state):
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = dict(state, optimizer=optimizer.state_dict(), rng_python=random.getstate(),
                     rng_torch=torch.get_rng_state(),
                     rng_cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        torch.save(state, os.path.join(d, "state.pt"))
        sync.save_trainer_state(bucket, d)


def restore_state(model, optimizer, state_dir, state):
    """Load the LoRA weights, optimizer and RNGs that save_state wrote to state_dir."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(os.path.join(state_dir, "adapter_model.safetensors")))
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng_python"])
    torch.set_rng_state(state["rng_torch"])
    if state.get("rng_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


def starting_version(state, latest, seen=()):
    """(version, publish?) for a trainer starting with resume state `state` (or None) on a bucket
    whose LATEST is `latest` (or None) and that holds files of versions `seen` (complete or torn by
    a kill mid-publish). A number the bucket has seen is never published again; the bucket's
    newest adapter is reused only when it holds exactly the saved weights."""
    if state and state["published_step"] == state["step"] and latest == state["version"] \
            and max(seen, default=-1) <= latest:
        return state["version"], False
    known = [v for v in (latest, state["version"] if state else None, *seen) if v is not None]
    return (1 + max(known) if known else 0), True


def make_reporter(kind, args):
    """The trackio or wandb module, initialised (both have init/log/finish); None for "none"."""
    if kind == "none":
        return None
    try:
        mod = __import__(kind)
    except ImportError:
        raise TrainerError(f"--report-to {kind} needs the {kind} package: pip install {kind} (or --report-to none)")
    mod.init(project="async-grpo-lora", config=vars(args))
    return mod


# ----------------------------------------------------------------------------- main

def train(args):
    bucket = sync.open_bucket(args.bucket, retry_s=args.bucket_retry)  # rides out outages once it worked
    tmp = tempfile.TemporaryDirectory()
    state_dir = sync.load_trainer_state(bucket, tmp.name)
    state = torch.load(os.path.join(state_dir, "state.pt"), weights_only=False) if state_dir else None
    print(f"resumed from step {state['step']}, version {state['version']} (state in {bucket.url}/trainer)"
          if state else f"starting fresh: no trainer state in {bucket.url}")
    client = ProxyClient(args.proxy, token=os.environ.get("PROXY_TOKEN"))
    proxy_version = client.stats()["trainer_version"]  # a wrong URL or token fails here, before any work
    latest = sync.latest_version(bucket)
    version, must_publish = starting_version(state, latest, sync.versions(bucket))
    if proxy_version > version:
        raise TrainerError(f"the proxy at {args.proxy} is at trainer version {proxy_version}, ahead of this "
                           f"run's v{version} ({bucket.url}): it serves another run; restart the proxy or pass "
                           "that run's bucket")
    if latest is not None and not state:
        print(f"note: {bucket.url} already holds adapters up to v{latest}; this run starts at v{version}")
    reporter = make_reporter(args.report_to, args)
    random.seed(args.seed)
    model = build_model(args.model, args.lora_r, args.lora_alpha, args.lora_target, args.seed)
    model.eval()  # no dropout: the recomputed log-probs must be the policy the sampler ran
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
    keep = args.max_staleness + 2

    step, groups_consumed, guard = 0, 0, {"history": [], "warned_step": -10**9}
    if state:
        try:
            restore_state(model, optimizer, state_dir, state)
        except (RuntimeError, ValueError) as e:  # e.g. size mismatch: the state belongs to another model
            saved = state.get("args", {})
            raise TrainerError(f"the state in {bucket.url}/trainer (--model {saved.get('model')}, --lora-r "
                               f"{saved.get('lora_r')}) does not fit --model {args.model} --lora-r {args.lora_r} "
                               f"({str(e).strip().splitlines()[0][:160]}): run with that run's settings, or "
                               "another --bucket") from None
        step, groups_consumed, guard = state["step"], state["groups_consumed"], state["guard"]
    tmp.cleanup()

    def warn(reasons):
        if reasons:
            print(guard_message(reasons, bucket.url), file=sys.stderr)
            guard["warned_step"] = step

    def snapshot(version, published_step):
        return {"step": step, "version": version, "published_step": published_step,
                "groups_consumed": groups_consumed, "guard": guard, "args": vars(args)}

    if must_publish:  # v0 (the untrained LoRA), or the restored weights under a new number
        publish(model, bucket, version, keep, args.model, step)
        print(f"published v{version} at step {step}")
        save_state(model, optimizer, bucket, snapshot(version, step))
    client.set_version(version)
    published_step, updated_since_publish = step, False

    while step < args.max_steps:
        t0 = time.time()
        groups, skipped = gather_groups(client, args.groups_per_step, version, args.max_staleness,
                                        args.wait_timeout, bucket.url,
                                        on_starved=lambda: warn(guard_check(guard["history"], args.max_staleness,
                                                                            starved=True)))
        groups_consumed += len(groups) + len(skipped)
        for g in skipped:
            check_group(g, args.num_generations)
        t1 = time.time()
        seqs = flatten_groups(groups, args.num_generations, args.max_completion_length)
        mbs = make_microbatches(seqs, args.micro_batch_tokens)
        stats, grad_norm = {}, 0.0
        if seqs:  # else every group had equal rewards: no learning signal, no optimizer step
            rewards = torch.tensor([s["reward"] for s in seqs])  # (B,) B = groups * G
            advantages = grpo_loss.group_advantages(rewards, args.num_generations, args.scale_rewards)  # (B,)
            optimizer.zero_grad(set_to_none=True)
            stats = compute_loss_and_backward(model, seqs, advantages, mbs, args.loss_type, args.epsilon,
                                              args.epsilon_high, args.beta, args.max_completion_length,
                                              args.temperature)  # loss, ratio_mean, clip_*_frac, [kl]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
            optimizer.step()
            updated_since_publish = True
        step += 1
        t2 = time.time()

        stale = [version - g["policy_version"] for g in (groups or skipped)]
        tokens = sum(len(s["ids"]) for s in seqs)
        sampled = torch.tensor([c["reward"] for g in groups + skipped for c in g["completions"]])  # skipped too
        rec = {"step": step, "version": version, "reward_mean": sampled.mean().item(),
               "reward_std": sampled.std().item(), "groups_used": len(groups), "groups_skipped": len(skipped),
               "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
               "policy_versions": sorted({g["policy_version"] for g in groups or skipped}), "tokens": tokens,
               "truncated": sum(s["truncated"] for s in seqs), "grad_norm": grad_norm,
               "loss": 0.0, "ratio_mean": None, "clip_low_frac": 0.0, "clip_high_frac": 0.0,  # a step with no update
               **({"kl": 0.0} if args.beta > 0 else {}), **stats,
               "learning_rate": optimizer.param_groups[0]["lr"], "micro_batches": len(mbs),
               "wait_s": round(t1 - t0, 3), "compute_s": round(t2 - t1, 3),
               "tokens_per_s": round(tokens / max(t2 - t1, 1e-9), 1), "time": time.time()}
        sync.append_metrics(bucket, rec)
        if reporter:  # the same numbers (lists such as policy_versions left out)
            reporter.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
        print(f"step {step} v{version} | reward {rec['reward_mean']:.3f} ± {rec['reward_std']:.3f} | groups "
              f"{len(groups)} (+{len(skipped)} skipped) | stale {rec['staleness_mean']:.2f}/{rec['staleness_max']} | "
              f"loss {rec['loss']:.4f} ratio {rec['ratio_mean'] or 0:.4f} clip {rec['clip_low_frac']:.3f}/"
              f"{rec['clip_high_frac']:.3f}" + (f" kl {rec['kl']:.4f}" if args.beta > 0 else "") +
              f" | gnorm {grad_norm:.3f} | wait {rec['wait_s']:.2f}s compute {rec['compute_s']:.2f}s "
              f"{rec['tokens_per_s']:.0f} tok/s")

        guard["history"] = (guard["history"] + [dict(rec, newest_policy=max(rec["policy_versions"]))])[-GUARD_WINDOW:]
        if step - guard["warned_step"] >= 10:  # loud, but not on every line
            warn(guard_check(guard["history"], args.max_staleness))

        if (step % args.sync_every == 0 or step == args.max_steps) and updated_since_publish:
            updated_since_publish = False
            version += 1
            publish(model, bucket, version, keep, args.model, step)
            client.set_version(version)
            published_step = step
            print(f"published v{version} at step {step}")
        if step % args.save_every == 0 or step == args.max_steps:
            save_state(model, optimizer, bucket, snapshot(version, published_step))
            print(f"saved state at step {step} (version {version})")
    if reporter:
        reporter.finish()
    print(f"done: {step} steps, last version v{version}, {groups_consumed} groups consumed")


def main(argv=None):
    args = parse_args(argv)
    for flag in ("num_generations", "groups_per_step", "sync_every", "save_every", "micro_batch_tokens"):
        if getattr(args, flag) < 1:
            sys.exit(f"trainer.py: error: --{flag.replace('_', '-')} must be >= 1")
    sys.stdout.reconfigure(line_buffering=True)  # each log line reaches a piped log (or a watcher) at once
    try:
        train(args)
    except (ProxyError, sync.BucketError, TrainerError) as e:
        sys.exit(f"trainer.py: error: {e}")


if __name__ == "__main__":
    main()
