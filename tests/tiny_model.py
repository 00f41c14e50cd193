"""Build the tiny test model: a 4-layer Qwen3 with a character-level tokenizer, offline.

    python tests/tiny_model.py OUT_DIR

Every test and benchmark uses this model, so that nothing is downloaded. It is small enough
(~0.6M parameters) to take a GRPO step in a fraction of a second on one CPU thread, and it is
a real `transformers` checkpoint: `AutoModelForCausalLM`, `AutoTokenizer`, PEFT and vLLM all
load the folder as they would a model from the Hub.

Decisions:
1. `initializer_range=0.1`: at the default 0.02 the random model's next-token distribution is
   almost uniform and a toy reward barely moves in a few dozen steps.
2. model_type `qwen3`, not `qwen2`: with `qwen2` transformers swaps in its own tokenizer class
   and drops the spaces of a character-level vocabulary.
3. One token per printable ASCII character, plus ChatML specials; `<|im_end|>` is the EOS, as in
   ChatML chat models, and `<|pad|>` is a separate pad token.
"""

import json
import os
import string
import sys

SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = sorted(set(string.printable) - set("\x0b\x0c\r"))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char each
    tok.decoder = decoders.Fuse()  # join characters back without separators
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build(out_dir, seed=0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.1,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Say the tokenizer's class explicitly, so no loader guesses one from the model type.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tiny_model.py OUT_DIR")
    out = build(sys.argv[1])
    n = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"tiny model written to {out} ({n:,} parameters)")
