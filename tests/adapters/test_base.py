"""The registry, the base class, and the lazy imports of the modality libraries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import adapters
from adapters import base
from mmattn.tokens import Tokens


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


def test_builtin_adapters_are_registered_and_created_by_name():
    assert {"text", "image", "audio", "graph"} <= set(adapters.available())
    assert adapters.available() == sorted(adapters.available())
    text = adapters.create("text", vocab_size=10, embed_dim=8)
    assert isinstance(text, adapters.TextTokenEmbedder) and text.embed_dim == 8
    assert isinstance(adapters.create("image", embed_dim=8, patch_size=4), adapters.ImagePatcher)


def test_create_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"name must be one of .*'text'.*got 'hologram'"):
        adapters.create("hologram", embed_dim=8)


def test_subclass_registers_and_duplicates_are_refused(clean_registry):
    class Counts(adapters.ModalityAdapter):
        modality = "counts_test"

        def __init__(self, embed_dim: int) -> None:
            super().__init__(embed_dim)
            self.proj = nn.Linear(1, embed_dim)

        def forward(self, values):
            return Tokens(self.proj(values[..., None]))

    assert "counts_test" in adapters.available()
    assert adapters.create("counts_test", embed_dim=3)(torch.zeros(2, 4)).x.shape == (2, 4, 3)

    with pytest.raises(ValueError, match="'counts_test' is already registered"):

        class Other(adapters.ModalityAdapter):
            modality = "counts_test"

    class Quiet(adapters.ModalityAdapter, register=False):
        modality = "quiet_test"

    assert "quiet_test" not in adapters.available()


def test_bad_modality_and_embed_dim(clean_registry):
    with pytest.raises(TypeError, match="modality must be a non-empty str"):

        class Bad(adapters.ModalityAdapter):
            modality = 3

    with pytest.raises(ValueError, match="embed_dim must be >= 1, got 0"):
        adapters.TextTokenEmbedder(10, 0)
    with pytest.raises(TypeError, match="embed_dim must be an int"):
        adapters.TextTokenEmbedder(10, 8.0)


def test_import_adapters_needs_only_torch_and_einops():
    script = textwrap.dedent(
        """
        import sys
        BLOCKED = ("torchvision", "torchaudio", "torch_geometric")

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {name!r}")

        sys.meta_path.insert(0, Block())
        import torch
        import adapters
        loaded = [m for m in BLOCKED if m in sys.modules]
        assert not loaded, loaded
        patcher = adapters.ImagePatcher(8, patch_size=4, img_size=8)  # needs only torch
        assert patcher(torch.rand(1, 3, 8, 8)).x.shape == (1, 4, 8)
        adapters.AudioFrameEmbedder(8, frontend="raw")(torch.randn(1, 400))
        for make, extra in [
            (lambda: adapters.AudioFrameEmbedder(8), "audio"),
            (lambda: adapters.GraphNodeSequencer(4, 8), "graph"),
            (lambda: adapters.image_transform(8), "vision"),
        ]:
            try:
                make()
            except ImportError as err:
                assert f'pip install "mmattn[{extra}]"' in str(err), err
            else:
                raise SystemExit(f"no ImportError for {extra}")
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize(
    "hidden, make, extra",
    [
        ("torchaudio", lambda: adapters.AudioFrameEmbedder(8), "audio"),
        (
            "torchaudio",
            lambda: adapters.AudioFrameEmbedder(8, frontend="raw")(
                torch.randn(1, 800), input_rate=8000
            ),
            "audio",
        ),
        ("torch_geometric", lambda: adapters.GraphNodeSequencer(4, 8), "graph"),
        ("torch_geometric", lambda: adapters.neighbourhood_mask(torch.zeros(2, 1).long()), "graph"),
        ("torchvision", lambda: adapters.image_transform(8), "vision"),
    ],
)
def test_missing_library_names_the_pip_extra(monkeypatch, hidden, make, extra):
    monkeypatch.setitem(sys.modules, hidden, None)  # import of `hidden` now fails
    with pytest.raises(ImportError, match=rf'{hidden}.*pip install "mmattn\[{extra}\]"'):
        make()
