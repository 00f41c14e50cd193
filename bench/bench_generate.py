"""Benchmark: the hf engine's sampling against its compute floor, side by side with plain generate.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_generate.py \
        --model runs/models/smollm2-135m-instruct --shapes 4x8x12 8x8x64 --repeats 5
    .venv/bin/python bench/bench_generate.py --shapes 2x3x4 --repeats 1  # the tiny test model

A shape PxGxT is P arith prompts (chat-templated), G samples each, T new tokens at most: the
default run (jobs.sh --local) asks for 4 groups of G=8 with 12 new tokens at temperature 1.0,
and its replica runs on one thread. The adapter is a random LoRA (r --lora-r on all linear
layers, B nonzero, so it is in effect). Four methods, each on the same prompts with the same
seed, all drawing with engines.draw_tokens, each timed --repeats times after one warm-up:

  plain       transformers + peft model.generate on each prompt copied G times (what
              num_return_sequences does), log-probs from output_logits
  hf-plain    HFEngine.generate with fast=False: each prompt prefilled once, then model.generate
  hf-unpacked HFEngine.generate with FastDecoder, its weights as they are (no fast_decode.Packs)
  hf          HFEngine.generate: FastDecoder's one-pass prefill, then its decode loop with the
              base weights packed for MKL (fast_decode.Packs) where torch has MKL

  tok/s     completion tokens (cut at EOS) / wall seconds, at the median
  wall s    wall-clock seconds per call: median [min-max] over the repeats
  cpu s     CPU seconds of this process per call (median): with other work on the machine, the
            time this process really ran (its cache still disturbed by the others)
  floor s   the compute floor: the FLOPs that must be done / the fp32 rate this CPU reaches on
            the same matmul shapes, at the same thread count, measured here (below), in CPU time
  of floor  floor s / cpu s and floor s / wall s: the fraction of the floor reached (1 = at it);
            on an idle machine the two agree

The floor's FLOPs: each distinct prompt token once (the common prefix once, each prompt's rest
once), then rows = P*G tokens per step for the steps actually run but the first (each step: the
7 linear maps of every layer, the LM head, attention over the current length). Each matmul shape
(rows x in -> out) is timed with torch.nn.functional.linear in this process after the methods,
the best of 5 trials (a stricter floor than the median); attention FLOPs are counted at the
fastest linear rate. The LoRA's matmuls are not counted: the floor is
the base model's. Also printed: the rates of the same products as W @ x.T (output transposed) and
with the weights packed (fast_decode.Packs), the floor over the best of the three layouts, stricter
where MKL runs either faster, and each method's fraction of it (the "floor s" column stays
F.linear's). Every method is checked against plain: the same ids seed for seed, the log-probs
within 1e-4 ("exact" column).
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from support import engines  # noqa: E402
from support import fast_decode  # noqa: E402
from support.rewards import templated  # noqa: E402
from support.tasks import load_task  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="model folder or id (default: the tiny test model)")
    p.add_argument("--shapes", nargs="+", default=["4x8x12", "8x8x64"],
                   help="PxGxT: prompts x num_generations x max_completion_length")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method and shape")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the replica runs on 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lora-r", type=int, default=16, help="the random adapter's rank (jobs.sh: 16)")
    p.add_argument("--methods", default="plain,hf-plain,hf-unpacked,hf",
                   help="comma-separated, of the four")
    args = p.parse_args(argv)
    for s in args.shapes:
        parts = s.split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--shapes {s}: expected PxGxT, e.g. 4x8x12")
    if not set(args.methods.split(",")) <= {"plain", "hf-plain", "hf-unpacked", "hf"}:
        p.error(f"--methods {args.methods}: pick from plain, hf-plain, hf-unpacked, hf")
    return args


def make_adapter(model_dir, out_dir, r):
    """A PEFT LoRA on all linear layers, random nonzero B (in effect, unlike an untrained v0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.01
    model.save_pretrained(out_dir)
    return out_dir


# ---- the compute floor

def model_shapes(config):
    """(in, out) of the linear maps of one layer, and of the LM head."""
    D, I = config.hidden_size, config.intermediate_size
    H, K = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or D // H
    layer = [(D, H * d), (D, K * d), (D, K * d), (H * d, D), (D, I), (D, I), (I, D)]
    return layer, (D, config.vocab_size)


def work(config, prompt_lens, prefix, rows, steps):
    """The matmuls that must be done: {(rows, in, out): count} and the attention FLOPs."""
    layer, head = model_shapes(config)
    n_layers, H = config.num_hidden_layers, config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // H
    mm = {}

    def add(tokens, with_head):
        for i, o in layer:
            mm[(tokens, i, o)] = mm.get((tokens, i, o), 0) + n_layers
        if with_head:
            mm[(with_head, *head)] = mm.get((with_head, *head), 0) + 1

    if prefix:
        add(prefix, 0)  # the common prefix, once
    add(sum(n - prefix for n in prompt_lens), len(prompt_lens))  # each rest once, LM head at end
    for _ in range(steps - 1):  # each new token but the last goes through the model
        add(rows, rows)
    # attention: q.k and p.v, 2 * 2 * H * d FLOPs per (query, key) pair, causal
    pairs = prefix * (prefix + 1) // 2 + sum((n * (n + 1) - prefix * (prefix + 1)) // 2
                                             for n in prompt_lens)
    per_prompt = rows // len(prompt_lens)  # G rows per prompt
    pairs += sum(per_prompt * (n + t) for n in prompt_lens for t in range(1, steps))
    return mm, 4 * H * d * pairs * n_layers


