"""`ggraph run --dump-tensors REGEX` (tools/common/tensor_dump.py): llama-eval-callback's
dump of each matching node, as it is computed, for the prompt's graph and each generated
token's; its lines in llama.cpp's format, its values the model's own."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

from ggraph import Context, ops
from ggraph.cli import main
from ggraph.tools.common.tensor_dump import TensorDump, dump_lines, header, value_lines

PROMPT = "The capital of France is"
HEADER = re.compile(r"^ggml_debug: +(\S+) = \((\w+)\) +(\w+)\((.*)\) = \{([\d, ]+)\}$")


def test_run_dumps_the_nodes_it_is_asked_for(capsys):
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    argv = ["run", "-m", "default", "-p", PROMPT, "-n", "2", "-c", "256", "--temp", "0",
            "-fa", "off", "--dump-tensors", "^attn_norm-0$|^result_output$"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("ggml_debug:")]
    # three graphs ran (the prompt's, then one per generated token: generate evaluates each
    # token it yields), each node once, in order
    names = [HEADER.match(lines[i]).group(1) for i in heads]
    assert names == ["attn_norm-0", "result_output"] * 3
    eng = Engine(resolve_model("default"), EngineConfig(n_ctx=256))
    prompt = eng.tokenizer.encode(PROMPT)
    n = len(prompt)
    assert lines[heads[0]] == ("ggml_debug:              attn_norm-0 = (f32)        MUL("
                               f"norm-0{{576, {n}, 1, 1}}, blk.0.attn_norm.weight{{576, 1, 1, 1}}"
                               f"}}) = {{576, {n}, 1, 1}}")
    assert lines[heads[1]] == ("ggml_debug:            result_output = (f32)    MUL_MAT("
                               "token_embd.weight{576, 49152, 1, 1}, result_norm{576, 1, 1, 1}"
                               "}) = {49152, 1, 1, 1}")
    # the prompt's logits, as an Engine computes them: 3 leading and 3 trailing, and the sum
    logits = eng.eval(prompt)
    row = lines[heads[1] + 3]
    shown = [float(v) for v in re.findall(r"-?\d+\.\d{4}", row)]
    np.testing.assert_allclose(shown, np.r_[logits[:3], logits[-3:]], atol=5e-5)
    assert "   ..., " in row
    total = float(lines[heads[1] + 6].split("sum = ")[1])
    assert total == pytest.approx(float(np.sum(logits, dtype=np.float64)), rel=1e-6)
    # the text is still there: the prompt first, a line of its own before the first dump
    assert lines[0] == PROMPT and out.startswith(PROMPT + "\nggml_debug:")


def test_value_lines_are_llama_cpps():
    v = np.arange(7, dtype=np.float32).reshape(1, 1, 1, 7)
    assert value_lines(v) == [
        "    [", "        [",
        "            [      0.0000,       1.0000,       2.0000,    ...,       4.0000, "
        "      5.0000,       6.0000  ],",
        "        ],", "    ]", "    sum = 21.000000"]
    m = -np.arange(16, dtype=np.float32).reshape(1, 1, 8, 2)
    lines = value_lines(m)
    assert lines[2:9] == ["            [     -0.0000,      -1.0000  ],",
                          "            [     -2.0000,      -3.0000  ],",
                          "            [     -4.0000,      -5.0000  ],",
                          "            ..., ",
                          "            [    -10.0000,     -11.0000  ],",
                          "            [    -12.0000,     -13.0000  ],",
                          "            [    -14.0000,     -15.0000  ],"]
    assert lines[-1] == "    sum = -120.000000"


def test_a_quantized_node_shows_its_header_only_and_a_new_run_starts_a_line():
    ctx = Context()
    x = ctx.new_tensor("f32", (32, 2), name="x")
    q = ops.cpy(x, ctx.new_tensor("q8_0", (32, 2), name="dst")).set_name("x (q8_0)")
    assert dump_lines(q, np.zeros((1, 1, 2, 32), np.float32)) == [header(q)]
    assert header(q).endswith("CPY(x{32, 2, 1, 1}, dst{32, 2, 1, 1}}) = {32, 2, 1, 1}")
    out = io.StringIO()
    dump = TensorDump.of("^x$", out)
    obs = dump.observer
    assert obs.ask(x) and not obs.ask(q)
    obs.receive(x, np.ones((1, 1, 2, 32), np.float32))
    obs.receive(x, np.ones((1, 1, 2, 32), np.float32))
    text = out.getvalue()
    assert text.startswith("\nggml_debug:") and text.count("\nggml_debug:") == 2
    assert text.count("sum = 64.000000") == 2


@pytest.mark.parametrize("argv,msg", [
    (["--dump-tensors", "("], "is not a regular expression"),
    (["--dump-tensors", "kq", "-np", "2"], "--dump-tensors watches one prompt's generation"),
])
def test_bad_dump_flags_are_one_line_errors(capsys, argv, msg):
    assert main(["run", "-p", "x", *argv, "-n", "1", "-c", "64"]) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
