"""KL divergence of a model's logits against a base file of log-probabilities, with the
statistics and wording of llama.cpp's llama-perplexity --kl-divergence (kl_divergence() in
tools/perplexity/perplexity.cpp).

Per scored token: KLD = sum_i p_base(i) * (log p_base(i) - log q(i)) over the entries whose
stored base log-probability is above -16 (the rest are not stored); NLL and NLL_base of the
next token; Δp = q(token) - p_base(token); top-1 agreement (argmax of the logits against the
argmax of the stored row, first index on ties). The summary is llama.cpp's: mean ± standard
error (0 for 10 samples or fewer), the ln(PPL(Q)/PPL(base)) ratio with the covariance of the
two NLLs, the correlation, percentiles by linear interpolation, RMS Δp and "Same top p".

Log-probabilities of the logits are float64 here (llama.cpp: float32 with a double sum), and
the stored rows decode in float32 as llama.cpp decodes them. The base file format:
graphs/eval/perplexity.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggraph.graphs.eval.perplexity import ROW_BLOCK, dequantize_log_probs, log_softmax

# llama.cpp skips stored entries at or below this log-probability (they were clipped to the
# row's minimum when written)
LOG_P_FLOOR = -16.0
MIN_COUNT_FOR_SUMMARY = 100  # llama.cpp prints no summary below this many tokens


@dataclass
class TokenKld:
    """Per-token values of one chunk (or of a whole run, concatenated)."""
    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray  # bool

    @staticmethod
    def concat(parts: list[TokenKld]) -> TokenKld:
        if not parts:
            e = np.zeros(0)
            return TokenKld(e, e, e, e, np.zeros(0, dtype=bool))
        return TokenKld(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                          ("nll", "nll_base", "kld", "p_diff", "same_top")))


def token_kld(logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> TokenKld:
    """Compare rows of logits (n, n_vocab) with the stored base rows (n, row_width) for the
    next tokens `targets` (n,)."""
    n, n_vocab = logits.shape
    targets = np.asarray(targets, dtype=np.int64)
    if base_rows.shape[0] != n or targets.shape != (n,):
        raise ValueError(f"token_kld: {n} rows of logits, {base_rows.shape[0]} base rows, "
                         f"{targets.shape} targets")
    out = {k: np.empty(n) for k in ("nll", "nll_base", "kld", "p_diff")}
    same = np.empty(n, dtype=bool)
    for s in range(0, n, ROW_BLOCK):
        sl = slice(s, s + ROW_BLOCK)
        lq = log_softmax(logits[sl])
        lb32 = dequantize_log_probs(base_rows[sl], n_vocab)
        lb = lb32.astype(np.float64)
        r = np.arange(lq.shape[0])
        t = targets[sl]
        kept = lb > LOG_P_FLOOR
        terms = np.where(kept, np.exp(lb) * (lb - lq), 0.0)
        out["kld"][sl] = terms.sum(axis=1)
        out["nll"][sl] = -lq[r, t]
        out["nll_base"][sl] = -lb[r, t]
        out["p_diff"][sl] = np.exp(lq[r, t]) - np.exp(lb[r, t])
        same[sl] = np.argmax(logits[sl], axis=1) == np.argmax(lb32, axis=1)
    return TokenKld(out["nll"], out["nll_base"], out["kld"], out["p_diff"], same)


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean and standard error of the mean (0 for 10 values or fewer)."""
    n = values.size
    if n < 1:
        return 0.0, 0.0
    f = float(values.sum() / n)
    df = float((values * values).sum() / n - f * f)
    return f, (float(np.sqrt(df / (n - 1))) if df > 0 and n > 10 else 0.0)


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's covariance of the two means (0 for fewer than 10 values)."""
    n = a.size
    if n < 10:
        return 0.0
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation between the sorted values (the fraction
    rounded to float32 as it is there)."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = float(np.float32(fraction) * np.float32(v.size - 1))
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, v.size - 1)])


def median(sorted_values: np.ndarray) -> float:
    v, n = sorted_values, sorted_values.size
    return float(0.5 * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])


@dataclass
class KldSummary:
    """The figures of llama.cpp's final report, for tables and JSON."""
    count: int
    ppl: tuple[float, float]
    ppl_base: tuple[float, float]
    cor: float
    ln_ratio: tuple[float, float]
    ratio: tuple[float, float]
    diff: tuple[float, float]
    kld: tuple[float, float]
    kld_median: float
    kld_percentiles: dict[str, float]
    p_diff: tuple[float, float]
    p_diff_median: float
    p_diff_percentiles: dict[str, float]
    rms_p_diff: tuple[float, float]
    same_top: tuple[float, float]

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