def linear_rate(rows, i, o, trials=5, min_s=0.05, layout="linear"):
    """FLOP/s of F.linear at (rows, i) x (o, i), in CPU time: the best of `trials`, each >= min_s
    long. layout "columns": the same product as w @ x.T (its output transposed, (o, rows));
    "packed": with w packed for `rows` rows first (fast_decode.Packs, MKL's packed sgemm)."""
    x, w = torch.randn(rows, i), torch.randn(o, i)
    if layout == "packed":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        product = lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, rows)  # noqa: E731
    else:
        product = (lambda: w @ x.t()) if layout == "columns" else (lambda: F.linear(x, w))
    product()
    best = 0.0
    for _ in range(trials):
        n, t0 = 0, time.process_time()
        while time.process_time() - t0 < min_s:
            product()
            n += 1
        best = max(best, 2 * rows * i * o * n / (time.process_time() - t0))
    return best


def streamed_seconds(model, rows, trials=5):
    """CPU seconds of one decode step's matmuls alone: every linear map of the model (its own
    weights, read from memory as a step reads them, not hot in cache) and the LM head, through
    F.linear back to back at `rows` rows; the median of `trials`."""
    weights = [m.weight for name, m in model.get_base_model().named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name]  # base maps + LM head
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    times = []
    for _ in range(trials + 1):  # the first warms up
        t0 = time.process_time()
        for w in weights:
            F.linear(xs[w.shape[1]], w)
        times.append(time.process_time() - t0)
    return statistics.median(times[1:])


def floor_seconds(mm, attn_flops, rates):
    flops = sum(2 * r * i * o * c for (r, i, o), c in mm.items()) + attn_flops
    seconds = sum(2 * r * i * o * c / rates[(r, i, o)] for (r, i, o), c in mm.items())
    return flops, seconds + attn_flops / max(rates.values())


# ---- the methods

def plain_generate(engine, prompts, n, max_new_tokens, temperature):
    """transformers + peft generate, each prompt copied n times, left-padded whole."""
    W = max(map(len, prompts))
    ids = torch.tensor([[engine.pad_id] * (W - len(p)) + p for p in prompts])  # (P, W)
    mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in prompts])  # (P, W)
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0),
            do_sample=False, logits_processor=[engines.inverse_cdf_sampler(temperature)],
            max_new_tokens=max_new_tokens, eos_token_id=engine.eos_ids, pad_token_id=engine.pad_id,
            return_dict_in_generate=True, output_logits=True, **engine.PLAIN)
        new = out.sequences[:, W:]  # (P*n, T)
        logps = torch.stack([torch.log_softmax(s.float() / temperature, -1)  # (P*n, V)
                             .gather(-1, new[:, t, None]).squeeze(-1)
                             for t, s in enumerate(out.logits)], 1)  # (P*n, T)
    samples = []
    for row, lps in zip(new.tolist(), logps.tolist()):
        ids_, _ = engine._cut(row)
        samples.append(engines.Sample(ids_, lps[: len(ids_)], None, None))
    return [samples[k: k + n] for k in range(0, len(samples), n)]


def run_method(engine, method, prompts, n, T, temperature, seed):
    torch.manual_seed(seed)
    if method == "plain":
        return plain_generate(engine, prompts, n, T, temperature)
    engine.fast = method in ("hf", "hf-unpacked")
    engine.packs, packs = None if method == "hf-unpacked" else engine.packs, engine.packs
    try:
        return engine.generate(prompts, n, T, temperature)
    finally:
        engine.packs = packs


