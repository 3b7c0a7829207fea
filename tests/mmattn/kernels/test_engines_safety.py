"""The engines never raise (issue 40), without compiling anything: select refuses what an
engine cannot run (a simulated pre-Ampere GPU, flex's CUDA tiles), an engine that fails on
an automatic choice hands the call to the fallback with one warning (a simulated failure),
a forced one raises; the report state is per thread; the packed layouts are bounded in
bytes; the detected facts."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from mmattn import LocalAttention, MultiHeadAttention
from mmattn.debug import explain
from mmattn.kernels import dense, engines
from mmattn.kernels.engines import Available, Call, select

pytestmark = [pytest.mark.pins_path, pytest.mark.usefixtures("fused_only")]

ALL = Available(varlen=True, varlen_window=True, varlen_gqa=True, flex=True, flex_aux=True)
BF16, FP16 = torch.bfloat16, torch.float16


def call(kind="window", dtype=BF16, capability=(9, 0), **kw) -> Call:
    return Call(kind=kind, device="cuda", dtype=dtype, head_dim=64, capability=capability,
                **kw)


@pytest.fixture(autouse=True)
def _fresh_failures():
    engines.forget_failures()
    yield
    engines.forget_failures()


# ------------------------------------------------------------ select: what each engine runs


@pytest.mark.parametrize("capability, dtype, engine, words", [
    ((9, 0), BF16, "varlen", "flash on the real lengths"),
    ((8, 0), FP16, "varlen", "flash on the real lengths"),
    ((7, 5), FP16, "flex", "needs compute capability 8.0+, this GPU has 7.5"),  # T4
    ((7, 0), FP16, "flex", "needs compute capability 8.0+, this GPU has 7.0"),  # V100
    ((7, 5), BF16, "fallback", "flex_attention in bfloat16 needs compute capability 8.0+"),
    ((6, 1), FP16, "fallback", "flex_attention (Triton) needs compute capability 7.0+"),
    ((9, 0), torch.float32, "flex", "takes float16/bfloat16, not float32"),
    ((9, 0), torch.float64, "fallback", "takes float16/bfloat16/float32, not float64"),
])
def test_select_refuses_what_a_simulated_gpu_cannot_run(capability, dtype, engine, words):
    """Pre-Ampere cards have no flash (torch's can_use_flash_attention: sm80+): a half
    precision LocalAttention call goes to flex, or the fallback where Triton cannot run it;
    the reason names the capability."""
    choice = select(call(dtype=dtype, capability=capability), ALL, None)
    assert choice.engine == engine
    assert words in choice.reason


@pytest.mark.parametrize("head_dim, engine, words", [
    (64, "varlen", "flash"), (256, "varlen", "flash"), (264, "flex", "8..256"),
    (20, "flex", "in steps of 8, not 20"), (8, "varlen", "flash"),
    (4, "fallback", "head widths >= 16, not 4"),
])
def test_select_head_widths(head_dim, engine, words):
    choice = select(Call(kind="segments", device="cuda", dtype=BF16, head_dim=head_dim,
                         capability=(9, 0)), ALL, None)
    assert choice.engine == engine and words in choice.reason


@pytest.mark.parametrize("block, cuda_engine", [
    (16, "flex"), (32, "flex"), (64, "flex"), (128, "flex"), (256, "flex"),
    (48, "fallback"), (80, "fallback"), (96, "fallback"), (112, "fallback"), (8, "fallback"),
])
def test_select_knows_flex_tiles(block, cuda_engine):
    """On CUDA torch fits flex's tiles to power-of-two block sizes only (48, 80, 96, 112
    fail to compile there); below 16 its CPU kernel is not exact. The reason says which."""
    blocks = call("blocks", block=block)
    choice = select(blocks, ALL, None)
    assert choice.engine == cuda_engine
    if cuda_engine == "fallback":
        assert f"not {block}" in choice.reason
    cpu = Call(kind="blocks", device="cpu", dtype=torch.float32, head_dim=64, block=block)
    assert select(cpu, ALL, ("flex",)).engine == ("fallback" if block % 16 else "flex")
    assert engines.flex_block_refusal(block, "cpu") is None or block % 16


def test_block_mask_refuses_tiles_flex_cannot_run_on_cuda():
    from mmattn.patterns._flex import flex_block_size

    assert flex_block_size(48, torch.device("cpu")) == 48
    assert flex_block_size(64, torch.device("cuda")) == 64
    with pytest.raises(ValueError, match=r"block_size a power of two >= 16.*got 48"):
        flex_block_size(48, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"block_size a multiple of 16.*got 24"):
        flex_block_size(24, torch.device("cuda"))


def test_select_without_features_falls_back():
    """A torch without flex's logsumexp cannot run sinks on flex; without Triton flex does
    not compile for CUDA; packed rows are varlen's only."""
    sinks = call("blocks", modifiers=("sinks",))
    no_lse = Available(varlen=True, varlen_window=True, flex=True)
    assert "no logsumexp" in select(sinks, no_lse, None).reason
    assert select(sinks, ALL, None).engine == "flex"
    assert "Triton" in select(call("blocks"), Available(flex=True, triton=False), None).reason
    packed = call("segments", packed=True, dtype=torch.float32)
    assert "jagged" in select(packed, ALL, None).reason


