"""What the first GPU round needs around scripts/gpu_check.sh (docs/gpu-round.md).

    python scripts/gpu_tools.py toolchain    # can Triton compile here? (vLLM 0.32's sampler)
    python scripts/gpu_tools.py carry [OUT [3.12]]   # build runs/gpu-carry: what a box lacks
    python scripts/gpu_tools.py peak ROLE.py ARGS...   # run a role, then print its peak memory
    python scripts/gpu_tools.py memory       # the trainer's memory per model, flavour, settings
    python3 scripts/gpu_tools.py machine     # a GPU job's first lines: driver, CUDA, torch, GPU

toolchain: vLLM 0.32 on a GPU runs Model Runner V2, whose sampler and log-prob kernels are Triton
kernels compiled at run time (vllm/v1/worker/gpu/sample/); Triton builds a small C launcher with
$CC, else gcc, else clang, against the interpreter's Python.h (triton/runtime/build.py, _build).
This compiles the same kind of file the same way: one line, "ok" or what is missing and the fix.

carry: a box with torch, transformers, peft and accelerate but no registry lacks `requests`
(proxy_client.py's one dependency; transformers 5 no longer needs it). This installs requests and
its dependencies, as wheels for CPython 3.12 on x86-64 Linux, into runs/gpu-carry/site (~2 MB);
gpu_check.sh puts that folder on PYTHONPATH when `import requests` fails.

peak: runs ROLE.py as __main__ (what `python ROLE.py ARGS` runs) and, when it exits, prints
"[peak-memory] ROLE.py: cuda max allocated X MiB, max reserved Y MiB; max RSS Z MiB" on stderr
(the CUDA part only when the role used CUDA).

memory: an estimate, per model of the Qwen2.5 family and per micro-batch, of the trainer's peak
GPU memory: bf16 weights, the LoRA's fp32 weights, gradients and AdamW moments, the activations
kept for the backward pass and the logits. The activations are measured, not guessed: the trainer's
own forward (support/shared_prompt.py) runs on the CPU through one and two decoder layers of the
model's real shape (random weights, a small vocabulary, a short group of the same prompt to
completion ratio), every tensor autograd saves is counted once, and the per-layer, per-token
bytes are scaled to the model's layers and the micro-batch's tokens.

machine: what each GPU job prints first (scripts/job_start.sh): the driver and the newest CUDA it
runs (nvidia-smi), torch's version and its CUDA build, each GPU with its memory. Exit status 1,
with what to do, when torch's CUDA is a newer major version than the driver runs (CUDA 13 needs
an R580+ driver): CUDA cannot start there, and the job would fail later, billed.
"""

import json
import re
import os
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRY = os.path.join(ROOT, "runs", "gpu-carry")
CARRY_PACKAGES = ["requests==2.34.2"]  # requirements.txt's pin; pip adds its dependencies

# config.json of each model on the Hub (Qwen/Qwen2.5-*-Instruct): what the estimate needs
QWEN25 = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
}
# GPU memory a process sees per Jobs flavour, in GiB (nvidia-smi's memory.total of one GPU, not the
# marketing figure: an L4's "24 GB" is 23034 MiB). Assumed from the cards' usual nvidia-smi totals;
# each GPU job's "[machine] GPU 0: ..." line (job_start.sh) shows the real one. t4: no bf16, the
# trainer refuses it.
FLAVORS = {"l4x1": 22.5, "a10g-small": 22.5, "l40sx1": 45.0, "a100-large": 80.0, "h200": 140.4}
FIT = 0.8  # "fits": the estimate within 80% of that: a margin for what the estimate leaves out
OVERHEAD_GIB = 1.5  # CUDA context, cuBLAS workspace, the allocator's rounding: a margin
GIB = 2**30


