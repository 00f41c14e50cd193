"""The trainer's model, its optimizer and its resume state: what trainer.py needs around the
GRPO step. A fresh start (no state in the bucket): resume_point's first docstring line.

    build_model, make_optimizer  the base model + a fresh LoRA; AdamW (departure 5)
    start_run    everything before the first step: where the run starts, the model and AdamW
                 (restored from the resume state if there is one), --report-to
    resume_point the resume state in the bucket (checked; with env TRAINER_STATE_KEY,
                 authenticated, and refused when older than the newest this trainer saved) and
                 the first version (starting_version, after the trainer's own: numbers_to_follow)
    write_state  the resume state trainer.publish saves beside the adapter (state.pt, its HMAC)

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_trainer.py -q

This module imports no role file.
"""

import hashlib
import hmac
import os
import pickle
import random
import re
import sys
import tempfile
from types import SimpleNamespace

import torch

from support.adapter_tags import (MAX_VERSION, adapter_key, own_versions, read_latest,
                                  version_numbers)
from support.buckets import LATEST, Foreign, load_trainer_state
from support.defaults import DEFAULTS
from support.devices import card_dtype  # the dtype for this card: one rule, trainer and replicas


class TrainerError(Exception):
    """A misconfiguration or a run that cannot go on; the message says what to do."""


# ---- the model and its optimizer

def build_model(model_name, lora_r=DEFAULTS["lora_r"], lora_alpha=DEFAULTS["lora_alpha"],
                lora_target=DEFAULTS["lora_target"], seed=DEFAULTS["seed"], device=None):
    """Base model + fresh LoRA (B = 0, so version 0 is the base policy). The dtype is the card's
    (support/devices.py card_dtype, the replicas' rule too): bf16 on a GPU of compute capability
    >= 8.0, a TrainerError below it, fp32 on a CPU. device: "cuda" when there is a GPU, else
    "cpu"; --fsdp: "cpu" (sharding puts each rank's shard on its GPU: support/fsdp.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gpu = torch.cuda.is_available()
    try:  # before any weight is read: a card without bf16 is refused at once
        name = card_dtype(torch.cuda.get_device_capability() if gpu else None, "trainer",
                          torch.cuda.get_device_name() if gpu else "")
    except ValueError as e:
        raise TrainerError(str(e)) from None
    dtype, device = getattr(torch, name), device or ("cuda" if gpu else "cpu")
    base = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(device)
    base.config.use_cache = False
    targets = lora_target if lora_target == "all-linear" \
        else [t.strip() for t in lora_target.split(",")]
    # no dropout: the trainer runs the model in eval mode (its log-probs are the sampler's policy)
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    return get_peft_model(base, lora)  # adapter weights are kept in fp32 (autocast_adapter_dtype)


def lora_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


def saves_state(step, args):
    """Whether the publish after `step` also saves the resume state: every --save-every steps
    and at the last."""
    return step % args.save_every == 0 or step == args.max_steps


def make_optimizer(params, args):
    """AdamW with --weight-decay (0, TRL's default); a resume state must match it (state_problem).
    The gradients start at 0, not None: a first step whose groups all have equal rewards (no
    backward) still steps AdamW's count, as TRL's (whose backward makes zeros) does."""
    params = list(params)
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)


# ---- the start of a run: the resume state, the model, the first version

def start_run(args, bucket, contract):
    """Everything before the first step: where the run starts (resume_point: in an empty bucket
    step 0 and v0 to publish), build_model's model and make_optimizer's AdamW, restored from the
    resume state if there is one, and --report-to started. Returns a namespace: bucket, model,
    optimizer, step, version, must_publish, groups_consumed, key, adapter_key (env ADAPTER_KEY),
    saved_step (the step of the newest resume state saved), limits (what group_problem checks a
    group against), reporter."""
    tmp, key = tempfile.TemporaryDirectory(), os.environ.get("TRAINER_STATE_KEY") or None
    state, state_dir, version, must_publish = resume_point(args, bucket, contract, key, tmp.name)
    reporter = start_reporter(args)
    random.seed(args.seed)
    model = build_model(args.model, args.lora_r, args.lora_alpha, args.lora_target, args.seed,
                        device="cpu" if args.fsdp else None)  # --fsdp: sharded in start_alike
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
                           groups_consumed=groups_consumed, key=key, adapter_key=adapter_key(),
                           saved_step=state["step"] if state else None, limits=limits,
                           reporter=reporter)


def resume_point(args, bucket, contract, key, tmp):
    """(state, its folder, first version, publish it?): in an empty bucket (None, None, 0, True):
    the run publishes v0 first (tests/test_trainer.py::test_run_learns_the_toy_task).
    Else the resume state in the bucket, loaded into tmp and checked (with key, env
    TRAINER_STATE_KEY: authenticated, and refused when older than the newest this trainer saved),
    and the first version from the bucket's LATEST and version folders (starting_version, as
    numbers_to_follow reads them). Prints the run's first lines."""
    state_dir = load_trainer_state(bucket, tmp)
    state = load_state(state_dir, key, bucket.url)  # authenticated with a key; checked in any case
    probe = make_optimizer([torch.zeros(1)], args)  # this trainer's AdamW settings
    if state is not None and (why := state_problem(state, probe)):
        raise TrainerError(f"{bucket.url}/trainer: the resume state does not fit this trainer "
                           f"({why}): not written by trainer.py? remove {bucket.url}/trainer to "
                           "start fresh (and set TRAINER_STATE_KEY: an HMAC then shows who wrote "
                           "it)")
    where = f"{bucket.url}/trainer"
    latest, seen, own = numbers_to_follow(bucket, key, state)
    if state is not None and (why := older_than_saved(state, own)):
        raise TrainerError(f"{where}: {why}: put back the newest trainer/ state, or remove {where} "
                           "to start afresh")
    print(f"resumed from step {state['step']}, version {state['version']} (state in {where})"
          if state else f"starting fresh: no trainer state in {bucket.url}")
    print(f"run settings from the proxy: {contract}")
    version, must_publish = starting_version(state, latest, seen)
    if version + max(0, args.max_steps - (state["step"] if state else 0)) >= MAX_VERSION:
        raise TrainerError(no_room(bucket.url, version, args.max_steps, latest, seen, state))
    if latest is not None and not state:
        print(f"note: {bucket.url} already holds adapters up to v{latest}; this run starts at "
              f"v{version}")
    return state, state_dir, version, must_publish


