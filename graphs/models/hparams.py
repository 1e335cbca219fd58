"""Hyperparameters read from GGUF keys through one table: each dataclass field names its key
(gguf-py's `gguf.constants.Keys`, `{arch}` the architecture prefix), whether it is required,
and its default."""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from gguf.constants import Keys

from ggraph.graphs.gguf.gguf_file import GGUFError

H = TypeVar("H")


def key(name: str, default: Any = MISSING, *, lo: float | None = None) -> Any:
    """A dataclass field read from GGUF key `name` (required when there is no default); `lo`
    is the smallest value a file may give (the default may lie outside: 0 meaning "derive")."""
    return field(default=default, metadata={"gguf": name, "lo": lo})


# a field's annotation -> the Python types the GGUF reader gives for the GGUF types it allows
_ACCEPTS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float,), "str": (str,),
                                         "bool": (bool,)}


def _check_value(v: Any, ftype: str, lo: float | None, full: str, path: str) -> Any:
    """v (a scalar, or a per-layer array whose values must agree) checked against the field's
    type and bound; the GGUF value as the field holds it."""
    where = f"{path or 'model'}: key {full!r}"
    if isinstance(v, list):
        if ftype not in ("int", "float") or not v:
            raise GGUFError(f"{where} is an array of {len(v)} values; expected one {ftype}")
        for x in v:
            _check_value(x, ftype, lo, full, path)
        if any(x != v[0] for x in v):
            raise GGUFError(f"{where} differs between layers ({v[:8]}...); ggraph builds "
                            f"layers of one shape")
        return v[0]
    accepts = _ACCEPTS.get(ftype, (object,))
    if not isinstance(v, accepts) or (ftype != "bool" and isinstance(v, bool)):
        raise GGUFError(f"{where} holds a {type(v).__name__} ({str(v)[:40]!r}); expected "
                        f"{'a' if ftype != 'int' else 'an'} {ftype}")
    if ftype == "float" and not math.isfinite(v):
        raise GGUFError(f"{where} is {v}; expected a finite number")
    if lo is not None and v < lo:
        raise GGUFError(f"{where} is {v}; it must be at least {lo}")
    return v