def test_segments_with_a_key_mask_go_to_flex_without_a_host_read():
    """A key padding mask beside a segment-wise SparseMask is not compared with the tokens'
    padding (that was a torch.equal, a host sync, per layer and call): varlen refuses it."""
    choice = select(call("segments", key_mask=True), ALL, None)
    assert choice.engine == "flex" and "pass none with it" in choice.reason


def test_available_detects_features():
    have = engines.available()
    assert isinstance(have, Available)
    assert not (have.varlen_window or have.varlen_gqa) or have.varlen
    assert not have.flex_sinks or have.flex  # the logsumexp implies flex
    import torch._dynamo

    if have.limit_name:  # the limit's name in this torch, and its exceptions
        assert engines.recompile_limit(have) == getattr(torch._dynamo.config, have.limit_name)
        assert have.limit_errors and all(issubclass(e, Exception) for e in have.limit_errors)
    assert engines.capability(torch.device("cpu")) is None


# ------------------------------------------------------------ attempt: failures fall back


def test_attempt_falls_back_once_and_remembers():
    """An automatic choice that raises: the fallback runs, one warning names the engine,
    the error and how to refuse it, and calls of the same signature skip the engine."""
    case = call("blocks")
    choice = select(case, ALL, None)
    assert choice.engine == "flex"

    def broken():
        raise RuntimeError("triton exploded")

    with pytest.warns(RuntimeWarning) as caught:
        out, why = engines.attempt(choice, case, broken, ALL)
        again, _ = engines.attempt(choice, case, broken, ALL)  # no second warning
    assert out is None and again is None and len(caught) == 1
    message = str(caught[0].message)
    for words in ("flex engine", "RuntimeError: triton exploded", "use('fallback')",
                  "MMATTN_ENGINE=fallback"):
        assert words in message
    assert why.engine == "fallback" and "triton exploded" in why.reason
    later = select(case, ALL, None)
    assert later.engine == "fallback" and "raised on a call like this before" in later.reason
    # another signature still gets the engine; forcing ignores the memory
    assert select(call("blocks", dtype=FP16), ALL, None).engine == "flex"
    assert select(case, ALL, ("flex",)).engine == "flex"


def test_attempt_raises_for_a_forced_engine_and_out_of_memory():
    case = call("blocks")
    choice = engines.Choice("flex", "forced")

    def broken():
        raise RuntimeError("triton exploded")

    with engines.use("flex"), pytest.raises(RuntimeError, match="triton exploded"):
        engines.attempt(choice, case, broken, ALL)

    def full():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        engines.attempt(choice, case, full, ALL)
    assert select(case, ALL, None).engine == "flex"  # neither is remembered


def test_attempt_treats_the_recompile_limit_apart():
    """Dynamo's recompile limit is not an engine failure: the fallback runs, forced or not,
    with one warning naming the limit; the engine stays on for later calls."""

    class LimitHit(Exception):
        pass

    have = Available(flex=True, limit_name="recompile_limit", limit_errors=(LimitHit,))
    case = call("blocks")

    def hit():
        raise LimitHit("Hard failure due to fullgraph=True")

    with engines.use("flex"), pytest.warns(RuntimeWarning, match="recompile limit"):
        out, why = engines.attempt(engines.Choice("flex", ""), case, hit, have)
    assert out is None and "recompile_limit" in why.reason
    assert select(case, ALL, None).engine == "flex"


