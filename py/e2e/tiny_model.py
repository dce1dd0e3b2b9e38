"""A tiny Llama-family model with random weights, made on the spot (no model hub is reached).

``make(path, ...)`` writes a Hugging Face model directory that vLLM loads: transformers'
``LlamaConfig`` and ``save_pretrained`` (safetensors), and a word-level tokenizer built with
``tokenizers``. The weights come from a seeded generator, so two calls with the same
arguments write the same model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Words of the tokenizer's vocabulary besides the special tokens: ``w0`` ... ``wN``.
SPECIAL = ["<unk>", "<s>", "</s>"]


def make(
    path: Path,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_len: int = 4096,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Writes the model to ``path`` (made if missing) and answers ``path``; a directory that
    already holds this exact model is left as it is."""
    path = Path(path)
    want = dict(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, vocab=vocab, max_len=max_len, dtype=dtype, seed=seed,
    )
    stamp = path / "kvtier-tiny-model.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random weights large enough that the logits differ clearly from token to token.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 / max(1, p.shape[-1]) ** 0.5 * 4)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)

    words = {t: i for i, t in enumerate(SPECIAL)}
    for i in range(vocab - len(SPECIAL)):
        words[f"w{i}"] = len(words)
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=max_len,
    )
    fast.save_pretrained(path)
    stamp.write_text(json.dumps(want))
    return path


if __name__ == "__main__":
    out = make(Path(sys.argv[1]), **{k: int(v) if v.isdigit() else v for k, v in
                                     (a.split("=", 1) for a in sys.argv[2:])})
    print(out)
