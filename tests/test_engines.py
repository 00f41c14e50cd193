"""engines.py and fast_decode.py: the hf engine's sampler over a vocabulary of several blocks, its
decode loop in more shapes than tests/test_rollout.py's (several calls per generate, G = 1, rows
that stop early), its greedy against transformers' greedy generate, the joined q/k/v and gate/up
weights (no copy), the weights packed for MKL (the same samples as unpacked), the fallback to
transformers' generate, and bench/bench_generate.py run at a tiny size.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -s tests/test_engines.py

The seed-for-seed and log-prob checks of the decode loop against transformers + peft are in
tests/test_rollout.py (test_hf_shared_prefill_samples_as_copied_prompts, and the on-policy ratio
against the trainer in test_hf_sampler_logprobs_match_the_trainer).
"""

import os
import subprocess
import sys

import pytest
import torch

from support import engines
from support import fast_decode
from test_rollout import arith_prompts, make_adapter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_draw_tokens_across_blocks():
    """draw_tokens against softmax(logits / T) on a vocabulary of 3 full blocks and a partial one,
    one block all -inf and -inf tokens at block edges: each token's frequency within 5 standard
    errors of its probability over 100,000 rows, an impossible token never, and the log-probs it
    returns equal to log_softmax(logits / T) at the drawn ids."""
    T, rows, S = 0.9, 100_000, engines.SAMPLER_BLOCK
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3 * S + 10, generator=gen) * 2  # (V,)
    logits[S: 2 * S] = -float("inf")  # a whole block impossible
    logits[[0, S - 1, 2 * S, 3 * S - 1, 3 * S + 9]] = -float("inf")  # block edges
    logits[3 * S + 3] = 6.0  # a likely token in the partial block
    p = torch.softmax(logits / T, dim=-1).double()  # (V,)
    torch.manual_seed(0)
    picked, logps = engines.draw_tokens(logits.expand(rows, -1), T)  # (rows,), (rows,)
    freq = torch.bincount(picked, minlength=len(logits)).double() / rows  # (V,)
    se = (p * (1 - p) / rows).sqrt()
    assert freq[p == 0].sum() == 0 and freq[3 * S + 3] > 0.05
    assert ((freq - p).abs() <= 5 * se + 1e-12).all()
    expected = torch.log_softmax(logits / T, dim=-1)[picked]  # (rows,)
    assert (logps - expected).abs().max() < 1e-5


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return make_adapter(tiny_model, str(tmp_path_factory.mktemp("adapter") / "v1"), 1)


def sample(engine, prompts, n, max_new_tokens, seed=5):
    torch.manual_seed(seed)
    return engine.generate(prompts, n, max_new_tokens, 0.8)


def test_decode_loop_equals_generate_in_other_shapes(tiny_model, adapter):
    """The decode loop against the same engine with transformers' generate, seed for seed: 7 prompts
    in calls of at most 2 prompts x G 3 (batch_size 6, the last call one prompt), G = 1, 40 new
    tokens (some rows end with an EOS, the call goes on for the others), and prompts without a
    common prefix."""
    engine = engines.HFEngine(tiny_model, seed=0, batch_size=6)
    engine.load_adapter(1, adapter)
    prompts = arith_prompts(engine.tokenizer, 7)
    unshared = [p[k:] for k, p in enumerate(prompts)]  # each starts elsewhere in the template
    assert engine._pad(unshared[:2])[2] == 0
    for n, max_new_tokens, prompts in ((3, 12, unshared), (3, 12, prompts), (1, 12, prompts),
                                       (3, 40, prompts)):
        engine.fast = True
        fast = sample(engine, prompts, n, max_new_tokens)
        engine.fast = False
        plain = sample(engine, prompts, n, max_new_tokens)
        assert [[s.ids for s in g] for g in fast] == [[s.ids for s in g] for g in plain]
        assert [[s.finish_reason for s in g] for g in fast] == \
            [[s.finish_reason for s in g] for g in plain]
        d = max(abs(a - b) for g, h in zip(fast, plain) for s, t in zip(g, h)
                for a, b in zip(s.logprobs, t.logprobs))
        assert d < 1e-4
    reasons = {s.finish_reason for g in fast for s in g}
    assert reasons == {"stop", "length"}, reasons  # the 40-token case has both kinds of rows


