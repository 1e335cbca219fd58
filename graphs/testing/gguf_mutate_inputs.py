"""What graphs/testing/gguf_mutate.py's mutators draw from: hostile chat templates, huge prompt texts
(as JSON-able recipes, so a case's request stays small), and tiny models at odd but valid
sizes (the `shapes` mutator).

Templates are named for the report. Each one is what a file from the internet could hold: one
that renders forever or without end, raises, reads names that do not exist, reaches for
Python's internals through the sandbox, builds huge values through operations the sandbox does
not count, or is not a string at all.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ggraph.graphs.gguf.gguf_reader import ValueType as VT

_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TEMPLATES: list[tuple[str, Any]] = [
    # valid, of other families
    ("chatml", _CHATML),
    ("llama3", "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
               "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
               "{% endif %}"),
    ("gemma", "{{ bos_token }}{% for m in messages %}<start_of_turn>"
              "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
              "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}"),
    ("alternating roles (raises on a system message)",
     "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
     "[INST] {{ m['content'] }} [/INST]{% endfor %}"),
    ("empty", ""),
    ("constant", "Hello"),
    ("only special tokens", "{{ bos_token * 3 }}{{ eos_token }}<|im_start|><|im_end|>"),
    ("whitespace", " \n\t " * 50),
    ("messages as json", "{{ messages | tojson }}{{ tools | tojson }}"),
    ("strftime", "{{ strftime_now('%Y-%m-%d %H:%M:%S %%') }}{{ messages[-1]['content'] }}"),
    # errors
    ("raise_exception", "{{ raise_exception('this template refuses ' ~ messages|length) }}"),
    ("raise with a long message", "{{ raise_exception('x\n' * 20000) }}"),
    ("undefined name", "{{ foo.bar }}"),
    ("undefined message", "{{ messages[99]['content'] }}"),
    ("undefined call", "{{ undefined_function(1) }}"),
    ("type error", "{{ messages + 1 }}"),
    ("division by zero", "{{ 1 // 0 }}"),
    ("bad filter", "{{ messages | nosuchfilter }}"),
    ("syntax error", "{% for %}"),
    ("unclosed", "{{ messages"),
    ("stray endfor", "{% endfor %}"),
    ("deep parentheses", "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}"),
    ("deep blocks", "{% if true %}" * 2000 + "x" + "{% endif %}" * 2000),
    ("deep lists", "{{ " + "[" * 3000 + "]" * 3000 + " }}"),
    ("recursive macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    ("recursive loop", "{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}"),
    # unbounded work
    ("huge output loop", "{% for i in range(100000) %}{{ 'xxxxxxxxxx' * 1000 }}{% endfor %}"),
    ("huge repetition", "{{ 'a' * 1000000000 }}"),
    ("huge power", "{{ 9 ** 9 ** 9 }}"),
    ("big integer squaring", "{% set ns = namespace(x=10 ** 1000) %}{% for i in range(40) %}"
                             "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x % 7 }}"),
    ("string doubling by ~", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                             "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"),
    ("list doubling", "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}"
                      "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}"),
    ("center filter", "{{ 'x' | center(2000000000) }}"),
    ("format width", "{{ '%2000000000d' | format(1) }}"),
    ("str.format width", "{{ '{:>2000000000}'.format(1) }}"),
    ("ljust", "{{ 'x'.ljust(2000000000) }}"),
    ("zfill", "{{ 'x'.zfill(2000000000) }}"),
    ("indent", "{{ ('\n' * 100000) | indent(100000) }}"),
    ("wordwrap", "{{ ('a ' * 500000) | wordwrap(1) }}"),
    ("replace growth", "{{ ('a' * 1000000) | replace('a', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb' * "
                       "10000) }}"),
    ("join growth", "{{ ('x' * 1000000) | join('y' * 1000000) }}"),
    ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}"),
    ("range product", "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}"
                      "{% endfor %}{% endfor %}"),
    ("huge range", "{{ range(10 ** 12) | list | length }}"),
    ("huge list literal", "{{ [" + "1," * 200000 + "] | length }}"),
    ("sum of huge range", "{{ range(100000) | sum }}{{ (range(100000) | list) * 100000 }}"),
    ("int of huge string", "{{ ('9' * 1000000) | int }}"),
    ("float pow", "{{ 10.0 ** 400 }}{{ (2 ** 1024) | float }}"),
    # sandbox escapes
    ("__class__ walk", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    ("cycler globals", "{{ cycler.__init__.__globals__.os.popen('id').read() }}"),
    ("joiner globals", "{{ joiner.__init__.__globals__ }}"),
    ("namespace globals", "{{ namespace.__init__.__globals__ }}"),
    ("lipsum globals", "{{ lipsum.__globals__['os'] }}"),
    ("raise_exception globals", "{{ raise_exception.__globals__ }}"),
    ("strftime globals", "{{ strftime_now.__globals__['datetime'] }}"),
    ("self context", "{{ self._TemplateReference__context }}"),
    ("attr filter", "{{ ''|attr('__class__')|attr('__mro__') }}"),
    ("format string escape", "{{ '{0.__class__.__mro__}'.format('') }}"),
    ("percent format escape", "{{ '%s' | format(''.__class__) }}"),
    ("mutate messages", "{{ messages.append({'role': 'x'}) }}{{ messages.pop() }}"),
    ("mutate dict", "{% set d = {} %}{{ d.update({'a': 1}) }}{{ d.clear() }}"),
    ("mutate message", "{{ messages[0].update({'content': 'x'}) }}"),
    ("getattr on loop", "{% for m in messages %}{{ loop.__class__ }}{% endfor %}"),
    ("config", "{{ config }}{{ request }}{{ g }}"),
    ("import", "{% import 'os' as os %}{{ os }}"),
    ("include", "{% include '/etc/passwd' %}"),
    ("extends", "{% extends '/etc/passwd' %}"),
    ("lone surrogate", "{{ '\\udcff' }}{{ messages[-1]['content'] }}"),
    ("nul bytes", "\x00{{ messages[-1]['content'] }}\x00"),
    ("huge word", "{{ 'a' * 1000000 }}{{ 'b' * 1000000 }}"),
    # not strings
    ("an integer", (5, VT.INT32, None)),
    ("a bool", (True, VT.BOOL, None)),
    ("an array of strings", ([_CHATML], VT.ARRAY, VT.STRING)),
    ("an array of ints", ([1, 2, 3], VT.ARRAY, VT.INT32)),
    ("a float", (1.5, VT.FLOAT32, None)),
]

# prompt texts as recipes: [unit, count] repeats unit count times; [[unit, count], ...] joins
HUGE_TEXTS: list[tuple[str, Any]] = [
    ("5 MB of words", ["word ", 1_000_000]),
    ("a word of 2M characters", ["a", 2_000_000]),
    ("a word of 1M characters, then words", [["b", 1_000_000], ["word ", 1000]]),
    ("1M newlines", ["\n", 1_000_000]),
    ("1M spaces", [" ", 1_000_000]),
    ("500k accented letters", ["\u00e9", 500_000]),
    ("300k emoji", ["\U0001F600", 300_000]),
    ("200k CJK characters", ["\u4e16\u754c", 100_000]),
    ("100k lone surrogates", ["\udcff", 100_000]),
    ("100k control tokens", ["<|im_start|>", 100_000]),
    ("digits", ["0123456789", 200_000]),
    ("mixed punctuation", ["!?.,;:'\"", 200_000]),
    ("nul and controls", ["\x00\x01\x1b[31m", 100_000]),
    ("empty", ["", 1]),
    ("one space", [" ", 1]),
    ("a text just under the context", ["ab ", 10]),
]


def text_of(recipe: Any) -> str:
    """The text of a HUGE_TEXTS recipe."""
    if recipe and isinstance(recipe[0], list):
        return "".join(text_of(r) for r in recipe)
    unit, count = recipe
    return unit * count


# -- tiny models at odd, valid sizes -----------------------------------------------------------

def dense_writer(arch: str) -> Any:
    """A `shapes` writer for a dense architecture of graphs/testing/tiny.py: draws a TinyDense whose
    keys and tensors agree, at sizes such as n_ff 1, one layer, MQA or odd head sizes."""
    def write(path: str, rng: np.random.Generator) -> str:
        from ggraph.graphs.testing.tiny import TinyDense, write_tiny

        def pick(xs: list[Any]) -> Any:
            return xs[int(rng.integers(len(xs)))]

        wt = pick(["f32", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
        quant = wt.startswith("q")
        n_head = pick([1, 2, 4, 8])
        n_head_kv = pick([d for d in (1, 2, 4, 8) if n_head % d == 0])
        keyed = arch != "llama"          # qwen2/3: the head size is attention.key_length
        if quant:   # every matrix row (n_embd, n_head * head size, n_ff) whole blocks of 32
            hd = pick([h for h in (2, 4, 8, 16, 32, 64) if h * n_head % 32 == 0])
            n_embd = pick([32, 64, 96]) if keyed else hd * n_head
            n_ff = pick([32, 64, 96])
        else:
            hd = pick([2, 4, 6, 8, 16, 34])
            n_embd = pick([8, 12, 16, 40, 64]) if keyed else hd * n_head
            n_ff = pick([1, 3, 7, 24, 96])
        cfg = TinyDense(arch=arch, n_layer=pick([1, 2, 3]), n_embd=n_embd, n_head=n_head,
                        n_head_kv=n_head_kv, n_ff=n_ff, head_dim=hd if keyed else 0,
                        rope_freq_base=pick([10000.0, 1.0, 1e6, 0.5]),
                        rms_eps=pick([1e-5, 1e-6, 0.0, 1.0]), weight_type=wt,
                        tied_output=pick([True, False]), seed=int(rng.integers(1000)))
        if arch == "qwen2" and pick([True, False]):
            cfg = replace(cfg, output_bias=True)
        write_tiny(path, cfg)
        return (f"{arch} n_layer={cfg.n_layer} n_embd={cfg.n_embd} heads={cfg.n_head}/"
                f"{cfg.n_head_kv} head_dim={cfg.hd} n_ff={cfg.n_ff} {wt} eps={cfg.rms_eps} "
                f"base={cfg.rope_freq_base} tied={cfg.tied_output}")
    return write


def gemma3_writer(path: str, rng: np.random.Generator) -> str:
    """A `shapes` writer for gemma3: windows of 0, 1 or beyond the context, every layer
    sliding or none, a soft cap, odd head sizes."""
    from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf

    def pick(xs: list[Any]) -> Any:
        return xs[int(rng.integers(len(xs)))]

    n_layer = pick([1, 2, 6, 7])
    n_head = pick([1, 2, 4])
    kw: dict[str, Any] = dict(
        n_layer=n_layer, n_head=n_head, n_head_kv=pick([d for d in (1, 2, 4) if n_head % d == 0]),
        head_dim=pick([2, 8, 32, 48]), n_ff=pick([1, 7, 96]), n_swa=pick([0, 1, 2, 3, 16, 4096]),
        swa_pattern=pick([None, 0, 1, 2, 6, [True] * n_layer, [False] * n_layer]),
        final_logit_softcapping=pick([None, 30.0, 0.001]),
        rope_freq_base_swa=pick([None, 1.0, 10000.0]), seed=int(rng.integers(1000)))
    write_tiny_gguf(path, **kw)
    return "gemma3 " + " ".join(f"{k}={v if not isinstance(v, list) else 'list'}"
                                for k, v in kw.items())


def deepseek2_writer(path: str, rng: np.random.Generator) -> str:
    """A `shapes` writer for deepseek2: layouts (split, legacy, both), Lite, one expert, dense
    or MoE layers, without YaRN."""
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2

    def pick(xs: list[Any]) -> Any:
        return xs[int(rng.integers(len(xs)))]

    n_layer = pick([1, 2, 3])
    n_expert = pick([1, 2, 4, 8])
    groups = pick([0] + [g for g in (2, 4) if n_expert % g == 0 and g > 1])
    cfg = TinyDeepSeek2(
        n_layer=n_layer, n_layer_dense_lead=pick(list(range(n_layer + 1))),
        n_head=pick([1, 2, 8]), q_lora_rank=pick([0, 16, 64]), kv_lora_rank=pick([16, 64]),
        n_nope=pick([2, 32]), n_rot=pick([2, 32]), head_v=pick([8, 32]), n_expert=n_expert,
        n_expert_used=pick([u for u in (1, 2) if u <= n_expert]), n_expert_groups=groups,
        n_group_used=1 if groups else 0, n_expert_shared=pick([0, 1]), gating=pick([1, 2]),
        expert_weights_norm=pick([True, False]), exp_probs_b=pick([True, False]),
        yarn_factor=pick([0.0, 4.0]), kv_b=pick(["split", "legacy", "both"]),
        weight_type=pick(["f32", "f16", "q8_0"]), seed=int(rng.integers(1000)))
    write_tiny_deepseek2(path, cfg)
    return f"deepseek2 {cfg}"
