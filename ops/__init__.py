"""ggraph.ops: op constructors (which record nodes and compute nothing) and the op registry.

Importing this package defines every op kind and registers its record: `REGISTRY[OpKind.X]`
holds X's params, reference, in-place flag, family, accepted types, ggml mapping and
conformance cases, all declared in X's own module.
"""
from .registry import REGISTRY, GGMLMap, OpDef, get_op, ops_where
from .views import (view_1d, view_2d, view_3d, view_4d, reshape, reshape_1d, reshape_2d,
                    reshape_3d, reshape_4d, permute, transpose, cont, cpy, PermuteParams)
from .matmul import mul_mat, mul_mat_id
from .attention import (soft_max_ext, soft_max, flash_attn_ext, alibi_slope, alibi_slopes,
                        SoftMaxParams, FlashAttnParams)
from .rope import rope_ext, RopeMode, RopeParams, yarn_corr_dims, rope_cache
from .norm import rms_norm, norm, NormParams
from .rows import get_rows, set_rows
from .elementwise import (add, mul, div, scale, clamp, fill, silu, gelu, sigmoid, swiglu,
                          ScaleParams, ClampParams, FillParams)
from .reduce import (sum_rows, argsort, top_k, concat, repeat, SortOrder, ArgsortParams,
                     TopKParams, ConcatParams)
from .case import Case, CaseBuilder
from ggraph.opkind import OpKind as _OpKind

_missing = [k for k in _OpKind if k not in REGISTRY or REGISTRY[k].cases is None]
assert not _missing, f"ops without a record or without conformance cases: {_missing}"

__all__ = [n for n in dir() if not n.startswith("_")]
