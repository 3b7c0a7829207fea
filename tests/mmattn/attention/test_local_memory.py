"""LocalAttention's memory grows as O(L·window): peak RSS of a child process, measured.

At L=16384 with 4 heads the dense (B, H, L, L) fp32 score matrix alone is 4 GiB; the blocked
kernel must run forward + backward with under 1.5 GiB of peak growth. The measurement runs in
a fresh subprocess so that nothing else in the test session inflates or hides the peak; the
same child also allocates a known 512 MiB tensor to prove the meter sees real allocations.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from mmattn import LocalAttention

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB -> bytes
        raise RuntimeError(field)

    def reset_peak():
        # Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    torch.set_num_threads(2)
    length, window = 16384, 64
    attn = LocalAttention(64, 4, window)
    x = torch.randn(1, length, 64, requires_grad=True)
    attn(x[:, :256])[0].sum().backward()  # warm up allocator and kernels
    x.grad = None
    attn.zero_grad()

    reset_peak()
    base = status("VmRSS")
    out, _ = attn(x)
    out.square().sum().backward()
    growth = status("VmHWM") - base
    ok = bool(torch.isfinite(x.grad).all())
    del out

    reset_peak()
    base_control = status("VmRSS")
    control = torch.ones(128 * 1024 * 1024)  # 512 MiB, touched
    control_growth = status("VmHWM") - base_control
    print(json.dumps({"growth": growth, "control": control_growth, "finite": ok}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_local_attention_16k_peak_memory_growth_under_1_5_gib():
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    gib = 1024**3
    # The meter works: a 512 MiB allocation is seen (within page rounding).
    assert report["control"] >= 0.95 * 512 * 1024**2, report
    assert report["finite"]
    assert report["growth"] < 1.5 * gib, f"peak growth {report['growth'] / gib:.2f} GiB"