def toolchain():
    """0 when a C compiler builds an extension against Python.h as Triton would, else 1."""
    cc = os.environ.get("CC") or next(
        (p for p in (which("gcc"), which("clang")) if p), None)  # triton/runtime/build.py's order
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)[
        "include"]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    fix = (f"fix: apt-get install -y gcc python{version}-dev (Debian/Ubuntu; or set CC to a C "
           "compiler)")
    if cc is None:
        print(f"[toolchain] MISSING: no C compiler ($CC, gcc or clang), which Triton needs to "
              f"build vLLM 0.32's sampler kernels at run time; {fix}")
        return 1
    if not os.path.exists(os.path.join(include, "Python.h")):
        print(f"[toolchain] MISSING: {include}/Python.h (the Python {version} headers), which "
              f"Triton compiles against; {fix}")
        return 1
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.c")
        with open(src, "w") as f:
            f.write("#include <Python.h>\nint probe(void) { return Py_IsInitialized(); }\n")
        so = os.path.join(d, "probe.so")
        try:
            res = subprocess.run([cc, src, "-O3", "-shared", "-fPIC", "-o", so, f"-I{include}"],
                                 capture_output=True, text=True)
            why = res.returncode and (res.stderr.strip().splitlines() or [res.returncode])[-1]
            why = why or (not os.path.exists(so) and "it made no shared object")
        except OSError as e:  # CC names no program
            why = e
    if why:
        print(f"[toolchain] BROKEN: {cc} cannot build against {include}/Python.h ({why}); {fix}")
        return 1
    print(f"[toolchain] ok: {cc} builds against {include}/Python.h (what Triton does)")
    return 0


def which(name):
    import shutil

    return shutil.which(name)


def carry(out=CARRY, python_version="3.12"):
    """pip-install CARRY_PACKAGES for CPython `python_version` on x86-64 Linux into out/site."""
    site = os.path.join(out, "site")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-warn-conflicts", "--target",
           site, "--upgrade",
           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
           "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
           *CARRY_PACKAGES]
    subprocess.run(cmd, check=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(site) for f in fs)
    names = sorted(n.split("-")[0] for n in os.listdir(site) if n.endswith(".dist-info"))
    print(f"[carry] {site}: {', '.join(names)} ({size / 2**20:.1f} MiB); carry it as "
          "runs/gpu-carry (gpu_check.sh --small puts it on PYTHONPATH when requests is missing)")


def peak(argv):
    """Run argv[0] (a role file) as __main__ with argv, then print its peak memory."""
    import atexit
    import resource
    import runpy

    role = os.path.basename(argv[0])

    def report():
        torch, parts = sys.modules.get("torch"), []
        if torch is not None and torch.cuda.is_initialized():
            parts.append(f"cuda max allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} "
                         f"MiB, max reserved {torch.cuda.max_memory_reserved() / 2**20:.0f} MiB")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        parts.append(f"max RSS {rss:.0f} MiB")
        print(f"[peak-memory] {role}: {'; '.join(parts)}", file=sys.stderr, flush=True)

    atexit.register(report)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


# ---- machine: a GPU job's first lines