KLD_FRACTIONS = (("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95),
                 ("90.0%", 0.9), ("Median", None), ("10.0%", 0.1), (" 5.0%", 0.05),
                 (" 1.0%", 0.01), (" 0.1%", 0.001), ("Minimum", 0.0))
P_DIFF_FRACTIONS = (("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95),
                    ("90.0%", 0.9), ("75.0%", 0.75), ("Median", None), ("25.0%", 0.25),
                    ("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001),
                    ("Minimum", 0.0))


@dataclass
class KldStats:
    """Running per-token values; chunk lines and the final report as llama.cpp prints them."""
    parts: list[TokenKld] = field(default_factory=list)

    def add(self, part: TokenKld) -> None:
        self.parts.append(part)

    @property
    def tokens(self) -> TokenKld:
        return TokenKld.concat(self.parts)

    def _ppl_figures(self, t: TokenKld) -> tuple:
        lp, lb = mean_and_uncertainty(t.nll), mean_and_uncertainty(t.nll_base)
        cov = covariance(t.nll, t.nll_base)
        ratio_unc = float(np.sqrt(max(lp[1] ** 2 + lb[1] ** 2 - 2.0 * cov, 0.0)))
        return lp, lb, cov, (lp[0] - lb[0], ratio_unc)

    def chunk_line(self, index: int) -> str:
        """The running line printed after chunk `index` (0-based)."""
        t = self.tokens
        lp, _, _, ratio = self._ppl_figures(t)
        ppl = float(np.exp(lp[0]))
        kl = mean_and_uncertainty(t.kld)
        mse = mean_and_uncertainty(t.p_diff ** 2)
        rms = float(np.sqrt(mse[0]))
        rms_unc = 0.5 / rms * mse[1] if rms > 0 else 0.0
        top = float(t.same_top.mean())
        top_unc = float(np.sqrt(top * (1 - top) / (t.same_top.size - 1))) \
            if t.same_top.size > 1 else 0.0
        return (f"{index + 1:4d}    {ppl:9.4f} ± {ppl * lp[1]:9.4f}    {ratio[0]:10.5f} ± "
                f"{ratio[1]:10.5f}    {kl[0]:10.5f} ± {kl[1]:10.5f}    {100 * rms:6.3f} ± "
                f"{100 * rms_unc:6.3f} %    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")

    def summary(self) -> KldSummary:
        t = self.tokens
        if t.nll.size < 2:
            raise ValueError(f"KL-divergence statistics need at least 2 tokens, got "
                             f"{t.nll.size}")
        lp, lb, cov, ln_ratio = self._ppl_figures(t)
        ppl, ppl_b = float(np.exp(lp[0])), float(np.exp(lb[0]))
        denom = lp[1] * lb[1]
        ratio = float(np.exp(ln_ratio[0]))
        ppl_cov = ppl * ppl_b * cov
        diff_unc = float(np.sqrt(max((ppl * lp[1]) ** 2 + (ppl_b * lb[1]) ** 2 - 2 * ppl_cov,
                                     0.0)))
        kv, pv = np.sort(t.kld), np.sort(t.p_diff)
        mse = mean_and_uncertainty(t.p_diff ** 2)
        rms = float(np.sqrt(mse[0]))
        top = float(t.same_top.mean())
        return KldSummary(
            count=int(t.nll.size), ppl=(ppl, ppl * lp[1]), ppl_base=(ppl_b, ppl_b * lb[1]),
            cor=cov / denom if denom else float("nan"), ln_ratio=ln_ratio,
            ratio=(ratio, ratio * ln_ratio[1]), diff=(ppl - ppl_b, diff_unc),
            kld=mean_and_uncertainty(t.kld), kld_median=median(kv),
            kld_percentiles={k.strip(): percentile(kv, f) for k, f in KLD_FRACTIONS
                             if f is not None},
            p_diff=mean_and_uncertainty(t.p_diff), p_diff_median=median(pv),
            p_diff_percentiles={k.strip(): percentile(pv, f) for k, f in P_DIFF_FRACTIONS
                                if f is not None},
            rms_p_diff=(rms, 0.5 / rms * mse[1] if rms > 0 else 0.0),
            same_top=(top, float(np.sqrt(top * (1 - top) / (t.same_top.size - 1)))))

    def report_lines(self) -> list[str]:
        """llama.cpp's three closing sections (none below MIN_COUNT_FOR_SUMMARY tokens)."""
        if self.tokens.nll.size < MIN_COUNT_FOR_SUMMARY:
            return []
        s = self.summary()
        lines = ["====== Perplexity statistics ======",
                 f"Mean PPL(Q)                   : {s.ppl[0]:10.6f} ± {s.ppl[1]:10.6f}",
                 f"Mean PPL(base)                : {s.ppl_base[0]:10.6f} ± {s.ppl_base[1]:10.6f}",
                 f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.cor:6.2f}%",
                 f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ratio[0]:10.6f} ± {s.ln_ratio[1]:10.6f}",
                 f"Mean PPL(Q)/PPL(base)         : {s.ratio[0]:10.6f} ± {s.ratio[1]:10.6f}",
                 f"Mean PPL(Q)-PPL(base)         : {s.diff[0]:10.6f} ± {s.diff[1]:10.6f}",
                 "", "====== KL divergence statistics ======",
                 f"Mean    KLD: {s.kld[0]:10.6f} ± {s.kld[1]:10.6f}"]
        for name, f in KLD_FRACTIONS:
            v = s.kld_median if f is None else s.kld_percentiles[name.strip()]
            label = f"{name} KLD:" if name[0].isalpha() else f"{name}   KLD:"
            lines.append(f"{label.replace('Median KLD', 'Median  KLD')} {v:10.6f}")
        lines += ["", "====== Token probability statistics ======",
                  f"Mean    Δp: {100 * s.p_diff[0]:6.3f} ± {100 * s.p_diff[1]:5.3f} %"]
        for name, f in P_DIFF_FRACTIONS:
            v = s.p_diff_median if f is None else s.p_diff_percentiles[name.strip()]
            label = f"{name} Δp:" if name[0].isalpha() else f"{name}   Δp:"
            lines.append(f"{label.replace('Median Δp', 'Median  Δp')} {100 * v:6.3f}%")
        lines += [f"RMS Δp    : {100 * s.rms_p_diff[0]:6.3f} ± {100 * s.rms_p_diff[1]:5.3f} %",
                  f"Same top p: {100 * s.same_top[0]:6.3f} ± {100 * s.same_top[1]:5.3f} %"]
        return lines


CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          "
                "KL Divergence              Δp RMS            Same top p")
