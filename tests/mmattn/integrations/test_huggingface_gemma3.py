"""Gemma 3 with image tokens through the mmattn backend equals transformers' eager backend.

A tiny Gemma 3 (SigLIP tower, 64 tokens per image, no download) reads two left-padded rows
of text with images between. transformers builds its masks from ``token_type_ids``: causal
text, each image bidirectional within itself; its sliding-window layers AND that with a
window of 24, a mask whose 64-tiles are mostly empty, so those layers run on the
block-sparse kernel. One model object is switched between backends, so the weights are the
same by construction; outputs are compared at real positions (eager averages the keys of a
padded row that may attend nothing; mmattn gives zeros).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmattn.debug import explain  # noqa: E402
from mmattn.integrations import huggingface as hf  # noqa: E402
from mmattn.kernels import dense as _kernel  # noqa: E402

# transformers models: seconds each (see test_huggingface.py): the fused pass runs them.
pytestmark = pytest.mark.slow

NAME = hf.register()
IMAGE, BOI, EOI = 98, 96, 97
PER_IMAGE = 64


@functools.cache
def _built():
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=24, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512, pad_token_id=0, attention_dropout=0.0,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        image_size=32, patch_size=4, attention_dropout=0.0,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=PER_IMAGE,
        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the projection at zero: images would be 0
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    return model


def _row(texts: list[int], seed: int) -> list[int]:
    """Text runs of these lengths with an image (BOI, 64 image tokens, EOI) between each."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for number, length in enumerate(texts):
        ids += torch.randint(4, 90, (length,), generator=gen).tolist()
        if number < len(texts) - 1:
            ids += [BOI] + [IMAGE] * PER_IMAGE + [EOI]
    return ids


def _inputs():
    """Two rows (2 and 1 images), the shorter left-padded; L = 282."""
    rows = [_row([40, 50, 60], 0), _row([30, 94], 1)]
    length = max(map(len, rows))
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    for number, row in enumerate(rows):
        ids[number, length - len(row):] = torch.tensor(row)
        mask[number, length - len(row):] = 1
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels,
              "token_type_ids": (ids == IMAGE).long()}
    return inputs, mask.bool()


def _paths(fn):
    seen = []
    remove = _kernel.add_listener(lambda record: seen.append(record["path"]))
    try:
        result = fn()
    finally:
        remove()
    return result, seen


def _run(model, backend, inputs, real, train, device):
    model.set_attn_implementation(backend)
    model.train(train)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs["pixel_values"] = inputs["pixel_values"].clone().requires_grad_()
    logits, paths = _paths(lambda: model(**inputs).logits)
    logits = logits[real.to(device)]
    weight = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(1))
    (logits * weight.to(device)).sum().backward()
    grads = {"pixel_values": inputs["pixel_values"].grad}
    grads.update({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads, paths


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_gemma3_with_images_equals_eager_and_its_sliding_layer_runs_block_sparse(train, device):
    model = copy.deepcopy(_built()).to(device)
    inputs, real = _inputs()
    ours, our_grads, paths = _run(model, NAME, inputs, real, train, device)
    # the SigLIP layer (no mask), the sliding layer (the tiles of a 24-window), the global
    # layer (causal with images: over half its tiles hold a pair, so dense)
    dense = "fused" if _kernel.use_fused_attn() else "explicit"
    assert paths == [dense, "block-sparse", dense], paths
    theirs, their_grads, _ = _run(model, "eager", inputs, real, train, device)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():  # parameter gradients reach ~1e3: 1e-5 relative
        scale = max(1.0, float(their_grads[name].abs().max()))
        torch.testing.assert_close(grad, their_grads[name], atol=1e-5 * scale, rtol=1e-5,
                                   msg=lambda m, n=name: f"d{n}: {m}")
    if train:
        return
    # the images' bidirectional blocks are in the mask: without token_type_ids, other numbers
    text_only = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    other, _, _ = _run(model, NAME, text_only, real, train, device)
    assert not torch.allclose(other, ours, atol=1e-3)


def test_greedy_generation_with_images_gives_eagers_tokens(device):
    model = copy.deepcopy(_built()).to(device).eval()
    inputs, _ = _inputs()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    tokens, paths = {}, {}
    for backend in (NAME, "eager"):
        model.set_attn_implementation(backend)
        tokens[backend], paths[backend] = _paths(
            lambda: model.generate(**inputs, max_new_tokens=5, do_sample=False)
        )
    assert paths[NAME].count("block-sparse") == 1  # the prefill's sliding layer (steps: q = 1)
    assert tokens[NAME].shape[1] == inputs["input_ids"].shape[1] + 5
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_explain_names_the_block_sparse_kernel_and_its_density():
    model = copy.deepcopy(_built()).eval()
    model.set_attn_implementation(NAME)
    inputs, _ = _inputs()
    with torch.no_grad():
        report = explain(model, **inputs)
    sparse = [call for call in report if call.path == "block-sparse"]
    assert len(sparse) == 1 and sparse[0].cls == "Gemma3Attention"
    assert 0 < sparse[0].density <= 0.5
    assert "block-sparse 64: density" in str(report)
