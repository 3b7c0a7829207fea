"""gpt-oss (sinks + sliding window + GQA) and Gemma 2 (softcap + window) on the mmattn backend
equal transformers' eager attention: outputs, input and sink gradients, greedy generation.

Tiny configs built here (no download); one model object is switched between backends, so the
weights are the same by construction. Outputs are compared at real (non-padded) positions.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmattn.integrations import huggingface as hf  # noqa: E402
from mmattn.kernels import dense as _kernel  # noqa: E402
from mmattn.kernels.modifiers import alibi_slopes  # noqa: E402

# transformers models: seconds each, fused pass only (as test_huggingface.py)
pytestmark = pytest.mark.slow

NAME = hf.register()
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=99, pad_token_id=0)


def _batch(length=14, pad=4, seed=0):
    """Left-padded ids: row 0 has ``pad`` padding tokens, row 1 none."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 90, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _gpt_oss():
    config = transformers.GptOssConfig(
        **TINY, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # the sinks start near zero: make them decide something
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(std=1.5)
    return model


def _gemma2():
    config = transformers.Gemma2Config(
        **TINY, intermediate_size=64, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=None, query_pre_attn_scalar=8,
    )
    return transformers.Gemma2ForCausalLM(config)


@functools.cache
def _built(name):
    torch.manual_seed(0)
    return {"gpt_oss": _gpt_oss, "gemma2": _gemma2}[name]()


def _model(name):
    return copy.deepcopy(_built(name))


def _run(model, backend, ids, mask, train):
    model.set_attn_implementation(backend)
    model.train(train)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    weight = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(1))
    (logits[real] * weight).sum().backward()
    sinks = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("sinks")]
    model.zero_grad(set_to_none=True)
    return logits[real].detach(), embeds.grad[real], sinks


def _paths(fn):
    seen = []
    remove = _kernel.add_listener(lambda record: seen.append(record["path"]))
    try:
        fn()
    finally:
        remove()
    return seen


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["gpt_oss", "gemma2"])
def test_outputs_and_gradients_equal_eager(name, train):
    model = _model(name)
    ids, mask = _batch()
    paths = _paths(lambda: _run(model, NAME, ids, mask, train))
    assert paths[0] == "local", paths  # the sliding layer runs the band kernel, not dense
    ours = _run(model, NAME, ids, mask, train)
    theirs = _run(model, "eager", ids, mask, train)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-4)
    assert len(ours[2]) == (2 if name == "gpt_oss" else 0)
    for got, want in zip(ours[2], theirs[2]):  # d loss / d sinks, each layer
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2"])
def test_greedy_generation_on_a_left_padded_batch_gives_the_same_tokens(name):
    model = _model(name).eval()
    ids, mask = _batch(length=9, pad=3, seed=2)
    tokens = {}
    for backend in (NAME, "eager"):
        model.set_attn_implementation(backend)
        tokens[backend] = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
            pad_token_id=0,
        )
    assert tokens[NAME].shape[1] == ids.shape[1] + 6
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_gpt_oss_attention_maps_equal_eager_without_the_sink_column():
    model = _model("gpt_oss").eval()
    ids, mask = _batch()
    maps = {}
    for backend in (NAME, "eager"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            maps[backend] = model(input_ids=ids, attention_mask=mask,
                                  output_attentions=True).attentions
    real = mask.bool()
    for ours, theirs in zip(maps[NAME], maps["eager"]):
        ours, theirs = ours.transpose(1, 2)[real], theirs.transpose(1, 2)[real]
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        assert (ours.sum(-1) < 1 - 1e-3).all()  # the sink took its share of every row


def test_s_aux_of_another_shape_raises_naming_it():
    model = _model("gpt_oss")
    layer = model.model.layers[0].self_attn
    q = k = v = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match=r"GptOssAttention .*s_aux .* shape \(4,\), got \(2,\)"):
        hf.attention_forward(layer, q, k, v, None, s_aux=torch.zeros(2))


@pytest.mark.parametrize("heads", [8, 12, 6])
def test_alibi_slopes_equal_blooms(heads):
    """BLOOM builds its ALiBi from the same paper's slopes (interpolated for other counts)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 3), heads, torch.float64)  # (h, 1, 3): m_h · j
    ours = torch.tensor(alibi_slopes(heads), dtype=torch.float64)
    # BLOOM computes the slopes in float32
    torch.testing.assert_close(ours, alibi[:, 0, 1], atol=0, rtol=1e-6)
