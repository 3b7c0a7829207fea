"""Adapters side by side: ImagePatcher, AudioFrameEmbedder, GraphNodeSequencer vs hand-built twins.

Axis key: ``b`` batch, ``c`` channels, ``h``/``w`` pixels, ``p`` patch, ``l`` tokens,
``d`` model width, ``n`` nodes.

Every contender runs forward + backward (a fixed upstream gradient) in the same process;
contenders are interleaved round by round in a shuffled order (benchmarks/_harness.py) and
the median of the rounds is reported, with the ratio to the baseline of each group (first
row). Prints a markdown table.

    python benchmarks/adapters.py            # full sizes (as in docs/performance.md)
    python benchmarks/adapters.py --quick    # small sizes, few rounds, for development
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `adapters` package it measures: drop the folder.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
from einops import rearrange  # noqa: E402
from torch import nn  # noqa: E402

from adapters import AudioFrameEmbedder, GraphNodeSequencer, ImagePatcher  # noqa: E402

sys.path.append(str(_HERE))  # after `adapters` is imported, so it cannot shadow it
from _harness import add_docs_argument, interleaved_medians, write_docs  # noqa: E402


def measure(
    contenders: dict[str, Callable[[], torch.Tensor]],
    grads: dict[str, torch.Tensor | None],
    rounds: int,
    device: torch.device,
) -> dict[str, float]:
    """Median seconds per contender's forward + backward, rounds interleaved in a shuffled
    order after one warm-up round (benchmarks/_harness.py; on CUDA, CUDA events around
    enough calls per sample to last about 20 ms)."""

    def step(fn: Callable[[], torch.Tensor], grad: torch.Tensor | None) -> None:
        out = fn()
        if grad is not None:
            out.backward(grad)

    steps = {name: (lambda fn=fn, grad=grads[name]: step(fn, grad))
             for name, fn in contenders.items()}
    cuda = device.type == "cuda"
    return interleaved_medians(steps, rounds, warmup=1, calls=None if cuda else 1,
                               device=device.type)


def image_group(args, device, dtype):
    b, size, patch, dim = (8, 224, 16, 384) if args.quick else (64, 224, 16, 384)
    images = torch.randn(b, 3, size, size, device=device, dtype=dtype)
    patcher = ImagePatcher(dim, patch, img_size=size, positional=None, device=device, dtype=dtype)
    unfold = ImagePatcher(dim, patch, img_size=size, positional=None, device=device, dtype=dtype)
    unfold.fused = False
    with_pos = ImagePatcher(dim, patch, img_size=size, device=device, dtype=dtype)
    conv = nn.Conv2d(3, dim, patch, stride=patch, device=device, dtype=dtype)
    conv_cl = nn.Conv2d(3, dim, patch, stride=patch, device=device, dtype=dtype)
    conv_cl = conv_cl.to(memory_format=torch.channels_last)
    linear = nn.Linear(3 * patch * patch, dim, device=device, dtype=dtype)

    def conv_embed():  # timm PatchEmbed: proj, flatten(2), transpose(1, 2)
        return conv(images).flatten(2).transpose(1, 2)

    def conv_cl_embed():
        x = images.contiguous(memory_format=torch.channels_last)
        return conv_cl(x).flatten(2).transpose(1, 2)

    def einops_linear():
        return linear(
            rearrange(images, "b c (h p1) (w p2) -> b (h w) (c p1 p2)", p1=patch, p2=patch)
        )

    contenders = {
        "Conv2d patch embedding (timm-style, baseline)": conv_embed,
        "ImagePatcher (fast path, default)": lambda: patcher(images).x,
        "ImagePatcher (unfold path, fused=False)": lambda: unfold(images).x,
        "ImagePatcher + learned 2D positions": lambda: with_pos(images).x,
        "Conv2d, channels-last": conv_cl_embed,
        "einops rearrange + Linear": einops_linear,
    }
    grad = torch.randn(b, (size // patch) ** 2, dim, device=device, dtype=dtype)
    label = f"image: B={b}, {size}x{size}, patch {patch}, D={dim}, fwd+bwd"
    return label, contenders, dict.fromkeys(contenders, grad)


def audio_group(args, device, dtype):
    import torchaudio

    b, sr, dim = (8, 16000, 384) if args.quick else (32, 16000, 384)
    wave = torch.randn(b, sr, device=device)
    lengths = torch.randint(sr // 2, sr + 1, (b,), device=device)
    audio = AudioFrameEmbedder(dim, sr, n_mels=80, device=device, dtype=dtype)
    raw = AudioFrameEmbedder(dim, sr, frontend="raw", device=device, dtype=dtype)
    mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=400, hop_length=160, n_mels=80).to(device)
    to_db = torchaudio.transforms.AmplitudeToDB("power", top_db=None).to(device)
    linear = nn.Linear(80, dim, device=device, dtype=dtype)

    def by_hand():  # torchaudio transforms + Linear, no mask, no positions
        feats = rearrange(to_db(mel(wave)), "b m l -> b l m")
        return linear(feats.to(dtype))

    contenders = {
        "MelSpectrogram + AmplitudeToDB + Linear by hand (baseline)": by_hand,
        "AudioFrameEmbedder (mel, lengths, positions)": lambda: audio(wave, lengths).x,
        "AudioFrameEmbedder (raw frames)": lambda: raw(wave, lengths).x,
    }
    frames = 1 + sr // 160
    grad = torch.randn(b, frames, dim, device=device, dtype=dtype)
    label = f"audio: {b} clips of 1 s at 16 kHz, 80 mels, hop 160, D={dim}, fwd+bwd"
    return label, contenders, dict.fromkeys(contenders, grad)


def graph_group(args, device, dtype):
    from torch_geometric.data import Batch, Data
    from torch_geometric.utils import to_dense_batch

    count, feat, dim = (32, 64, 384) if args.quick else (256, 64, 384)
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(10, 201, (count,), generator=gen).tolist()
    graphs = [
        Data(x=torch.randn(n, feat, generator=gen), edge_index=torch.randint(0, n, (2, 4 * n)))
        for n in sizes
    ]
    batch = Batch.from_data_list(graphs).to(device)
    seq = GraphNodeSequencer(feat, dim, device=device, dtype=dtype)
    linear = nn.Linear(feat, dim, device=device, dtype=dtype)

    def by_hand():
        dense, _ = to_dense_batch(linear(batch.x), batch.batch, batch_size=batch.num_graphs)
        return dense

    contenders = {
        "Linear + to_dense_batch by hand (baseline)": by_hand,
        "GraphNodeSequencer": lambda: seq(batch).x,
    }
    grad = torch.randn(count, max(sizes), dim, device=device, dtype=dtype)
    label = (
        f"graph: {count} graphs of 10-200 nodes ({sum(sizes)} nodes), F={feat}, D={dim}, fwd+bwd"
    )
    return label, contenders, dict.fromkeys(contenders, grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--only", choices=["image", "audio", "graph"], default=None)
    add_docs_argument(parser)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rounds = args.rounds or (3 if args.quick else 10)
    torch.manual_seed(0)

    print(
        f"torch {torch.__version__}, device {device}, dtype {args.dtype}, "
        f"threads {torch.get_num_threads()}, rounds {rounds} (median)\n"
    )
    lines = ["| group | contender | median ms | ratio |", "|---|---|---:|---:|"]
    print("\n".join(lines))
    groups = {"image": image_group, "audio": audio_group, "graph": graph_group}
    for name, build in groups.items():
        if args.only not in (None, name):
            continue
        label, contenders, grads = build(args, device, dtype)
        medians = measure(contenders, grads, rounds, device)
        base = next(iter(medians.values()))
        for contender, seconds in medians.items():
            lines.append(f"| {label} | {contender} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")
            print(lines[-1])
    if args.write_docs:
        plain = device.type == "cpu" and args.dtype == "float32" and args.only is None
        write_docs("adapters" if plain else f"adapters-{device.type}-{args.dtype}",
                   "\n".join(lines), device=str(device))


if __name__ == "__main__":
    main()
