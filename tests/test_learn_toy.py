"""GRPO with grpo_loss.py must learn: on the tiny model, a toy reward goes from ~0 to ~1.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_learn_toy.py -q

The task is rollout.py's "toy" task: prompt "Say a digit." through the chat template, reward 1.0
when the completion contains "7". The untrained model writes random characters (a "7" in ~6% of
completions). Each step samples groups with transformers' generate (do_sample, top_k=0,
top_p=1.0, as the vLLM sampler does), keeps the sampler's own log-probs as the behaviour policy,
and takes two optimizer steps on the batch (TRL's num_iterations=2), each split into two uneven
micro-batches weighted by microbatch_weight, so the clipped ratio and the weighting are both used.
"""

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_loss import group_advantages, microbatch_weight, policy_loss, token_logprobs

STEPS = 24          # GRPO steps (batches of rollouts)
GROUPS = 4          # prompts per step (all the same prompt here)
GROUP_SIZE = 8      # completions per prompt, TRL's num_generations
MAX_NEW = 6         # max_completion_length
LR = 3e-3           # LoRA r=8 on a 0.6M-parameter model wants a large learning rate
ITERATIONS = 2      # optimizer steps per batch: the second sees ratio != 1


def reward(text):
    return 1.0 if "7" in text else 0.0


def completion_mask(comp, eos_id):
    """(N, T) generated ids -> (N, T) float, 1 up to and including the first EOS (or all T)."""
    is_eos = comp == eos_id  # (N, T)
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), comp.size(1))  # (N,)
    return (torch.arange(comp.size(1)) <= first.unsqueeze(1)).float()  # (N, T)


def sample(model, tok, prompt_ids, n, seed):
    """n completions of the prompt: ids (n, T), mask (n, T), sampler log-probs (n, T), rewards (n,)."""
    torch.manual_seed(seed)
    P = prompt_ids.size(1)
    model.eval()
    with torch.no_grad():
        out = model.generate(prompt_ids.expand(n, -1), attention_mask=torch.ones(n, P, dtype=torch.long),
                             do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=MAX_NEW,
                             output_scores=True, return_dict_in_generate=True)
    comp = out.sequences[:, P:]  # (n, T)
    mask = completion_mask(comp, tok.eos_token_id)  # (n, T)
    behaviour = token_logprobs(torch.stack(out.scores, 1), comp)  # (n, T) the sampler's log-probs
    texts = [tok.decode(c[: int(m.sum())], skip_special_tokens=True) for c, m in zip(comp, mask)]
    rewards = torch.tensor([reward(t) for t in texts])  # (n,)
    return comp, mask, behaviour, rewards


def mean_reward(model, tok, prompt_ids, n=256):
    return sample(model, tok, prompt_ids, n, seed=12345)[3].mean().item()


def test_grpo_learns_toy_reward(tiny_model):
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say a digit."}], tokenize=False,
                                     add_generation_prompt=True)
    prompt_ids = tok(prompt, return_tensors="pt").input_ids  # (1, P)
    P = prompt_ids.size(1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)

    start = mean_reward(model, tok, prompt_ids)
    assert start < 0.2, f"the untrained model already earns {start}: the test shows nothing"

    n = GROUPS * GROUP_SIZE
    clipped = 0.0
    for step in range(STEPS):
        comp, mask, behaviour, rewards = sample(model, tok, prompt_ids, n, seed=step)
        advantages = group_advantages(rewards, GROUP_SIZE)  # (n,)
        ids = torch.cat([prompt_ids.expand(n, -1), comp], 1)  # (n, P + T)
        total_tokens = mask.sum()
        model.train()
        for _ in range(ITERATIONS):
            opt.zero_grad()
            for mb in (slice(0, n // 4), slice(n // 4, n)):  # uneven micro-batches: 8 and 24 rows
                logits = model(ids[mb]).logits[:, P - 1:-1]  # (b, T, V) the logits that predict comp
                logprobs = token_logprobs(logits, comp[mb])  # (b, T)
                loss, stats = policy_loss(logprobs, behaviour[mb], advantages[mb], mask[mb],
                                          loss_type="dapo", num_tokens=total_tokens)
                (microbatch_weight("dapo", mask[mb], n, 2) * loss).backward()
                clipped += stats["clip_low_frac"] + stats["clip_high_frac"]
            opt.step()

    end = mean_reward(model, tok, prompt_ids)
    assert end > 0.8, f"reward went {start:.3f} -> {end:.3f} in {STEPS} GRPO steps; expected > 0.8"
    assert clipped > 0, "no token was ever clipped: the second iteration should move the ratio"
