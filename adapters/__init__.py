"""mmattn adapters: turn text, images, video, audio and graphs into ``Tokens`` (B, L, D) +
mask.

``import adapters`` needs only torch and einops; torchvision, torchaudio and torch_geometric
are imported when an adapter first needs them, and a missing one raises ImportError naming
the pip extra (``pip install "mmattn[vision]"``, ``[audio]``, ``[graph]``).
"""

from adapters.audio import AudioFrameEmbedder, num_frames
from adapters.base import ModalityAdapter, adapter_class, available, create
from adapters.graph import GraphNodeSequencer, laplacian_eigenvectors, neighbourhood_mask
from adapters.image import IMAGENET_MEAN, IMAGENET_STD, ImagePatcher, image_transform
from adapters.text import ByteTokenizer, TextTokenEmbedder
from adapters.video import VideoPatcher

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "AudioFrameEmbedder",
    "ByteTokenizer",
    "GraphNodeSequencer",
    "ImagePatcher",
    "ModalityAdapter",
    "TextTokenEmbedder",
    "VideoPatcher",
    "adapter_class",
    "available",
    "create",
    "image_transform",
    "laplacian_eigenvectors",
    "neighbourhood_mask",
    "num_frames",
]