def start_reporter(args):
    """--report-to: the trackio or wandb module (both have init/log/finish), started; none: None."""
    kind = args.report_to
    if kind == "none":
        return None
    try:
        reporter = __import__(kind)
    except ImportError:
        raise TrainerError(f"--report-to {kind} needs the {kind} package: pip install {kind} "
                           "(or --report-to none)")
    reporter.init(project="async-grpo-lora", config=vars(args))
    return reporter


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


def write_state(folder, state, adamw, key=None):
    """The resume state into folder (beside the adapter's files): state.pt with AdamW's state
    (optimizer.state_dict() of one process; --fsdp: gathered, the same format) and the RNGs, and
    with a key (env TRAINER_STATE_KEY) its HMAC tag."""
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    full = dict(state, optimizer=adamw, rng_python=random.getstate(),
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


def numbers_to_follow(b, key, state):
    """(latest, seen, own) of the bucket b for starting_version. Without a key: LATEST (a
    BucketError if it is not {"version": N}) and every version folder, own {}. With key (env
    TRAINER_STATE_KEY): own = {version: manifest} of the versions whose manifest carries this
    trainer's tag (support/adapter_tags.py), seen = those and the one folder right after the
    newest of them and of the state's (a publish a kill cut short: never reused; a kill stops one
    publish, so a second untagged folder is not its own), latest = LATEST if it names one of them.
    A LATEST (of any shape or size) or a folder past them that the trainer did not write is named
    on stderr and passed over (its next publish replaces LATEST, writes over such a folder): a
    bucket writer can neither end the run nor make it skip ahead."""
    if not key:
        return read_latest(b)[0], version_numbers(b), {}
    own, numbers = own_versions(b, key), version_numbers(b)
    seen, top = set(own), max([*own, state["version"] if state else -1])
    if top + 1 in numbers:  # the folder of a publish a kill cut short (or a planted one)
        top += 1
        seen.add(top)
    try:
        latest, what = read_latest(b)[0], None
    except Foreign:  # not even {"version": N}, or larger or deeper than trainer.py writes it
        latest, what = None, f"{LATEST} (not {{\"version\": N}})"
    if latest is not None and latest not in own:
        latest, what = None, f"{LATEST} (v{latest})"
    passed = [what] * (what is not None) + [f"adapters/v{n:06d}/" for n in numbers if n > top]
    if passed:
        print(f"trainer: {b.url}: not published by this trainer (no tag under TRAINER_STATE_KEY), "
              f"passed over: {', '.join(passed[:4])}{' ...' * (len(passed) > 4)}; its next "
              f"publish replaces {LATEST}", file=sys.stderr, flush=True)
    return latest, seen, own


def older_than_saved(state, own):
    """Why the resume state is older than the newest one this trainer had saved (the largest
    "state_step" of its own manifests: a copy of trainer/ put back later), or None. A state one
    save older cannot be told from a kill during that save, and is accepted."""
    saved = [(m["state_step"], v) for v, m in own.items() if type(m.get("state_step")) is int]
    if saved and (newest := max(saved))[0] > state["step"]:
        return (f"the resume state is from step {state['step']}, but this trainer had saved one "
                f"at step {newest[0]} (its manifest adapters/v{newest[1]:06d}, tagged under "
                "TRAINER_STATE_KEY, says so): an older copy of trainer/ was put back")
    return None


def no_room(url, version, max_steps, latest, seen, state):
    """The error for a run whose versions would pass 2^31 - 1: it names the largest number in the
    way (to delete)."""
    named = [(n, f"adapters/v{n:06d}/") for n in seen] + [(latest, LATEST)] * (latest is not None)
    named += [(state["version"], "trainer/")] if state else []
    if not named:
        return f"--max-steps {max_steps} needs versions past 2^31 - 1, their limit: lower it"
    number, culprit = max(named)
    return (f"{url}/{culprit} (v{number}) leaves no room below 2^31, the versions' limit, for "
            f"this run's versions (v{version} on, one a step up to --max-steps {max_steps}); "
            "trainer.py never writes such a number: delete it, then start again (with "
            "TRAINER_STATE_KEY set, the trainer passes over a LATEST or a version it did not "
            "publish)")


# ---- the resume state: what a bucket writer can plant is checked before it is loaded

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