def read_hparams(cls: type[H], metadata: dict[str, Any], arch: str, path: str = "",
                 **overrides: Any) -> H:
    """Fill `cls` from metadata; a missing required key, a value of the wrong GGUF type or
    out of range is an error naming key and file."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        k = f.metadata.get("gguf")
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        if k is None:
            continue
        full = k.format(arch=arch)
        v = metadata.get(full)
        if v is None:
            if f.default is MISSING:
                raise GGUFError(f"{path or 'model'}: required key {full!r} is missing")
            continue
        values[f.name] = _check_value(v, str(f.type), f.metadata.get("lo"), full, path)
    try:
        return cls(**values)
    except GGUFError as e:  # the dataclass's own consistency checks: name the file
        raise GGUFError(f"{path or 'model'}: {e}") from None


def settle_heads(hp: Any) -> list[str]:
    """Fill a frozen hparams dataclass's derived head fields as llama.cpp does and return what
    is inconsistent (an empty list when all is well): n_head_kv defaults to n_head,
    key_length to n_embd / n_head, value_length to key_length (the files ggraph builds have one
    head size), n_rot (rope.dimension_count) to the head size;
    the heads must group evenly, K and V heads must be one size, and the rotated part must be
    even and fit the head."""
    def put(name: str, value: Any) -> None:
        object.__setattr__(hp, name, value)

    problems: list[str] = []
    if hp.n_head_kv == 0:
        put("n_head_kv", hp.n_head)
    if hp.key_length == 0:
        if hp.n_embd % hp.n_head:
            problems.append(f"embedding_length {hp.n_embd} is not a multiple of head_count "
                            f"{hp.n_head} and attention.key_length is absent")
        put("key_length", hp.n_embd // hp.n_head)
    if hp.value_length == 0:
        put("value_length", hp.key_length)
    if hp.n_rot == 0:
        put("n_rot", hp.key_length)
    if hp.n_head % hp.n_head_kv:
        problems.append(f"head_count {hp.n_head} is not a multiple of head_count_kv "
                        f"{hp.n_head_kv}")
    if hp.value_length != hp.key_length:
        problems.append(f"attention.value_length {hp.value_length} differs from "
                        f"attention.key_length {hp.key_length}")
    if hp.n_rot % 2 or hp.n_rot > hp.key_length:
        problems.append(f"rope.dimension_count {hp.n_rot} must be even and at most the head "
                        f"size {hp.key_length}")
    return problems


@dataclass(frozen=True)
class LlamaHParams:
    n_layer: int = key(Keys.LLM.BLOCK_COUNT, lo=1)
    n_embd: int = key(Keys.LLM.EMBEDDING_LENGTH, lo=1)
    n_ctx_train: int = key(Keys.LLM.CONTEXT_LENGTH, lo=1)
    n_ff: int = key(Keys.LLM.FEED_FORWARD_LENGTH, lo=1)
    n_head: int = key(Keys.Attention.HEAD_COUNT, lo=1)
    n_head_kv: int = key(Keys.Attention.HEAD_COUNT_KV, 0, lo=1)
    n_rot: int = key(Keys.Rope.DIMENSION_COUNT, 0, lo=2)
    rope_freq_base: float = key(Keys.Rope.FREQ_BASE, 10000.0, lo=1e-30)
    rope_scaling_factor: float = key(Keys.Rope.SCALING_FACTOR, 0.0, lo=0)
    rms_eps: float = key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5, lo=0)
    n_vocab: int = key(Keys.LLM.VOCAB_SIZE, 0, lo=1)

    def __post_init__(self) -> None:
        if self.n_head_kv == 0:
            object.__setattr__(self, "n_head_kv", self.n_head)
        if self.n_rot == 0:
            object.__setattr__(self, "n_rot", self.n_embd // self.n_head)
        if self.n_head % self.n_head_kv:
            raise GGUFError(f"head_count {self.n_head} is not a multiple of head_count_kv "
                            f"{self.n_head_kv}")
        if self.n_embd % self.n_head:
            raise GGUFError(f"embedding_length {self.n_embd} is not a multiple of head_count "
                            f"{self.n_head}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise GGUFError(f"rope.dimension_count {self.n_rot} must be even and at most the "
                            f"head size {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_gqa(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def freq_scale(self) -> float:
        return 1.0 / self.rope_scaling_factor if self.rope_scaling_factor else 1.0



@dataclass(frozen=True)
class DeepSeek2HParams:
    """DeepSeek-V2/V3/R1 (`deepseek2`): MLA attention, dense leading layers, then MoE.

    Two GGUF layouts exist. MLA files (today's converter) write the compressed widths under
    `key_length` (kv_lora + n_rot) and `value_length` (kv_lora) with `head_count_kv` 1, and the
    per-head widths under `key_length_mla` / `value_length_mla`, with attn_k_b/attn_v_b tensors;
    legacy files write the per-head widths under `key_length` / `value_length` and hold
    attn_kv_b. `head_k` / `head_v` are the per-head widths in both cases.
    `rope_yarn_log_mul` is the GGUF value, which the converter stores as 0.1 * mscale_all_dim
    (DeepSeek-V3: 0.1), so `mscale = 1 + rope_yarn_log_mul * ln(factor)`.
    """
    n_layer: int = key(Keys.LLM.BLOCK_COUNT, lo=1)
    n_embd: int = key(Keys.LLM.EMBEDDING_LENGTH, lo=1)
    n_ctx_train: int = key(Keys.LLM.CONTEXT_LENGTH, lo=1)
    n_head: int = key(Keys.Attention.HEAD_COUNT, lo=1)
    kv_lora_rank: int = key(Keys.Attention.KV_LORA_RANK, lo=1)
    n_rot: int = key(Keys.Rope.DIMENSION_COUNT, lo=2)
    n_ff: int = key(Keys.LLM.FEED_FORWARD_LENGTH, 0, lo=1)  # dense leading layers
    n_head_kv: int = key(Keys.Attention.HEAD_COUNT_KV, 0, lo=1)
    key_length: int = key(Keys.Attention.KEY_LENGTH, 0, lo=1)
    value_length: int = key(Keys.Attention.VALUE_LENGTH, 0, lo=1)
    key_length_mla: int = key(Keys.Attention.KEY_LENGTH_MLA, 0, lo=1)
    value_length_mla: int = key(Keys.Attention.VALUE_LENGTH_MLA, 0, lo=1)
    # absent: Lite (one attn_q matrix)
    q_lora_rank: int = key(Keys.Attention.Q_LORA_RANK, 0, lo=1)
    rms_eps: float = key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6, lo=0)
    rope_freq_base: float = key(Keys.Rope.FREQ_BASE, 10000.0, lo=1e-30)
    rope_scaling_type: str = key(Keys.Rope.SCALING_TYPE, "linear")  # llama.cpp's default
    rope_scaling_factor: float = key(Keys.Rope.SCALING_FACTOR, 0.0, lo=0)
    rope_scaling_orig_ctx: int = key(Keys.Rope.SCALING_ORIG_CTX_LEN, 0, lo=1)
    rope_yarn_log_mul: float = key(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0, lo=0)
    rope_attn_factor: float = key(Keys.Rope.SCALING_ATTN_FACTOR, 1.0, lo=0)
    yarn_beta_fast: float = key(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0)
    yarn_beta_slow: float = key(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)
    n_layer_dense_lead: int = key(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0, lo=0)
    n_expert: int = key(Keys.LLM.EXPERT_COUNT, 0, lo=1)
    n_expert_used: int = key(Keys.LLM.EXPERT_USED_COUNT, 0, lo=1)
    n_expert_shared: int = key(Keys.LLM.EXPERT_SHARED_COUNT, 0, lo=0)
    n_ff_exp: int = key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, 0, lo=1)
    expert_weights_scale: float = key(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0, lo=0)
    expert_weights_norm: bool = key(Keys.LLM.EXPERT_WEIGHTS_NORM, False)
    expert_gating_func: int = key(Keys.LLM.EXPERT_GATING_FUNC, 0)  # 1 softmax, 2 sigmoid
    n_expert_groups: int = key(Keys.LLM.EXPERT_GROUP_COUNT, 0, lo=0)
    n_group_used: int = key(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0, lo=0)
    n_vocab: int = key(Keys.LLM.VOCAB_SIZE, 0, lo=1)

    def __post_init__(self) -> None:
        if self.key_length == 0:                 # llama.cpp: n_embd / n_head when absent
            object.__setattr__(self, "key_length", self.n_embd // self.n_head)
        if self.value_length == 0:
            object.__setattr__(self, "value_length", self.n_embd // self.n_head)
        if self.expert_gating_func == 0:         # V2/V2.5 files predate the key: softmax
            object.__setattr__(self, "expert_gating_func", 1)
        if bool(self.key_length_mla) != bool(self.value_length_mla):
            raise GGUFError("attention.key_length_mla and attention.value_length_mla must be "
                            "given together")
        problems = []
        if self.n_rot <= 0 or self.n_rot % 2:
            problems.append(f"rope.dimension_count={self.n_rot} must be positive and even")
        if self.head_k - self.n_rot < 1:
            problems.append(f"the per-head key width {self.head_k} leaves no non-rotary part "
                            f"next to rope.dimension_count={self.n_rot}")
        if self.is_mla and self.key_length != self.kv_lora_rank + self.n_rot:
            problems.append(f"attention.key_length={self.key_length} should be kv_lora_rank + "
                            f"rope.dimension_count = {self.kv_lora_rank + self.n_rot} in an "
                            f"MLA file")
        if self.n_layer_dense_lead < self.n_layer:
            if self.n_expert <= 0 or not 0 < self.n_expert_used <= self.n_expert:
                problems.append(f"expert_count={self.n_expert} and expert_used_count="
                                f"{self.n_expert_used} must satisfy 0 < used <= count")
            if self.n_ff_exp <= 0:
                problems.append("expert_feed_forward_length is missing")
            if self.expert_gating_func not in (1, 2):
                problems.append(f"expert_gating_func={self.expert_gating_func} is not 1 "
                                f"(softmax) or 2 (sigmoid)")
            if self.n_expert_groups > 1 and (self.n_expert % self.n_expert_groups or
                                            not 0 < self.n_group_used < self.n_expert_groups):
                problems.append(f"expert_group_count={self.n_expert_groups} must divide "
                                f"expert_count={self.n_expert} and exceed "
                                f"expert_group_used_count={self.n_group_used} > 0")
            elif self.n_expert_groups > 1 and self.n_expert // self.n_expert_groups < 2:
                # a group's score is the sum of its top 2 experts (llama.cpp asserts there)
                problems.append(f"expert_group_count={self.n_expert_groups} leaves "
                                f"{self.n_expert // self.n_expert_groups} expert per group of "
                                f"expert_count={self.n_expert}; a group is scored by its top 2")
        if self.n_layer_dense_lead > 0 and self.n_ff <= 0:
            problems.append("feed_forward_length is missing for the dense leading layers")
        if self.rope_scaling_type not in ("none", "linear", "yarn"):
            problems.append(f"rope.scaling.type={self.rope_scaling_type!r} is not none, linear "
                            f"or yarn")
        if problems:
            raise GGUFError("deepseek2 hyperparameters: " + "; ".join(problems))

    # -- attention geometry -------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        """The file was converted for MLA (k_b/v_b tensors, compressed key widths)."""
        return self.key_length_mla != 0

    @property
    def head_k(self) -> int:
        """Per-head query/key width: nope + rope (192 for V3)."""
        return self.key_length_mla if self.is_mla else self.key_length

    @property
    def head_v(self) -> int:
        """Per-head value width after decompression (128 for V3)."""
        return self.value_length_mla if self.is_mla else self.value_length

    @property
    def n_nope(self) -> int:
        return self.head_k - self.n_rot

    @property
    def mla_row(self) -> int:
        """Values cached per token and layer: the latent and the shared roped key (576)."""
        return self.kv_lora_rank + self.n_rot

    # -- rope and the attention scale, as llama.cpp derives them --------------------------------
    @property
    def freq_scale(self) -> float:
        if self.rope_scaling_type == "none" or not self.rope_scaling_factor:
            return 1.0
        return 1.0 / self.rope_scaling_factor

    @property
    def ext_factor(self) -> float:
        return 1.0 if self.rope_scaling_type == "yarn" else 0.0

    @property
    def yarn_orig_ctx(self) -> int:
        return self.rope_scaling_orig_ctx or self.n_ctx_train

    @property
    def rope_attn_factor_arg(self) -> float:
        """The attn_factor passed to rope_ext, as llama_context sets it. With YaRN, ggml scales
        cos/sin by g = 1 + 0.1 ln(1/freq_scale); llama.cpp divides that back out, and keeps
        get_mscale(factor) = g only for files without a log multiplier."""
        if self.ext_factor == 0.0:
            return self.rope_attn_factor
        f = 1.0 / self.freq_scale
        g = 1.0 + 0.1 * math.log(f)
        base = 1.0 if self.rope_yarn_log_mul != 0.0 or f <= 1.0 else g
        return base / g * self.rope_attn_factor

    @property
    def mscale(self) -> float:
        """The deepseek2 builder's mscale: the original attn_factor (the rope argument times g)
        times 1 + rope_yarn_log_mul * ln(factor)."""
        ln_f = math.log(1.0 / self.freq_scale)
        attn_factor_org = self.rope_attn_factor_arg * (1.0 + 0.1 * ln_f)
        return attn_factor_org * (1.0 + self.rope_yarn_log_mul * ln_f)

    @property
    def kq_scale(self) -> float:
        """mscale^2 / sqrt(head_k): 0.13524 for DeepSeek-V3 (facts page section 7)."""
        return self.mscale * self.mscale / math.sqrt(self.head_k)