def machine_lines(smi_header, smi_gpus, torch_version, torch_cuda):
    """(lines, problem) from `nvidia-smi`'s output (its header: "CUDA Version: X.Y"), `nvidia-smi
    --query-gpu=index,name,driver_version,memory.total --format=csv,noheader,nounits`'s, and
    torch's version and CUDA build (None: none). problem: None, or why CUDA cannot start."""
    lines, problem = [], None
    gpus = [[w.strip() for w in row.split(",")] for row in smi_gpus.splitlines() if row.strip()]
    found = re.search(r"CUDA Version:\s*([0-9]+)\.([0-9]+)", smi_header or "")
    driver_cuda = (int(found[1]), int(found[2])) if found else None
    if smi_header is None:
        lines.append("nvidia-smi: none on PATH (no NVIDIA driver in this job)")
    else:
        driver = gpus[0][2] if gpus and len(gpus[0]) > 2 else "?"
        runs = "%d.%d" % driver_cuda if driver_cuda else "?"
        lines.append(f"nvidia-smi: driver {driver}, runs CUDA up to {runs}")
    for g in gpus:
        mib = float(g[3]) if len(g) > 3 and g[3].replace(".", "").isdigit() else None
        size = f"{mib:.0f} MiB ({mib / 1024:.1f} GiB)" if mib else "? MiB"
        lines.append(f"GPU {g[0]}: {g[1] if len(g) > 1 else '?'}, {size} total")
    lines.append(f"torch {torch_version or 'missing'}, built for CUDA {torch_cuda or 'none'}")
    built = re.match(r"([0-9]+)\.([0-9]+)", torch_cuda or "")
    if built and driver_cuda:
        need = (int(built[1]), int(built[2]))
        if need[0] > driver_cuda[0]:
            problem = (f"torch is built for CUDA {torch_cuda}, and this driver runs CUDA up to "
                       f"{driver_cuda[0]}.{driver_cuda[1]}: CUDA cannot start here (CUDA 13 "
                       "needs an R580+ driver). Launch with the image's CUDA 12.9 build, jobs.sh's "
                       "IMAGE with -cu129 appended (IMAGE=vllm/vllm-openai:v0.32.0-cu129; "
                       "docs/hf-jobs.md)")
        elif need > driver_cuda:
            lines.append(f"CUDA {torch_cuda} on a driver for {driver_cuda[0]}.{driver_cuda[1]}: "
                         "runs under CUDA's minor-version compatibility (no newer PTX)")
    return lines, problem


def machine():
    """Print the machine lines ("[machine] ..."); 1 when CUDA cannot start (machine_lines)."""
    def smi(*args):
        try:
            return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None

    header = smi() if which("nvidia-smi") else None
    gpus = smi("--query-gpu=index,name,driver_version,memory.total",
               "--format=csv,noheader,nounits") if header is not None else ""
    try:
        import torch
        version, cuda = torch.__version__, torch.version.cuda
    except ImportError:
        version = cuda = None
    lines, problem = machine_lines(header, gpus or "", version, cuda)
    for line in lines:
        print(f"[machine] {line}", flush=True)
    if problem:
        print(f"[machine] error: {problem}", flush=True)
        return 1
    return 0


# ---- memory: the trainer's peak, estimated from measured activations