def test_greedy_decode_loop_equals_transformers_greedy(tiny_model, adapter):
    """greedy (--eval) through the decode loop at temperature 0: the same texts as transformers'
    greedy generate on each prompt left-padded whole, with the adapter, in calls of 3 prompts
    (batch_size 3). (The tiny model's greedy paths run to the token limit; the loop's stop at
    an EOS is checked by the sampling tests.)"""
    engine = engines.HFEngine(tiny_model, seed=0, batch_size=3)
    engine.load_adapter(1, adapter)
    assert engine.fast
    prompts = arith_prompts(engine.tokenizer, 7)
    texts = engine.greedy(prompts, 30)
    W = max(map(len, prompts))
    ids = torch.tensor([[engine.pad_id] * (W - len(p)) + p for p in prompts])  # (7, W)
    mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in prompts])  # (7, W)
    with torch.no_grad():
        out = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=30, eos_token_id=engine.eos_ids,
                                    pad_token_id=engine.pad_id, **engine.PLAIN)  # (7, W + 30)
    cut = [engine._cut(row) for row in out[:, W:].tolist()]
    assert texts == [engine.tokenizer.decode(c, skip_special_tokens=True) for c, _ in cut]
    assert len(set(texts)) > 1
    engine.fast = False
    assert engine.greedy(prompts, 30) == texts  # transformers' generate after the shared prefill


@pytest.mark.skipif(not fast_decode.Packs.usable("cpu", torch.float32), reason="torch without MKL")
def test_packed_weights_sample_as_unpacked(tiny_model, adapter):
    """The decode loop with its base weights packed for MKL (fast_decode.Packs, the engine's default
    on a CPU) draws the same tokens as without, seed for seed, log-probs within 1e-5; the weights
    are packed once for a row count (the second call with it packs nothing) and again for
    another."""
    engine = engines.HFEngine(tiny_model, seed=0)
    engine.load_adapter(1, adapter)
    packs = engine.packs
    assert engine.fast and packs is not None
    prompts = arith_prompts(engine.tokenizer, 4)
    packed = sample(engine, prompts, 3, 12)
    copies = dict(packs.packed)
    layers = engine.model.get_base_model().config.num_hidden_layers
    assert packs.rows == 4 * 3 and len(copies) == 4 * layers + 1  # q/k/v, o, gate/up, down; head
    assert sample(engine, prompts, 3, 12, seed=6) and all(
        packs.packed[k] is v for k, v in copies.items())  # packed once for 12 rows
    engine.packs = None
    unpacked = sample(engine, prompts, 3, 12)
    assert [[s.ids for s in g] for g in packed] == [[s.ids for s in g] for g in unpacked]
    d = max(abs(a - b) for g, h in zip(packed, unpacked) for s, t in zip(g, h)
            for a, b in zip(s.logprobs, t.logprobs))
    assert d < 1e-5
    engine.packs = packs
    sample(engine, prompts[:2], 3, 12)
    assert packs.rows == 2 * 3 and not any(packs.packed.get(k) is v for k, v in copies.items())


def test_joined_projections_move_the_weights(tiny_model):
    """join_projections lays q/k/v and gate/up back to back without a second copy: the model
    holds as many parameter bytes as before, q, k and v share one storage, its logits are
    unchanged."""
    from transformers import AutoModelForCausalLM

    def nbytes(model):  # each storage once
        return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in model.parameters()}.values())

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.arange(3, 40)[None]  # (1, 37)
    with torch.no_grad():
        before, size = model(ids).logits, nbytes(model)
        fast_decode.join_projections(model)
        after = model(ids).logits
    assert nbytes(model) == size
    attn = model.model.layers[0].self_attn
    assert fast_decode.joined([attn.q_proj.weight, attn.k_proj.weight,
                               attn.v_proj.weight]) is not None
    assert torch.equal(before, after)


def test_unsupported_lora_falls_back_to_generate(tiny_model, tmp_path):
    """A LoRA on the embeddings is one the decode loop does not read: the engine says why and samples
    with transformers' generate (the same samples as an engine told fast=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    get_peft_model(base, config).save_pretrained(str(tmp_path / "emb"))
    engine = engines.HFEngine(tiny_model, seed=0)
    assert engine.fast
    engine.load_adapter(1, str(tmp_path / "emb"))
    assert not engine.fast
    assert "embed_tokens" in fast_decode.fast_decode_support(engine.model)
    prompts = arith_prompts(engine.tokenizer, 4)
    reference = engines.HFEngine(tiny_model, seed=0, fast=False)
    reference.load_adapter(1, str(tmp_path / "emb"))
    assert [s.ids for g in sample(engine, prompts, 2, 6) for s in g] == \
        [s.ids for g in sample(reference, prompts, 2, 6) for s in g]


def test_bench_generate_runs(tiny_model):
    """bench/bench_generate.py at a tiny size: a line per method with the fraction of the floor, and
    every method exact against plain generate."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_generate.py"),
                          "--model", tiny_model, "--shapes", "2x3x5", "--repeats", "1"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("   2x3x5")]
    assert [r[1] for r in rows] == ["plain", "hf-plain", "hf-unpacked", "hf"]
    assert all("yes" in r for r in rows)  # the same ids and log-probs as plain generate
    assert all(float(r[r.index("/") - 1]) > 0 and float(r[r.index("/") + 1]) > 0 for r in rows)
    print(out.stdout)
