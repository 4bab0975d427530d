"""Write a tiny random-weight Llama model as GGUF, for llama.cpp's server. Runs in the engine's venv.

Nothing is downloaded: the weights are seeded random numbers and the tokenizer is a small
SentencePiece-style ("llama") vocabulary built here (``<unk> <s> </s>``, the 256 byte-fallback tokens,
single characters and a few hundred word pieces). The text it generates is gibberish; what the tests
exercise is the engine: tokenizer, KV cache, slots, continuous batching, sampling, SSE and metrics.

The output head has zero rows for the special and byte tokens (ids 0-258) and scaled-up rows for the
rest, so sampled text is printable word pieces and end-of-sequence practically never comes: every request
runs to ``max_tokens``, which makes token counts exact for the tests.

Usage: ``python make_gguf.py OUT.gguf [--n-embd 128 --n-layer 4 --n-head 4 --ctx 4096 --seed 1234]``.
The file is written to ``OUT.gguf.tmp`` and renamed, so a reader never sees half a model.
"""

from __future__ import annotations

import argparse
import os
import string

import gguf
import numpy as np

_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not this are or from at which but have an they "
    "you were she there one all we their been has would when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such "
    "like our over me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see work long get here between both life being under never day same another know while last "
    "server token batch slot metric stream engine model request latency throughput prompt cache queue"
)
WORDS = _WORDS_TEXT.split()

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
N_SPECIAL = 3 + 256  # <unk> <s> </s> and the byte tokens: never sampled


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, SentencePiece scores (longer pieces score higher so merges prefer them) and token types."""
    kind = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [kind.UNKNOWN, kind.CONTROL, kind.CONTROL, *([kind.BYTE] * 256)]
    scores = [0.0] * len(tokens)
    marker = "\u2581"  # SentencePiece's word-boundary mark
    chars = string.ascii_letters + string.digits
    pieces = [marker, *chars, *".,;:!?'\"-()[]/", *(marker + c for c in chars)]
    pieces += [marker + w for w in WORDS] + WORDS + [marker + w.capitalize() for w in WORDS[:100]]
    seen = set(tokens)
    for rank, piece in enumerate(dict.fromkeys(pieces)):
        if piece in seen:
            continue
        tokens.append(piece)
        types.append(kind.NORMAL)
        scores.append(10.0 * len(piece) - 1.0 - 0.01 * rank)
    return tokens, scores, [int(t) for t in types]


def write(path: str, n_embd: int, n_layer: int, n_head: int, ctx: int, seed: int) -> int:
    """Write the model; returns its parameter count."""
    if n_embd % n_head:
        raise SystemExit(f"--n-embd {n_embd} must be a multiple of --n-head {n_head}")
    tokens, scores, types = vocabulary()
    n_vocab, n_ff, head_dim = len(tokens), 4 * n_embd, n_embd // n_head
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float | None = None) -> np.ndarray:
        # numpy (rows, cols) is ggml's ne = [cols, rows]
        s = 1.0 / np.sqrt(cols) if scale is None else scale
        return (rng.standard_normal((rows, cols), dtype=np.float32) * s).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 1.0))
    for i in range(n_layer):
        for name, shape in (
            ("attn_q", (n_embd, n_embd)),
            ("attn_k", (n_embd, n_embd)),
            ("attn_v", (n_embd, n_embd)),
            ("attn_output", (n_embd, n_embd)),
            ("ffn_gate", (n_ff, n_embd)),
            ("ffn_up", (n_ff, n_embd)),
            ("ffn_down", (n_embd, n_ff)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.add_tensor("output_norm.weight", ones)
    head = mat(n_vocab, n_embd, 3.0 / np.sqrt(n_embd))  # logits with std ~3: word pieces win
    head[:N_SPECIAL, :] = 0.0
    w.add_tensor("output.weight", head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 2 * n_vocab * n_embd + n_layer * (4 * n_embd * n_embd + 3 * n_ff * n_embd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    tmp = a.out + ".tmp"
    params = write(tmp, a.n_embd, a.n_layer, a.n_head, a.ctx, a.seed)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {params / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