def saved_bytes(dims, layers, groups, prompt, completion, generations=8, lora_r=16,
                checkpointing=False, vocab=512):
    """Bytes of the tensors autograd keeps for the backward pass (each storage once, the
    parameters left out) in the trainer's forward (plain_logprobs_fast) of `groups` groups of
    `generations` completions of `completion` tokens after a `prompt`-token prompt, through a
    bf16 model of shape dims (QWEN25's tuple) cut to `layers` layers and `vocab` tokens."""
    import random

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, ROOT)
    import grpo_loss
    from support.devices import checkpoint_layers
    from support.shared_prompt import plain_logprobs_fast

    hidden, inter, _, heads, kv, _, tied = dims
    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=4096)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(r=lora_r, lora_alpha=2 * lora_r,
                                            target_modules="all-linear", task_type="CAUSAL_LM"))
    model.eval()
    if checkpointing:
        checkpoint_layers(model)
    rng = random.Random(0)
    seqs = [{"prompt_ids": p, "ids": [rng.randrange(vocab) for _ in range(completion)],
             "group": g}
            for g in range(groups) for p in [[rng.randrange(vocab) for _ in range(prompt)]]
            for _ in range(generations)]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.add((ptr, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain_logprobs_fast(model, seqs, list(range(len(seqs))), grpo_loss.token_logprobs)
    return sum(n for _, n in seen)


def estimate(name, micro_batch_tokens=8192, prompt=150, completion=256, generations=8,
             lora_r=16, checkpointing=False, measure=saved_bytes):
    """The trainer's peak GPU memory in GiB for Qwen2.5-`name` with the default GPU run's groups
    (jobs.sh: G=8, completions up to 256 tokens; ~150 prompt tokens with the chat template on
    GSM8K) in micro-batches of micro_batch_tokens (make_microbatches' cost)."""
    dims = QWEN25[name]
    hidden, inter, layers, heads, kv, vocab, tied = dims
    group_cost = prompt + generations * completion
    groups = max(1, micro_batch_tokens // group_cost)  # a group over budget goes alone
    scale = 8  # measured on a group 1/8 the length (same prompt:completion ratio), then scaled
    small = dict(groups=1, prompt=prompt // scale, completion=completion // scale,
                 generations=generations, lora_r=lora_r)
    one, two = measure(dims, 1, **small), measure(dims, 2, **small)
    per_layer = (two - one) * scale * groups  # bytes one decoder layer keeps, full micro-batch
    if checkpointing:  # each layer keeps its input; one layer's activations while recomputed
        kept_one = measure(dims, 1, checkpointing=True, **small)
        kept = (measure(dims, 2, checkpointing=True, **small) - kept_one) * scale * groups
        activations = layers * kept + per_layer
    else:
        activations = layers * per_layer
    head_dim = hidden // heads
    params = (vocab * hidden * (1 if tied else 2)
              + layers * (2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter))
    lora = layers * lora_r * (4 * hidden + 2 * (hidden + kv * head_dim) + 3 * (hidden + inter))
    rows_tokens = groups * generations * completion
    logits = rows_tokens * vocab * 2 * 2  # bf16 logits kept, and their gradient in the backward
    chunk = 2 * 4 * completion * vocab * 4  # token_logprobs' fp32 chunk of 4 rows, and its grad
    total = params * 2 + lora * 16 + activations + logits + chunk
    return {"model": f"Qwen2.5-{name}", "micro_batch_tokens": micro_batch_tokens,
            "groups": groups, "gradient_checkpointing": checkpointing,
            "weights_gib": round(params * 2 / GIB, 1), "activations_gib": round(
                activations / GIB, 1), "logits_gib": round((logits + chunk) / GIB, 1),
            "total_gib": round(total / GIB + OVERHEAD_GIB, 1)}


def memory(names=tuple(QWEN25), settings=((8192, False), (8192, True), (2048, False))):
    """Print the table: per model and setting, the estimate and the flavours it fits (<= FIT)."""
    print("| model | --micro-batch-tokens | --gradient-checkpointing | weights | activations | "
          "logits | total (GiB) | fits (trainer) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for tokens, ck in settings:
            e = estimate(name, tokens, checkpointing=ck)
            fits = [f for f, gib in FLAVORS.items() if e["total_gib"] <= FIT * gib]
            print(f"| {e['model']} | {tokens} ({e['groups']} group{'s' * (e['groups'] > 1)}) | "
                  f"{'on' if ck else 'off'} | {e['weights_gib']} | {e['activations_gib']} | "
                  f"{e['logits_gib']} | {e['total_gib']} | {', '.join(fits) or 'none'} "
                  "(estimated) |", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "toolchain":
        sys.exit(toolchain())
    elif what == "carry":  # [OUT [PYTHON_VERSION]]
        carry(*sys.argv[2:4])
    elif what == "peak" and len(sys.argv) > 2:
        peak(sys.argv[2:])
    elif what == "machine":
        sys.exit(machine())
    elif what == "memory":
        memory(tuple(sys.argv[2:]) or tuple(QWEN25))
    elif what == "json":  # one estimate as JSON: json NAME TOKENS on|off
        on = sys.argv[4] == "on"
        print(json.dumps(estimate(sys.argv[2], int(sys.argv[3]), checkpointing=on)))
    else:
        sys.exit(__doc__.split("\n\n")[1])
