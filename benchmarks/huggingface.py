"""mmattn as a transformers backend vs transformers' own "sdpa", forward + backward, CPU.

Three small-width models built from configs (no download), fp32, one torch thread:

- Mistral-shaped (``MistralModel``, GQA 4/2 heads, width 128, 4 layers), sliding_window=256,
  one sequence of L=4096: transformers' SDPA backend gets a dense (L, L) band mask; mmattn
  runs the blocked band kernel, O(L·w);
- Llama-shaped (``LlamaModel``, the same sizes), 8 sequences of 64..1024 tokens: mmattn on
  the ``DataCollatorWithFlattening`` packed batch (``position_ids``, ``use_cache=False``)
  vs SDPA on the same sequences as a right-padded batch (8 x 1024 with ``attention_mask``);
- BERT (``BertModel``, width 256, 4 heads, 2 layers) at L=512, batch 4: with and without
  padding.

Contenders run interleaved (benchmarks/_harness.py); we report medians of process CPU time
(the steadier measure on a shared machine) and of wall time.

    python benchmarks/huggingface.py --write-docs   # the table, into docs/performance.md
    python benchmarks/huggingface.py --quick        # small sizes, prints only
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import (  # noqa: E402
    add_docs_argument,
    interleaved_samples,
    markdown_table,
    write_docs,
)
from mmattn.integrations.huggingface import register  # noqa: E402


def decoder(kind: str, width: int, layers: int, window: int | None = None):
    import transformers

    config_cls, model_cls = {
        "mistral": (transformers.MistralConfig, transformers.MistralModel),
        "llama": (transformers.LlamaConfig, transformers.LlamaModel),
    }[kind]
    extra = {"sliding_window": window} if kind == "mistral" else {}
    config = config_cls(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=8192, **extra,
    )
    return model_cls(config).train()


def fwd_bwd(model, backend: str, **inputs):
    def run() -> None:
        model.set_attn_implementation(backend)
        model(**inputs).last_hidden_state.sum().backward()
        model.zero_grad(set_to_none=True)

    return run


def sliding_case(length: int, window: int, width: int, layers: int) -> dict:
    model = decoder("mistral", width, layers, window)
    ids = torch.randint(4, 120, (1, length))
    mask = torch.ones_like(ids)
    return {
        name: fwd_bwd(model, backend, input_ids=ids, attention_mask=mask, use_cache=False)
        for name, backend in (("mmattn", NAME), ("sdpa", "sdpa"))
    }


def packed_case(lengths: list[int], width: int, layers: int) -> dict:
    from transformers import DataCollatorWithFlattening

    model = decoder("llama", width, layers)
    seqs = [torch.randint(4, 120, (n,)).tolist() for n in lengths]
    packed = DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    longest = max(lengths)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    return {
        "mmattn packed": fwd_bwd(
            model, NAME, input_ids=packed["input_ids"], position_ids=packed["position_ids"],
            use_cache=False,
        ),
        "sdpa padded": fwd_bwd(model, "sdpa", input_ids=ids, attention_mask=mask, use_cache=False),
    }


def bert_case(length: int, batch: int, width: int, layers: int, padded: bool) -> dict:
    import transformers

    config = transformers.BertConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=4, vocab_size=128, max_position_embeddings=length,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertModel(config, add_pooling_layer=False).train()
    ids = torch.randint(4, 120, (batch, length))
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch):
            mask[row, length - row * length // (2 * batch):] = 0
    return {
        f"mmattn{' padded' if padded else ''}": fwd_bwd(
            model, NAME, input_ids=ids, attention_mask=mask
        ),
        f"sdpa{' padded' if padded else ''}": fwd_bwd(
            model, "sdpa", input_ids=ids, attention_mask=mask
        ),
    }


NAME = "mmattn"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    add_docs_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    register(NAME)
    if args.quick:
        length, window, lengths, bert_len, repeats = 512, 64, [16, 40, 64, 128], 128, 2
    else:
        length, window, repeats = 4096, 256, args.repeats
        lengths = [round(64 + (1024 - 64) * n / 7) for n in range(8)]
        bert_len = 512
    width, layers = 128, 4
    cases = {
        "sliding": sliding_case(length, window, width, layers),
        "packed": packed_case(lengths, width, layers),
        "bert": bert_case(bert_len, 4, 256, 2, padded=False),
        "bert padded": bert_case(bert_len, 4, 256, 2, padded=True),
    }
    rows, verdicts = [], []
    for case, runs in cases.items():
        # BERT runs are short and the two backends close: more repeats for a steadier ratio
        count = repeats * 3 if case.startswith("bert") else repeats
        wall_runs, cpu_runs = interleaved_samples(runs, repeats=count, warmup=1)
        cpu = {n: statistics.median(ts) for n, ts in cpu_runs.items()}
        wall = {n: statistics.median(ts) for n, ts in wall_runs.items()}
        ours, theirs = list(runs)
        for name in runs:
            rows.append([case, name, round(cpu[name] * 1e3), round(wall[name] * 1e3), ""])
        speedup = cpu[theirs] / cpu[ours]
        rows.append([case, f"{theirs} / {ours}", "", "",
                     f"{speedup:.2f}x (wall {wall[theirs] / wall[ours]:.2f}x)"])
        verdicts.append((case, speedup))
        print(case, {n: f"{t * 1e3:.0f} ms" for n, t in cpu.items()}, f"{speedup:.2f}x")
    table = markdown_table(
        ["case", "contender (fwd+bwd)", "CPU ms", "wall ms", "speed-up (CPU time)"], rows
    )
    facts = (
        f"Mistral-shaped: L={length}, sliding_window={window}; packed: lengths {lengths} "
        f"(sum {sum(lengths)} vs {len(lengths)} x {max(lengths)} padded); BERT: L={bert_len}, "
        f"batch 4, width 256, 2 layers; decoders width {width}, 4/2 heads, {layers} layers; "
        f"{repeats} interleaved repeats ({3 * repeats} for BERT), medians; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads."
    )
    print(facts)
    print(table)
    if args.write_docs:
        write_docs("huggingface", f"{facts}\n\n{table}")


if __name__ == "__main__":
    main()
