"""The key/value cache's argument name across transformers versions (issue 42.6: transformers 5.2x
renamed ``past_key_values`` to ``cache`` and warned on every run of the demo)."""

from __future__ import annotations

import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.engine.kv import cache_arg, cache_of


class NewStyle(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return {"logits": input_ids, "cache": "kv"}


class OldStyle(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return {"logits": input_ids, "past_key_values": "kv"}


class Wrapper(torch.nn.Module):
    """As peft's PeftModel: a forward of **kwargs over the model it wraps."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_base_model(self):
        return self.inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_the_name_is_the_one_the_models_own_forward_takes():
    assert cache_arg(NewStyle(), 1) == {"cache": 1} and cache_arg(OldStyle(), 1) == {"past_key_values": 1}
    assert cache_arg(Wrapper(NewStyle()), 2) == {"cache": 2}  # through a wrapper's **kwargs
    assert cache_of(NewStyle()(cache=None)) == "kv" and cache_of(OldStyle()()) == "kv" and cache_of({}) is None


def test_a_cached_forward_of_the_installed_transformers_gives_no_deprecation_warning():
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
        nxt = model(input_ids=torch.tensor([[4]]), **cache_arg(model, cache_of(out)), use_cache=True)
    assert cache_of(nxt) is not None and nxt.logits.shape == (1, 1, 40)
