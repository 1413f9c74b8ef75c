"""The character-level tokenizer of the embedded model.

Every character is one token (printable ASCII 32..126 and newline); special tokens are matched as
whole tokens in text. ``<|end|>`` is the EOS that ends every chat turn. The chat template renders
each message as ``<|{role}|>{content}<|end|>`` and the generation prompt is ``<|assistant|>``:

    <|user|>12+34=<|end|><|assistant|>   ->   ideal completion  46<|end|>
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<|end|>"
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, *ROLE_TOKENS)  # ids 0..6, in this order
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)

CHAT_TEMPLATE = (  # a tool result (role "tool") is shown as a user turn: the calculator warm start's form
    "{% for message in messages %}"
    "{% set role = 'user' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|' + role + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first (``<pad>`` is 0), then the characters."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` with one token per character and the chat template.

    ``decode(encode(text)) == text`` for any text over the vocabulary; no BOS is added on encode.
    """
    tok = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=1 << 20,
    )