def test_a_simulated_engine_failure_runs_the_fallback(monkeypatch):
    """A module on an automatically chosen engine whose kernel raises (CPU: the choice is
    simulated, flex_attend replaced by one that fails): the output is the fallback's,
    explain names the fallback and the error, one warning is issued."""
    from mmattn.kernels import flex

    real_select = engines.select  # automatic flex on the CPU, as on a GPU
    monkeypatch.setattr(engines, "considered", lambda device: True)
    monkeypatch.setattr(engines, "select", lambda c, *a, **k: real_select(
        c, allowed=engines.forced() or ("flex",)))

    def failing(*args, **kwargs):
        raise RuntimeError("simulated Triton failure")

    monkeypatch.setattr(flex, "flex_attend", failing)
    torch.manual_seed(0)
    layer = LocalAttention(32, 4, window_size=3, num_global_tokens=2).eval()
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        with engines.use("fallback"):
            want, _ = layer(x)
        with pytest.warns(RuntimeWarning, match="simulated Triton failure") as caught:
            report = explain(layer, x)
            again, _ = layer(x)
    assert len([w for w in caught if "simulated" in str(w.message)]) == 1
    assert report[0].engine == "fallback" and report[0].path == "local"
    assert "flex raised RuntimeError: simulated Triton failure" in report[0].engine_reason
    torch.testing.assert_close(report.output[0], want)
    torch.testing.assert_close(again, want)
    # with the engine forced, its error is the user's
    with engines.use("flex"), torch.no_grad(), pytest.raises(RuntimeError, match="simulated"):
        layer(x)


# ------------------------------------------------------------ state and caches


def test_report_listeners_are_per_thread():
    """Two threads explaining at once each hear their own calls only."""
    torch.manual_seed(0)
    small, large = MultiHeadAttention(16, 2).eval(), MultiHeadAttention(32, 2).eval()
    heard: dict[str, list[int]] = {"small": [], "large": []}
    barrier = threading.Barrier(2)

    def work(name, layer, width):
        remove = dense.add_listener(lambda r: heard[name].append(int(r["q"].shape[-1])))
        barrier.wait()
        try:
            with torch.no_grad():
                for _ in range(20):
                    layer(torch.randn(1, 5, width))
        finally:
            remove()

    threads = [threading.Thread(target=work, args=("small", small, 16)),
               threading.Thread(target=work, args=("large", large, 32))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert heard["small"] == [8] * 20 and heard["large"] == [16] * 20
    assert not dense.reporting()  # nothing leaked into this thread


def test_report_facts_nest_and_restore():
    heard = []
    remove = dense.add_listener(heard.append)
    try:
        with dense.report_facts(items=(1, 2)):
            with dense.report_facts(engine="fallback"):
                dense.report("probe")
            dense.report("outer")
        dense.report("none")
    finally:
        remove()
    assert heard[0]["items"] == (1, 2) and heard[0]["engine"] == "fallback"
    assert heard[1]["items"] == (1, 2) and "engine" not in heard[1]
    assert "items" not in heard[2] and dict(dense.current_facts()) == {}


def test_packed_layouts_are_bounded_in_bytes(monkeypatch):
    """Every new batch's lengths are a new layout: the cache keeps them within its byte
    budget (an lru_cache of 64 entries held about 400 MB of GPU indices)."""
    from mmattn.kernels import packed
    from mmattn.kernels._neighborhood_plan import ByteCache

    monkeypatch.setattr(packed, "_LAYOUTS", ByteCache(64 * 1024))
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        lens = tuple(torch.randint(50, 400, (8,), generator=gen).tolist())
        out = packed.layout(lens, lens, lens, (), 64, torch.device("cpu"))
        assert out.q_index.numel() >= sum(lens)
        assert packed._LAYOUTS.nbytes <= 64 * 1024
    assert 0 < len(packed._LAYOUTS) < 40
    assert packed.layout(lens, lens, lens, (), 64, torch.device("cpu")) is out  # still held
    packed.clear_layouts()
    assert len(packed._LAYOUTS) == 0


def test_no_deprecation_warning_from_the_flex_spellings():
    """flex is asked for its logsumexp with the spelling this torch prefers (return_aux
    where it exists), so a call prints no deprecation warning (CPU: sinks run flex eagerly,
    no compile)."""
    from mmattn.kernels._routes import band_mask_mod, block_mask
    from mmattn.kernels.flex import flex_attend
    from mmattn.kernels.modifiers import Modifiers

    if not engines.available().flex_sinks:
        pytest.skip("this torch's flex returns no logsumexp")
    cpu = torch.device("cpu")
    q = torch.randn(1, 2, 20, 16)
    mask = block_mask(("band", 2, False, 0), lambda: band_mask_mod(2, False, 0, cpu), 20, cpu,
                      16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = flex_attend(q, q, q, mask, modifiers=Modifiers(sinks=torch.zeros(2)))
    assert out.shape == q.shape and torch.isfinite(out).all()
