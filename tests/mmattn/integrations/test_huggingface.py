"""mmattn as a transformers attention backend equals transformers' own eager and SDPA backends.

Every model is built from a tiny config (no download). One model object is switched between
backends (``set_attn_implementation``), so the weights are the same by construction. Outputs
are compared at real (non-padded) positions: transformers' eager backend averages over all
keys in a row that may attend nothing, where SDPA and mmattn give zeros.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmattn.integrations import huggingface as hf  # noqa: E402
from mmattn.kernels import dense as _kernel  # noqa: E402
from tests._items_third_pass_entry import naive  # noqa: E402 - float64 softmax(q kᵀ s) v
from tests._tolerance import assert_close_scaled  # noqa: E402

# transformers models: seconds each, so the explicit pass of `make test` (-m 'not slow') skips them;
# the fused pass runs them, and each path of theirs is checked with MMATTN_FUSED_ATTN=0 by hand.
pytestmark = pytest.mark.slow

NAME = hf.register()
TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    vocab_size=99,
)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def ids_and_mask(batch=2, length=12, pad=3, left=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 90, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad:
        if left:
            mask[0, :pad] = 0
        else:
            mask[0, -pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


# ---------------------------------------------------------------------- the model zoo


def _bert():
    model = transformers.BertModel(transformers.BertConfig(**TINY, **NO_DROP))
    ids, mask = ids_and_mask()
    return model, {"input_ids": ids, "attention_mask": mask}, mask.bool()


def _vit():
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, **{**TINY, "vocab_size": None}, **NO_DROP
    )
    config.vocab_size = None
    pixels = torch.randn(2, 3, 16, 16)
    return transformers.ViTModel(config, add_pooling_layer=False), {"pixel_values": pixels}, None


def _tower(**extra):
    base = {k: v for k, v in TINY.items() if k != "vocab_size"}
    return {**base, "attention_dropout": 0.0, **extra}


def _clip():
    config = transformers.CLIPConfig(
        text_config=_tower(vocab_size=99, max_position_embeddings=16, eos_token_id=2),
        vision_config=_tower(image_size=16, patch_size=4), projection_dim=16,
    )
    ids, mask = ids_and_mask()
    ids[:, -1] = 2
    pixels = torch.randn(2, 3, 16, 16)
    return (
        transformers.CLIPModel(config),
        {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels},
        mask.bool(),
    )


def _siglip():
    config = transformers.SiglipConfig(
        text_config=_tower(vocab_size=99, max_position_embeddings=16),
        vision_config=_tower(image_size=16, patch_size=4),
    )
    ids, mask = ids_and_mask()
    pixels = torch.randn(2, 3, 16, 16)
    return (
        transformers.SiglipModel(config),
        {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels},
        mask.bool(),
    )


def _decoder(cls, config_cls, length=12, **extra):
    config = config_cls(**TINY, num_key_value_heads=2, pad_token_id=0, **extra)
    ids, mask = ids_and_mask(length=length, left=True)
    return cls(config), {"input_ids": ids, "attention_mask": mask}, mask.bool()


def _llama():
    return _decoder(transformers.LlamaForCausalLM, transformers.LlamaConfig)


def _mistral():
    return _decoder(transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=4)


def _gemma2():
    return _decoder(
        transformers.Gemma2ForCausalLM, transformers.Gemma2Config, head_dim=8, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=8,
    )


def _t5():
    config = transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )
    ids, mask = ids_and_mask()
    decoder, _ = ids_and_mask(length=6, pad=0, seed=1)
    inputs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}
    return transformers.T5ForConditionalGeneration(config), inputs, None


_BUILDERS = {
    "bert": _bert, "vit": _vit, "clip": _clip, "siglip": _siglip, "llama": _llama,
    "mistral": _mistral, "gemma2": _gemma2, "t5": _t5,
}


@functools.cache
def _built(name):
    torch.manual_seed(0)
    return _BUILDERS[name]()


def _model(name):
    """A fresh copy of the named tiny model, its inputs and its real-token mask (or None)."""
    return copy.deepcopy(_built(name))


MODELS = {name: functools.partial(_model, name) for name in _BUILDERS}
#: transformers' SDPA backend refuses softcap, so Gemma 2 is compared with eager only.
REFERENCES = {"gemma2": ("eager",)}


def _embed_inputs(model, inputs):
    """Replace ids by leaf input embeddings (and pixels by leaf pixels) that collect grads."""
    inputs = dict(inputs)
    leaves = {}
    if "input_ids" in inputs and not isinstance(model, (transformers.CLIPModel,
                                                         transformers.SiglipModel)):
        embeds = model.get_input_embeddings()(inputs.pop("input_ids")).detach()
        inputs["inputs_embeds"] = leaves["inputs_embeds"] = embeds.requires_grad_()
    if "pixel_values" in inputs:
        inputs["pixel_values"] = leaves["pixel_values"] = (
            inputs["pixel_values"].clone().requires_grad_()
        )
    return inputs, leaves


def _outputs(out) -> dict[str, torch.Tensor]:
    """The tensors to compare: logits or hidden states, text and image sides."""
    found = {}
    for key in ("logits", "last_hidden_state", "text_embeds", "image_embeds"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            found[key] = value
    for key in ("text_model_output", "vision_model_output"):
        side = getattr(out, key, None)
        if side is not None:
            found[key] = side.last_hidden_state
    return found


def _run(model, backend, inputs, valid, device, train):
    model.set_attn_implementation(backend)
    model.train(train)
    inputs, leaves = _embed_inputs(model, {k: v.to(device) for k, v in inputs.items()})
    out = _outputs(model(**inputs))
    loss = 0.0
    gen = torch.Generator().manual_seed(1)
    for key, value in out.items():
        weight = torch.randn(value.shape[-1], generator=gen).to(device)
        keep = value
        if valid is not None and key in ("logits", "last_hidden_state", "text_model_output") \
                and value.shape[:2] == valid.shape:
            keep = value[valid.to(device)]
        out[key] = keep
        loss = loss + (keep * weight).sum()
    loss.backward()
    grads = {name: leaf.grad for name, leaf in leaves.items()}
    model.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in out.items()}, grads


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_and_input_gradients_equal_the_builtin_backends(name, train, device):
    model, inputs, valid = MODELS[name]()
    model = model.to(device)
    ours, our_grads = _run(model, NAME, inputs, valid, device, train)
    for backend in REFERENCES.get(name, ("eager", "sdpa")):
        theirs, their_grads = _run(model, backend, inputs, valid, device, train)
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, k=key, b=backend: f"{name} {k} vs {b}: {m}")
        for key in our_grads:
            torch.testing.assert_close(our_grads[key], their_grads[key], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=key, b=backend: f"{name} d{k} vs {b}: {m}")


def _paths(fn):
    """The kernel paths mmattn reports while ``fn()`` runs."""
    seen = []
    remove = _kernel.add_listener(lambda record: seen.append(record["path"]))
    try:
        fn()
    finally:
        remove()
    return seen


@pytest.mark.parametrize("pad", [0, 5])
def test_sliding_window_runs_on_the_band_kernel_and_equals_sdpa(pad):
    model, _, _ = _decoder(transformers.MistralForCausalLM, transformers.MistralConfig,
                           sliding_window=8)
    ids, mask = ids_and_mask(length=40, pad=pad, left=True)
    model.eval()
    outs = {}
    for backend in (NAME, "sdpa"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            paths = _paths(lambda b=backend: outs.__setitem__(
                b, model(input_ids=ids, attention_mask=mask, use_cache=False).logits))
        if backend == NAME:
            assert paths == ["local", "local"], paths  # both layers, no dense fallback
    real = mask.bool()
    torch.testing.assert_close(outs[NAME][real], outs["sdpa"][real], atol=1e-5, rtol=1e-5)


def test_masks_are_really_applied():
    """A later token never moves an earlier logit; a padded token never moves a real one."""
    model, inputs, _ = _llama()
    model.set_attn_implementation(NAME)
    model.eval()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=mask).logits
        later = ids.clone()
        later[:, -1] = (later[:, -1] + 1) % 90 + 4
        moved = model(input_ids=later, attention_mask=mask).logits
        padded = ids.clone()
        padded[0, 0] = 7  # under the padding mask
        hidden = model(input_ids=padded, attention_mask=mask).logits
    torch.testing.assert_close(moved[:, :-1], base[:, :-1], atol=0, rtol=0)
    assert not torch.allclose(moved[:, -1], base[:, -1])
    assert_close_scaled(hidden[0, 3:], base[0, 3:], atol=1e-6)  # logits: any size
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionMaskInterface._global_mapping[NAME] is hf.attention_mask


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_generation_on_a_left_padded_batch_gives_the_same_tokens(name, device):
    model, inputs, _ = MODELS[name]()
    model = model.to(device).eval()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    tokens = {}
    for backend in (NAME, "eager", "sdpa"):
        model.set_attn_implementation(backend)
        tokens[backend] = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert tokens[NAME].shape[1] == inputs["input_ids"].shape[1] + 6
    assert torch.equal(tokens[NAME], tokens["eager"])
    assert torch.equal(tokens[NAME], tokens["sdpa"])


@pytest.mark.parametrize("name", ["bert", "llama", "mistral", "gemma2", "t5"])
def test_output_attentions_gives_the_eager_maps(name):
    model, inputs, valid = MODELS[name]()
    model.eval()
    maps = {}
    for backend in (NAME, "eager"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
        maps[backend] = out.encoder_attentions if name == "t5" else out.attentions
    assert len(maps[NAME]) == 2 and all(m is not None for m in maps[NAME])
    for ours, theirs in zip(maps[NAME], maps["eager"]):
        if valid is not None:  # rows of padded queries: eager spreads them, we give zeros
            ours, theirs = ours.transpose(1, 2)[valid], theirs.transpose(1, 2)[valid]
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_packed_batch_through_llama_equals_each_sequence_alone():
    from transformers import DataCollatorWithFlattening

    model, _, _ = _llama()
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(4, 90, (n,), generator=gen).tolist() for n in (7, 3, 11, 5)]
    batch = DataCollatorWithFlattening()([{"input_ids": s} for s in sequences])
    assert "attention_mask" not in batch
    for train in (False, True):
        model.train(train)
        model.set_attn_implementation(NAME)
        kernels = []
        remove = _kernel.add_listener(lambda record, out=kernels: out.append(record.get("kernel")))
        try:
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           use_cache=False).logits[0]
        finally:
            remove()
        assert kernels == ["hf-buckets", "hf-buckets"], kernels  # the packed kernel, each layer
        model.set_attn_implementation("eager")
        start = 0
        for s in sequences:
            alone = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:start + len(s)], alone, atol=1e-5,
                                       rtol=1e-5)
            start += len(s)


# ---------------------------------------------------------------------- errors


def test_attention_sinks_and_unknown_arguments_raise_naming_model_and_argument():
    q = k = v = torch.randn(1, 2, 4, 8)
    model, _, _ = _llama()
    layer = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"LlamaAttention \(model type 'llama'\) passed sinks"):
        hf.attention_forward(layer, q, k, v, None, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match=r"LlamaAttention .* keyword argument bogus=3"):
        hf.attention_forward(layer, q, k, v, None, bogus=3)
    with pytest.raises(ValueError, match="heads must divide"):
        hf.attention_forward(layer, q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), None)


@pytest.mark.parametrize(
    "name", ["my_flash", "sdpa2", "flex_attention_x", "paged|mmattn", "eager", "org/repo", ""]
)
def test_register_refuses_names_transformers_treats_specially(name):
    with pytest.raises(ValueError, match="cannot be registered"):
        hf.register(name)
    with pytest.raises(TypeError, match="name must be a str"):
        hf.register(3)


def test_fully_masked_rows_give_zeros():
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    layer = torch.nn.Module()
    out, _ = hf.attention_forward(layer, q, k, v, mask)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_import_mmattn_does_not_import_transformers_and_register_names_the_extra():
    code = (
        "import sys, mmattn, mmattn.integrations.huggingface as hf\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    hf.register()\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "mmattn[hf]" in result.stdout


# ---------------------------------------------------------------------- kernels and patterns


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_window_masks_run_on_the_band_kernel_with_the_dense_result(causal):
    from transformers.masking_utils import (
        sdpa_mask,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    window, length = 5, 23
    make = sliding_window_causal_mask_function if causal else (
        sliding_window_bidirectional_mask_function
    )
    padding = torch.ones(2, length, dtype=torch.bool)
    padding[1, :4] = False
    mask = sdpa_mask(batch_size=2, q_length=length, kv_length=length,
                     mask_function=make(window), attention_mask=padding, local_size=window)
    layer = torch.nn.Module()
    layer.is_causal = causal
    q = torch.randn(2, 4, length, 8)
    k, v = torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 8)
    paths = []
    remove = _kernel.add_listener(lambda record: paths.append(record["path"]))
    try:
        out, _ = hf.attention_forward(layer, q, k, v, mask, sliding_window=window)
    finally:
        remove()
    assert paths == ["local"]
    want = naive(q, k, v, mask, 8**-0.5).transpose(1, 2)  # float64, not our kernel
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-5)


def test_a_mask_that_is_not_the_window_runs_dense():
    length = 16
    mask = torch.ones(1, 1, length, length, dtype=torch.bool).tril()
    mask[..., 9, 2] = False  # a causal mask with one hole: not a band of any width
    q = k = v = torch.randn(1, 2, length, 8)
    paths = []
    remove = _kernel.add_listener(lambda record: paths.append(record["path"]))
    try:
        out, _ = hf.attention_forward(torch.nn.Module(), q, k, v, mask, sliding_window=4)
    finally:
        remove()
    assert paths and "local" not in paths
    want = naive(q, k, v, mask, 8**-0.5).transpose(1, 2)  # float64, not the kernel it ran
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-5)
    eager = _eager(q, k, v, mask)  # and transformers' own eager attention
    torch.testing.assert_close(out, eager, atol=1e-6, rtol=1e-5)


def _eager(q, k, v, mask):
    """transformers' eager attention function (Llama's) on a bool mask made additive."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.training = q.shape[1] // k.shape[1], False
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out, _ = eager_attention_forward(layer, q, k, v, additive, scaling=q.shape[-1] ** -0.5)
    return out


def test_dropout_applies_in_training_only():
    model, inputs, _ = _decoder(transformers.LlamaForCausalLM, transformers.LlamaConfig,
                                attention_dropout=0.5)
    model.set_attn_implementation(NAME)
    runs = {}
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            runs[train] = [model(**inputs).logits for _ in range(2)]
    assert not torch.allclose(runs[True][0], runs[True][1])
    torch.testing.assert_close(runs[False][0], runs[False][1], atol=0, rtol=0)
