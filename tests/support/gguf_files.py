"""A small GGUF file written by the tests themselves (the ``gguf`` package writes GGUF): a random tiny
Llama with a byte-level BPE tokenizer and a ChatML template, laid out as llama.cpp's converter lays out
a Hugging Face Llama (query/key rows permuted for its rotary layout), so that transformers' GGUF
reader has to undo exactly what it undoes for a real file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "s"), ("Ġ", "is"), ("1", "2")]


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the alphabet of a byte-level BPE)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = [], 0
    table = {}
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    chars = [table[b] for b in range(256)]
    return chars


def vocabulary() -> list[str]:
    return SPECIAL + _byte_chars() + ["".join(m) for m in MERGES]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a query/key projection (its converter's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocabulary()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from 1, so a mix-up of norm tensors shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def write_tiny_gguf(path: Path, model: LlamaForCausalLM) -> Path:
    """Write ``model`` (a :func:`tiny_llama`) and the test tokenizer as a float32 GGUF file."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("asyncrl test llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIAL)))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
