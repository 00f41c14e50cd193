"""The shared-prompt forward of README's step 7 (trainer.py): the same log-probs and gradients as
trainer.plain_logprobs (tests/test_shared_prompt.py checks them equal), each prompt forwarded
once per group instead of once per completion; and the micro-batches of whole groups it needs.

    make_microbatches        the step's rows in micro-batches of whole groups, <= max_tokens each
                             (and at least one per rank, data parallel)
    plain_logprobs_fast      plain_logprobs of a micro-batch, each prompt through the model once
    collate                  its tensors: the prompts' common prefix, the rests of the prompts,
                             the completions, and which prompt row each completion continues

This module imports no role file.
"""

import os

import torch

from support.defaults import DEFAULTS  # the temperature's: the run's


def by_group(seqs, idx):
    """Sequence indices -> lists of them, one per group, in first-seen order."""
    groups = {}
    for i in idx:
        groups.setdefault(seqs[i]["group"], []).append(i)
    return list(groups.values())


def make_microbatches(seqs, max_tokens, at_least=1):
    """Lists of row indices: whole groups, at most max_tokens each; every row once
    (test_microbatches_hold_whole_groups_and_count_each_prompt_once).
    Split the step into micro-batches of whole groups, at most max_tokens each (padding counted,
    and each group's prompt once: k groups of n completions cost k * longest prompt + n * longest
    completion). Longest first, so that an out-of-memory shows on the first pass; a group over
    budget goes alone. at_least: the budget shrinks by a fifth until there are that many
    micro-batches (or one per group): one or more for each of that many ranks (data parallel),
    about equal in size. Returns index lists."""
    batches, groups = pack_groups(seqs, max_tokens), len(by_group(seqs, range(len(seqs))))
    while len(batches) < min(at_least, groups):
        max_tokens = max_tokens * 4 // 5
        batches = pack_groups(seqs, max_tokens)
    return batches


def pack_groups(seqs, max_tokens):
    """make_microbatches with one budget: whole groups, longest first, each batch filled greedily
    up to max_tokens."""
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


def plain_logprobs_fast(model, seqs, idx, token_logprobs, temperature=DEFAULTS["temperature"]):
    """trainer.plain_logprobs(model, seqs, idx, temperature), the same values and gradients
    (tests/test_shared_prompt.py), faster: each group's prompt goes through the model once, not
    once per completion (collate's layout, shared_prompt_logprobs's forward). token_logprobs is
    grpo_loss.token_logprobs (passed in: this package imports no role file)."""
    mb = collate(seqs, idx, next(model.parameters()).device)
    return shared_prompt_logprobs(model, mb, token_logprobs, temperature)  # (n, C)


# ---- plain_logprobs_fast's inside: collate's layout and the forward (not needed to follow a
# step: tests/test_shared_prompt.py::test_logprobs_equal_the_plain_forward)

def collate(seqs, idx, device):
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
    mask = torch.zeros((len(idx), C))  # (n, C) 1 on generated tokens (EOS included), from lengths
    for r, i in enumerate(idx):
        ids = seqs[i]["ids"]
        completion_ids[r, :len(ids)] = torch.tensor(ids)
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
          "mask": mask}  # (n, C)
    return {k: t.to(device) for k, t in mb.items()}


def shared_prompt_logprobs(model, mb, token_logprobs,
                           temperature=DEFAULTS["temperature"]):
    """plain_logprobs_fast's forward: (n, C) log-probs of the completion tokens of micro-batch mb,
    in collate's layout (token_logprobs: grpo_loss.token_logprobs): prefix_ids (1, L) the
    prompts' common prefix, prompt_ids (k, P) the rest of each group's prompt (left-padded),
    completion_ids (n, C) (right-padded), row_prompt (n,) the prompt row each completion continues.

    1. The common prefix of the prompts (one row), its KV cache repeated for the k prompts.
    2. The rests of the k prompts on top of it: their KV cache, and the logits of their last
       position, which predict the first token of each of their completions.
    3. The cache repeated for each prompt's completions (k -> n rows), and the completions forwarded
       on top of it. The gradient reaches the prompts' activations through the caches, so values and
       gradients are those of one [prompt | completion] pass per row, with the prompts' compute
       done once instead of G times. The last completion token predicts nothing we need: left out.
    """
    cache = None  # use_cache=True below: the base config says False (build_model)
    if mb["prefix_ids"].shape[1]:
        cache = model(input_ids=mb["prefix_ids"], use_cache=True,
                      logits_to_keep=1).past_key_values  # (1, h, L, d) per layer
        # each layer's keys/values -> (k, h, L, d)
        cache.batch_repeat_interleave(mb["prompt_ids"].shape[0])
    out = model(input_ids=mb["prompt_ids"], attention_mask=mb["prompt_mask"],
                position_ids=mb["prompt_positions"], past_key_values=cache, use_cache=True,
                logits_to_keep=1)  # logits (k, 1, V); cache (k, h, L + P, d) per layer
    first = out.logits[mb["row_prompt"]]  # (n, 1, V) the last prompt logits, once per completion
    logps = [token_logprobs(first, mb["completion_ids"][:, :1], temperature)]  # (n, 1)
    if mb["completion_ids"].shape[1] > 1:
        cache = out.past_key_values
        cache.batch_select_indices(mb["row_prompt"])  # (k, h, L + P, d) -> (n, h, L + P, d)
        logits = model(input_ids=mb["completion_ids"][:, :-1],
                       attention_mask=mb["attention_mask"][:, :-1],
                       position_ids=mb["completion_positions"][:, :-1], past_key_values=cache,
                       use_cache=True).logits  # (n, C-1, V): position j predicts token j+1
        rest = token_logprobs(logits, mb["completion_ids"][:, 1:], temperature)
        logps.append(rest)  # (n, C-1)
    return torch.cat(logps, 1)  # (n, C) from logits / temperature
