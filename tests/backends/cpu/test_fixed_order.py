"""A decode step's flash attention gives the same bits however its kernel was compiled.

numba runs a parallel kernel's loop body as optimized once in the process that compiled it, but
caches (and a later process runs) the body optimized twice, linked into the kernel's module. A
sum LLVM may reassociate then comes out in two orders: the first run after an empty kernel
cache decoded differently from every later run, and a greedy draft-model run, whose batched
checks and single steps used kernels of different origin, lost a token to a 0.01-logit tie
(tests/tools/test_run_cli.py's draft test, in CI). The kernel now sums in fixed lanes with no
reassociation (backends/cpu/qvec.py, attn_decode.py): here the serial and parallel variants,
compiled in one process and loaded from its cache in another, must agree bit for bit.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ggraph.backends.cpu.qvec import f16_fma, f16_fold, f16_zero

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from ggraph.backends.cpu.attn_bind import decode_attention_kernel
    from ggraph.ir.types import GGMLType as T

    H, HKV, DK, NKV = 6, 2, 80, 300   # two runs of cells; 80 = 5 x 16 lanes
    rng = np.random.default_rng(7)
    kf = rng.standard_normal(NKV * HKV * DK).astype(np.float16).view(np.uint16)
    vf = rng.standard_normal(NKV * HKV * DK).astype(np.float16).view(np.uint16)
    outs = []
    for nt in (1, 3):   # a decode step, and three queries checked at once
        q = rng.standard_normal((1, H, nt, DK)).astype(np.float32)
        m = np.zeros((1, 1, nt, NKV), np.float16)
        m[:, :, :, 250:] = -np.inf            # cells not yet written
        m[:, :, :, 17] = -np.inf              # one hidden inside
        for t in range(nt):
            m[0, 0, t, 240 + t:] = -np.inf    # causal within the batch
        for serial in (True, False):
            d = np.zeros((1, nt, H, DK), np.float32)
            kern = decode_attention_kernel(serial, T.F16, DK, DK)
            kern(q, kf, NKV * HKV * DK, DK, HKV * DK, vf, NKV * HKV * DK, DK, HKV * DK, 1, HKV,
                 NKV, m.view(np.uint16), d, 1 / np.sqrt(DK), 0.0, 0.0, 0, H, True)
            outs.append(d)
    np.savez(sys.argv[1], *outs)
""")


def _run(tmp_path, cache, name):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    out = tmp_path / f"{name}.npz"
    subprocess.run([sys.executable, "-c", SCRIPT, str(out)], check=True, env=env,
                   timeout=600)
    with np.load(out) as z:
        return [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]


def test_decode_attention_same_bits_fresh_cached_serial_parallel(tmp_path):
    cache = tmp_path / "numba-cache"
    fresh = _run(tmp_path, cache, "fresh")     # compiled here (the cache starts empty)
    assert any(cache.rglob("*.nbi")), "the kernels were not cached: nothing to compare"
    cached = _run(tmp_path, cache, "cached")   # loaded from the cache
    for i, (a, b) in enumerate(zip(fresh, cached)):
        assert np.array_equal(a, b), f"output {i}: fresh and cached kernels differ"
    for nt_outs in (fresh[0:2], fresh[2:4]):
        assert np.array_equal(nt_outs[0], nt_outs[1]), "serial and parallel variants differ"
    assert np.isfinite(fresh[0]).all() and np.abs(fresh[0]).max() > 0


@pytest.mark.parametrize("n", [16, 64, 80])
def test_lane_dot_is_the_sum(n):
    """f16_fma / f16_fold compute the dot itself (the order is theirs; the value is the sum)."""
    from numba import njit

    @njit
    def dot(x, y):
        a = f16_zero()
        for i in range(0, x.size, 16):
            a = f16_fma(a, x, i, y, i)
        return f16_fold(a)

    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    want = float(np.dot(x.astype(np.float64), y.astype(np.float64)))
    assert abs(dot(x, y) - want) <= 1e-5 * max(1.0, float(np.abs(x) @ np.abs(y)))
