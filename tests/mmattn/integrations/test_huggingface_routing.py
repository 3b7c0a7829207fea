"""Every attention call of a model switched to mmattn reaches mmattn, on any transformers 5.x.

T5 nests its encoder and decoder stacks as models with their own copies of the config;
transformers 5.17's ``set_attn_implementation`` did not reach them (0 calls through mmattn,
on the CPU as on CUDA), 5.23's does. The counts come from the model's attention modules,
each called once per forward, not from mmattn.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmattn.integrations import huggingface as hf  # noqa: E402
from mmattn.kernels import dense as _kernel  # noqa: E402
from tests._features import hf_attention_interface  # noqa: E402

NAME = hf.register()
#: transformers 5.0's T5 computes its attention itself (transformers warns that it "does not
#: support setting its attention implementation"): no backend is reached, mmattn's neither.
T5_INTERFACE = pytest.mark.skipif(
    not hf_attention_interface(transformers.T5ForConditionalGeneration),
    reason="needs feature 'T5 attention through transformers' AttentionInterface' "
    "(a transformers 5.x after 5.0)")


def _t5_config():
    return transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )


def _routed(model, device) -> int:
    """How many attention calls of one forward reach mmattn."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 90, (2, 12), generator=gen).to(device)
    mask = torch.ones(2, 12, dtype=torch.long, device=device)
    mask[0, -3:] = 0
    decoder = torch.randint(4, 90, (2, 6), generator=gen).to(device)
    seen = []
    remove = _kernel.add_listener(seen.append)
    try:
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
    finally:
        remove()
    return len(seen)


def _attention_modules(model) -> int:
    return sum(isinstance(m, transformers.models.t5.modeling_t5.T5Attention)
               for m in model.modules())


@T5_INTERFACE
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_t5_switched_to_mmattn_sends_every_call_through_it(train, device):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(_t5_config()).to(device).train(train)
    calls = _attention_modules(model)
    assert calls == 6  # 2 encoder self, 2 decoder self, 2 cross
    model.set_attn_implementation(NAME)
    assert _routed(model, device) == calls
    model.set_attn_implementation("sdpa")  # and back: none, then all again
    assert _routed(model, device) == 0
    model.set_attn_implementation(NAME)
    assert _routed(model, device) == calls


@T5_INTERFACE
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_t5_built_with_mmattn_sends_every_call_through_it(train, device):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration._from_config(
        _t5_config(), attn_implementation=NAME).to(device).train(train)
    assert _routed(model, device) == _attention_modules(model) == 6


def test_the_switch_changes_nothing_where_transformers_reached_every_model():
    """The wrapper acts only on nested models transformers left behind; run twice, the
    second pass finds nothing to do, and a model without nested copies is untouched."""
    model = transformers.T5ForConditionalGeneration(_t5_config())
    model.set_attn_implementation(NAME)
    assert hf._switch.reach_nested_models(model, NAME) == []
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=99))
    llama.set_attn_implementation(NAME)
    assert llama.model.config is llama.config and llama.config._attn_implementation == NAME
    assert hf._switch.reach_nested_models(llama, NAME) == []