def exact(groups, reference):
    same = [s.ids for g in groups for s in g] == [s.ids for g in reference for s in g]
    d = max((abs(a - b) for g, h in zip(groups, reference) for s, r in zip(g, h)
             for a, b in zip(s.logprobs, r.logprobs)), default=0.0)
    return same and d < 1e-4, d


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work_dir = tempfile.mkdtemp(prefix="bench_generate_")
    try:
        if args.model is None:
            import tiny_model

            args.model = tiny_model.build(os.path.join(work_dir, "tiny"))
        adapter = make_adapter(args.model, os.path.join(work_dir, "adapter"), args.lora_r)
        engine = engines.HFEngine(args.model, seed=0)
        engine.load_adapter(1, adapter)
        if not engine.fast:
            print(f"note: hf runs transformers' generate here: "
                  f"{fast_decode.fast_decode_support(engine.model)}")
        bench(args, engine)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def bench(args, engine):
    config = engine.model.get_base_model().config
    methods = args.methods.split(",")
    items = load_task("arith", "train")
    print(f"model {args.model}: fp32 on {engine.device}, {torch.get_num_threads()} thread(s), "
          f"LoRA r {args.lora_r} on all linear layers, temperature {args.temperature}; "
          f"{args.repeats} timed calls per method after a warm-up; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>8} {'method':>8} {'tok/s':>7} {'wall s: median [min-max]':>25} {'cpu s':>7} "
          f"{'floor s':>7} {'of floor cpu/wall':>17} {'GFLOP':>6} exact")
    for shape in args.shapes:
        P, n, T = map(int, shape.split("x"))
        prompts = [templated(engine.tokenizer, it["prompt"])[1] for it in items[:P]]
        prefix = engine._pad(prompts)[2]
        results, times, cpu = {}, {}, {}
        for method in methods:
            run_method(engine, method, prompts, n, T, args.temperature, 0)  # warm-up
            times[method], cpu[method] = [], []
            for r in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                results[method] = run_method(engine, method, prompts, n, T, args.temperature, r)
                times[method].append(time.perf_counter() - t0)
                cpu[method].append(time.process_time() - c0)
        # the steps run: until every row has an EOS, or T (the same samples for every method)
        steps = max(len(s.ids) for g in results[methods[-1]] for s in g)
        mm, attn = work(config, [len(p) for p in prompts], prefix, P * n, steps)
        rates = {k: linear_rate(*k) for k in mm}
        flops, floor = floor_seconds(mm, attn, rates)
        for method in methods:
            median, cpu_s = statistics.median(times[method]), statistics.median(cpu[method])
            tokens = sum(len(s.ids) for g in results[method] for s in g)
            ok, d = exact(results[method], results[methods[0]])
            spread = f"{median:.3f} [{min(times[method]):.3f}-{max(times[method]):.3f}]"
            fraction = f"{floor / cpu_s:.2f} / {floor / median:.2f}"
            print(f"{shape:>8} {method:>8} {tokens / median:7.1f} {spread:>25} {cpu_s:7.3f} "
                  f"{floor:7.3f} {fraction:>17} {flops / 1e9:6.1f} "
                  f"{'yes' if ok else 'NO'} (max |dlogp| {d:.1e} vs {methods[0]})")
        decode = {(r, i, o): rates[(r, i, o)] for (r, i, o) in mm if r == P * n}
        print(f"{'':>8} fp32 rates at {P * n} rows, GFLOP/s: " + ", ".join(
            f"{i}->{o} {v / 1e9:.0f}" for (_, i, o), v in sorted(decode.items())))
        # the same products as W @ x.T, and with the weights packed (where MKL can): where either
        # runs faster, a floor over the best of the three is stricter than F.linear's
        best = dict(rates)
        for layout in ("columns", "packed")[: 1 + (engine.packs is not None)]:
            other = {k: linear_rate(*k, layout=layout) for k in mm}
            best = {k: max(best[k], other[k]) for k in mm}
            print(f"{'':>8} {layout}, GFLOP/s: " + ", ".join(
                f"{i}->{o} {other[(r, i, o)] / 1e9:.0f}" for (r, i, o) in sorted(decode)))
        strict = floor_seconds(mm, attn, best)[1]
        print(f"{'':>8} a floor over the best of the layouts: {strict:.3f} s; of it (cpu): " +
              ", ".join(f"{m} {strict / statistics.median(cpu[m]):.2f}" for m in methods))
        step_mm, _ = work(config, [1], 0, P * n, 2)  # one decode step's matmuls
        step_mm = {k: c for k, c in step_mm.items() if k[0] == P * n}
        step_floor = sum(2 * r * i * o * c / (rates.get((r, i, o)) or linear_rate(r, i, o))
                         for (r, i, o), c in step_mm.items())
        print(f"{'':>8} one decode step at {P * n} rows: floor {step_floor * 1e3:.1f} ms; the "
              f"model's own weights through F.linear back to back "
              f"{streamed_seconds(engine.model, P * n) * 1e3:.1f} ms (CPU time)")
    print(f"load average after: {os.getloadavg()[0]:.2f} (more than 0 means other work shared "
          f"the CPU)")


if __name__ == "__main__":
    main()
