"""CPU kernel templates for fused node groups (backends/cpu/fusion.py decides the groups).

k_norm_chain runs, row by row, what up to four nodes compute one after the other:

    s = a <pre> b          (an element-wise binary op, b broadcast; skipped when pre < 0)
    n = norm(s)            (rms_norm or norm)
    m = n <post1> w1       (skipped when post1 < 0)
    d = m <post2> w2       (skipped when post2 < 0)

Every value is rounded to float32 where the unfused kernels round it (binary_value of the
shared element-wise math, the norm by the same norm_row as k_norm, in float64), so a fused run
is bit for bit the unfused one. Intermediates a later node or the caller reads are written
(write_s / write_n / write_m); the others stay in a scratch row. All arrays are float32 4-D
views in numpy order; b, w1 and w2 broadcast by modulo as in k_binary.
"""

import numpy as np
from numba import prange
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
binary_row, norm_row = bound("binary_row", "norm_row")


def k_norm_chain(a, b, w1, w2, s, n, m, d, pre, eps, rms, post1, post2, write_s, write_n,
                 write_m):
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        for i in range(n0):
            x[i] = a[i3, i2, i1, i]
        if pre >= 0:
            binary_row(pre, x, b[i3 % b.shape[0], i2 % b.shape[1],
                            i1 % b.shape[2]])
            if write_s:
                for i in range(n0):
                    s[i3, i2, i1, i] = x[i]
        norm_row(x, eps, rms)
        if write_n:
            for i in range(n0):
                n[i3, i2, i1, i] = x[i]
        if post1 >= 0:
            binary_row(post1, x, w1[i3 % w1.shape[0], i2 % w1.shape[1],
                               i1 % w1.shape[2]])
            if write_m:
                for i in range(n0):
                    m[i3, i2, i1, i] = x[i]
        if post2 >= 0:
            binary_row(post2, x, w2[i3 % w2.shape[0], i2 % w2.shape[1],
                               i1 % w2.shape[2]])
        for i in range(n0):
            d[i3, i2, i1, i] = x[i]
