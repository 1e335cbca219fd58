"""Feed-forward blocks of DeepSeek2: the dense SwiGLU FFN and the mixture of experts.

`build_moe_ffn` follows llama.cpp's build_moe_ffn for DeepSeek2/V3: router logits ->
softmax or sigmoid probabilities; the selection adds `exp_probs_b` but the weights do not;
with expert groups, only the `n_group_used` groups with the best top-2 sums stay selectable
(the rest are masked to -inf); top-k experts; weights taken from the unbiased probabilities,
normalized to sum 1 (clamped away from 0) and multiplied by `expert_weights_scale`; experts run
through `mul_mat_id`; their outputs are weighted and summed. The shared expert is a dense FFN
added by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor

from ggraph.graphs.models.lora import LoraAdapter, lora_mm, lora_mm_id

GATING_SOFTMAX = 1
GATING_SIGMOID = 2
F16_MIN_NORMAL = 6.103515625e-5  # llama.cpp clamps the weight sum here (smallest normal f16)


@dataclass(frozen=True)
class MoEConfig:
    n_expert: int
    n_expert_used: int
    gating: int = GATING_SOFTMAX
    norm_weights: bool = False
    weights_scale: float = 0.0      # 0 or 1: no scaling
    n_groups: int = 0               # > 1: group-limited routing
    n_group_used: int = 0


def build_ffn(x: Tensor, up: Tensor, gate: Tensor, down: Tensor, il: int,
              suffix: str = "", loras: Sequence[LoraAdapter] = ()) -> Tensor:
    """down(silu(gate x) * up x): llama's FFN, DeepSeek2's dense layers and shared expert.
    Nodes are named llama.cpp's way, `ffn_up{suffix}-{il}` ...; each product takes the
    adapters that have its weight (graphs/models/lora.py)."""
    u = lora_mm(up, x, loras, name=f"ffn_up{suffix}-{il}")
    g = lora_mm(gate, x, loras, name=f"ffn_gate{suffix}-{il}")
    return lora_mm(down, O.swiglu(g, u, name=f"ffn_swiglu{suffix}-{il}"), loras,
                   name=f"ffn_out{suffix}-{il}")


def build_moe_ffn(x: Tensor, gate_inp: Tensor, up_exps: Tensor, gate_exps: Tensor,
                  down_exps: Tensor, exp_probs_b: Tensor | None, cfg: MoEConfig, il: int,
                  graph: Graph | None = None, loras: Sequence[LoraAdapter] = ()) -> Tensor:
    """The routed experts' output [n_embd, T] for x [n_embd, T] (without the shared expert).

    graph: when given, the routing weights are expanded first (as llama.cpp does before the
    experts), which keeps the small routing tensors out of the experts' peak. loras: adapters of the
    router and the expert weights (graphs/models/lora.py)."""
    n_embd, n_tokens = x.ne[0], x.ne[1]
    E, k = cfg.n_expert, cfg.n_expert_used
    logits = lora_mm(gate_inp, x, loras, name=f"ffn_moe_logits-{il}")          # [E, T]
    if cfg.gating == GATING_SIGMOID:
        probs = O.sigmoid(logits, name=f"ffn_moe_probs-{il}")
    elif cfg.gating == GATING_SOFTMAX:
        probs = O.soft_max(logits, name=f"ffn_moe_probs-{il}")
    else:
        raise ValueError(f"expert gating function {cfg.gating} is not 1 (softmax) or 2 "
                         f"(sigmoid)")
    # the bias steers the selection only; the weights come from the unbiased probabilities
    select = probs if exp_probs_b is None else O.add(probs, exp_probs_b,
                                                     name=f"ffn_moe_probs_biased-{il}")
    if cfg.n_groups > 1:
        select = _limit_groups(select, cfg, il)
    selected = O.top_k(select, k, name=f"ffn_moe_topk-{il}")              # [k, T] I32
    weights = O.get_rows(O.reshape(probs, 1, E, n_tokens), selected,
                         name=f"ffn_moe_weights-{il}")                     # [1, k, T]
    if cfg.norm_weights:
        w2 = O.reshape(weights, k, n_tokens)
        total = O.clamp(O.sum_rows(w2, name=f"ffn_moe_weights_sum-{il}"), F16_MIN_NORMAL,
                        float("inf"), name=f"ffn_moe_weights_sum_clamped-{il}")
        weights = O.reshape(O.div(w2, total, name=f"ffn_moe_weights_norm-{il}"), 1, k,
                            n_tokens)
    if cfg.weights_scale not in (0.0, 1.0):
        weights = O.scale(weights, cfg.weights_scale, name=f"ffn_moe_weights_scaled-{il}")
    if graph is not None:
        graph.build_forward_expand(weights)

    cur = O.reshape(x, n_embd, 1, n_tokens)
    up = lora_mm_id(up_exps, cur, selected, loras, name=f"ffn_moe_up-{il}")   # [ff, k, T]
    gate = lora_mm_id(gate_exps, cur, selected, loras, name=f"ffn_moe_gate-{il}")
    act = O.swiglu(gate, up, name=f"ffn_moe_swiglu-{il}")
    experts = lora_mm_id(down_exps, act, selected, loras,
                         name=f"ffn_moe_down-{il}")                        # [n_embd, k, T]
    experts = O.mul(experts, weights, name=f"ffn_moe_weighted-{il}")
    # sum the k expert outputs: views of each slot added in order, as llama.cpp does
    out = O.view_2d(experts, n_embd, n_tokens, experts.nb[2], 0, name=f"ffn_moe_e0-{il}")
    if k == 1:
        return O.cont(out, name=f"ffn_moe_out-{il}")
    for i in range(1, k):
        e = O.view_2d(experts, n_embd, n_tokens, experts.nb[2], i * experts.nb[1],
                      name=f"ffn_moe_e{i}-{il}")
        out = O.add(out, e, name=f"ffn_moe_out-{il}" if i == k - 1 else f"ffn_moe_sum{i}-{il}")
    return out


def _limit_groups(select: Tensor, cfg: MoEConfig, il: int) -> Tensor:
    """Mask to -inf every expert outside the n_group_used groups whose two best scores sum
    highest (DeepSeek-V3's group-limited routing)."""
    E, G, n_tokens = cfg.n_expert, cfg.n_groups, select.ne[1]
    per = E // G
    groups = O.reshape(select, per, G, n_tokens)                            # [per, G, T]
    top2 = O.top_k(groups, 2, name=f"ffn_moe_group_top2-{il}")               # [2, G, T]
    best = O.get_rows(O.reshape(groups, 1, per, G, n_tokens), top2)          # [1, 2, G, T]
    score = O.sum_rows(O.reshape(best, 2, G, n_tokens), name=f"ffn_moe_group_score-{il}")
    keep = O.top_k(O.reshape(score, G, n_tokens), cfg.n_group_used,
                   name=f"ffn_moe_group_topk-{il}")                          # [g_used, T]
    kept = O.get_rows(groups, keep)                                          # [per, g_used, T]
    masked = O.set_rows(O.fill(groups, float("-inf"), name=f"ffn_moe_group_mask-{il}"), kept,
                        keep, name=f"ffn_moe_probs_masked-{il}")
    return O.reshape(masked, E, n_tokens)
