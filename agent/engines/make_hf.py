"""Write a tiny random-weight Llama in Hugging Face format, for vLLM. Runs in the vLLM engine's venv.

Nothing is downloaded: a byte-level BPE tokenizer is trained here on a small built-in text
(``tokenizers``), the config is a small ``LlamaConfig`` and the weights are seeded random numbers saved as
safetensors. As with the GGUF model, the output head's rows for special tokens and for tokens that decode
to partial UTF-8 or control characters are zero, so generated text is printable and end-of-sequence
practically never comes (every request runs to ``max_tokens``).

Usage: ``python make_hf.py OUT_DIR [--n-embd 128 --n-layer 4 --n-head 4 --ctx 4096 --vocab 1024]``.
Written to ``OUT_DIR.tmp`` and renamed, so a reader never sees half a model.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CORPUS = (
    "the of and to in is that for it as was with be by on not this are or from at which but have an they "
    "you were she there one all we their been has would when who will more no if out so said what up its "
    "server token batch slot metric stream engine model request latency throughput prompt cache queue "
    "decode llama the quick brown fox jumps over the lazy dog"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 50 + CORPUS.split(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>", unk_token=None
    )
    hf.chat_template = CHATML
    return hf


def write(out: str, n_embd: int, n_layer: int, n_head: int, ctx: int, vocab: int) -> int:
    """Write config, tokenizer and safetensors weights into ``out``; returns the parameter count."""
    hf_tok = tokenizer(vocab)
    hf_tok.save_pretrained(out)
    n_vocab = len(hf_tok)
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        max_position_embeddings=ctx,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    special = {hf_tok.convert_tokens_to_ids(t) for t in SPECIALS}
    with torch.no_grad():
        head = model.lm_head.weight
        head.normal_(0.0, 3.0 / n_embd**0.5)  # logits with std ~3 for printable tokens
        for i in range(n_vocab):
            text = hf_tok.decode([i])
            if i in special or not text or "\ufffd" in text or not text.isprintable():
                head[i].zero_()
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=1024)
    a = ap.parse_args()
    tmp = a.out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    params = write(tmp, a.n_embd, a.n_layer, a.n_head, a.ctx, a.vocab)
    shutil.rmtree(a.out, ignore_errors=True)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {params / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
