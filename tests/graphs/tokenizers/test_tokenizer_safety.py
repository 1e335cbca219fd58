"""A GGUF's tokenizer keys and chat template are hostile input: a template runs in jinja2's
sandbox and executes nothing, and every malformed key is a one-line GGUFError naming the file
and the key. Fast: metadata dicts built by hand or read from the real file's header only."""
from __future__ import annotations

import jinja2
import numpy as np
import pytest

from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.tokenizers.tokenizer import Tokenizer

from tokenizer_cases import K, PATH, TEMPLATE, error, small


@pytest.fixture(scope="module")
def real() -> dict:
    from ggraph.graphs.gguf.fetch import default_model

    return load_gguf(default_model(), with_data=False).metadata


def test_small_vocabulary_works():
    tok = Tokenizer(small(), PATH)
    assert tok.encode("ab") == [5] and tok.decode([5, 3]) == "aba"
    assert tok.encode("<|im_start|>a") == [1, 3]  # CONTROL tokens stay whole
    assert (tok.bos, tok.eos, tok.add_bos, tok.n_vocab) == (1, 2, False, 7)
    assert tok.encode("a", add_bos=True) == [1, 3]


# -- chat template -------------------------------------------------------------------------------

ATTACKS = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARK').read() }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARK') }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c('touch MARK', shell=True) }}{% endif %}{% endfor %}",
    "{{ lipsum.__globals__['os'].popen('touch MARK').read() }}",
    "{{ namespace.__init__.__globals__.os.popen('touch MARK').read() }}",
    "{{ joiner.__init__.__globals__.os.popen('touch MARK').read() }}",
    "{{ (cycler|attr('__init__')|attr('__globals__'))['os'].popen('touch MARK').read() }}",
    "{{ ('{0.__init__.__globals__}'|attr('format'))(cycler) }}",  # CVE-2025-27516's shape
    "{% set f = '{0.__init__.__globals__}'.format %}{{ f(cycler) }}",  # CVE-2024-56326's shape
    "{{ raise_exception.__globals__['os'].popen('touch MARK').read() }}",
    "{{ strftime_now.__globals__['os'].popen('touch MARK').read() }}",
    "{{ messages[0].__class__.__base__.__subclasses__() }}",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_template_cannot_run_code(attack, tmp_path):
    mark = tmp_path / "PWNED"
    msg = error(small(chat_template=attack.replace("MARK", str(mark))), chat=True)
    assert TEMPLATE in msg
    assert not mark.exists()


def test_the_attack_is_real_without_the_sandbox(tmp_path):
    # the first payload under a plain jinja2.Template (what ggraph did before) does run the
    # command, so the test above would see it
    mark = tmp_path / "PWNED"
    jinja2.Template(ATTACKS[0].replace("MARK", str(mark))).render()
    assert mark.exists()


@pytest.mark.parametrize("t, words", [
    ("{{ 'x' * 10**11 }}", "a repetition of 1 x 100000000000"),
    ("{{ 2 ** 100000000 }}", "exponent 100000000"),
    ("{{ ('x' * 1000000) + ('y' * 1000000) }}", "a concatenation of 2000000"),
])
def test_template_cannot_build_huge_values(t, words):
    assert words in error(small(chat_template=t), chat=True)


def test_template_that_loops_for_ever_is_stopped(monkeypatch):
    import ggraph.graphs.tokenizers.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "_RENDER_SECONDS", 0.5)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert "still rendering after" in error(small(chat_template=loops), chat=True)


def test_template_may_not_modify_its_arguments():
    msg = error(small(chat_template="{{ messages.append(1) }}"), chat=True)
    assert "SecurityError" in msg


def test_raise_exception_gives_the_templates_message():
    t = ("{% if messages[0]['role'] == 'system' %}"
         "{{ raise_exception('System role not\nsupported') }}{% endif %}")
    msg = error(small(chat_template=t), chat=True)
    assert "System role not supported" in msg and "raised an error" in msg


def test_strftime_now():
    import datetime

    tok = Tokenizer(small(chat_template="{{ strftime_now('%Y') }}"), PATH)
    assert tok.chat("hi") in {str(datetime.datetime.now().year),
                              str(datetime.datetime.now().year - 1)}  # new year's eve
    msg = error(small(chat_template="{{ strftime_now(5) }}"), chat=True)
    assert "TypeError" in msg


def test_syntax_error_fails_at_load_with_the_line():
    msg = error(small(chat_template="{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"))
    assert TEMPLATE in msg and "does not parse" in msg and "line 2" in msg
    msg = error(small(chat_template="{{ messages|no_such_filter }}"))
    assert "no_such_filter" in msg


@pytest.mark.parametrize("t", ["{{ nothing.at.all }}", "{{ messages[5]['content'] }}"])
def test_undefined_fails_in_one_line(t):
    msg = error(small(chat_template=t), chat=True)
    assert "UndefinedError" in msg and TEMPLATE in msg


@pytest.mark.parametrize("bad", [42, ["{{ x }}"], b"{{ x }}"])
def test_template_must_be_a_string(bad):
    assert TEMPLATE in error(small(chat_template=bad))


def test_no_template_is_chatml():
    tok = Tokenizer(small(), PATH)
    assert tok.template is None
    assert tok.chat("hi", "sys") == ("<|im_start|>system\nsys<|im_end|>\n"
                                     "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_hugging_face_helpers():
    # tojson as transformers defines it (no HTML escaping), loop controls, trimmed blocks
    t = ("{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
         "{{ m|tojson }}\n{% endfor %}")
    out = Tokenizer(small(chat_template=t), PATH).chat("<b>&</b>")
    assert out == '{"role": "user", "content": "<b>&</b>"}\n'


def test_real_template_renders_as_before(real):
    source = real[TEMPLATE]
    tok = Tokenizer(dict(real), "real.gguf")
    for system in (None, "You answer in French."):
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": "What is 2+2?"}]
        before = jinja2.Template(source).render(messages=messages, add_generation_prompt=True,
                                                bos_token=tok.tokens[tok.bos],
                                                eos_token=tok.tokens[tok.eos])
        assert tok.chat("What is 2+2?", system) == before
    assert tok.chat("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# -- tokenizer metadata --------------------------------------------------------------------------

@pytest.mark.parametrize("change, key, words", [
    (dict(model=None), "model", "must be a string"),
    (dict(model=5), "model", "must be a string"),
    (dict(model="bert"), None, "tokenizer model 'bert' is not supported"),
    (dict(pre="no-such-pre"), "pre", "'no-such-pre' is not a pre-tokenizer"),
    (dict(pre=7), "pre", "must be a string"),
    (dict(tokens=["<unk>", "<|im_start|>", "<|im_end|>", "a", "b", "a", "Ġ"]), "tokens[5]",
     "repeats tokenizer.ggml.tokens[3]"),
    (dict(scores=[0.0] * 3), "scores", "list of 7 numbers"),
    (dict(scores=[0.0, 0.0, 0.0, "1", 0.0, 0.0, 0.0]), "scores[3]", "must be a number"),
    (dict(tokens=None), "tokens", "non-empty list"),
    (dict(tokens=[]), "tokens", "non-empty list"),
    (dict(tokens="ab"), "tokens", "non-empty list"),
    (dict(tokens=[0, 1, 2, 3, 4, 5, 6]), "tokens[0]", "must be a string"),
    (dict(tokens=["<unk>", "<|im_start|>", "<|im_end|>", "a", 4, "ab", "Ġ"]), "tokens[4]", ""),
    (dict(token_type="1111111"), "token_type", "list of integers"),
    (dict(token_type=[3, 3, 3, 1, "1", 1, 1]), "token_type[4]", "integer"),
    (dict(token_type=[3, 3, 3, 1, True, 1, 1]), "token_type[4]", "integer"),
    (dict(token_type=[3, 3, 3]), "token_type", "has 3 entries"),
    (dict(merges=None), "merges", "missing"),
    (dict(merges="a b"), "merges", "list of strings"),
    (dict(merges=["a b", 7]), "merges[1]", "must be a string"),
    (dict(merges=["ab"]), "merges[0]", "two non-empty parts"),
    (dict(merges=["a "]), "merges[0]", "two non-empty parts"),
    (dict(merges=[" a"]), "merges[0]", "two non-empty parts"),
    (dict(merges=[""]), "merges[0]", "two non-empty parts"),
    (dict(merges=["a b", "b a"]), "merges[1]", "'ba', which is not in"),
    (dict(merges=["a c"]), "merges[0]", "'c', which is not in"),
    (dict(bos_token_id=7), "bos_token_id", "[0, 7)"),
    (dict(bos_token_id=-1), "bos_token_id", "[0, 7)"),
    (dict(bos_token_id="1"), "bos_token_id", "token id"),
    (dict(bos_token_id=1.0), "bos_token_id", "token id"),
    (dict(bos_token_id=True), "bos_token_id", "token id"),
    (dict(eos_token_id=99), "eos_token_id", "[0, 7)"),
    (dict(eos_token_id=[2]), "eos_token_id", "token id"),
    (dict(add_bos_token=1), "add_bos_token", "must be a bool"),
    (dict(add_bos_token="yes"), "add_bos_token", "must be a bool"),
    (dict(add_eos_token=0), "add_eos_token", "must be a bool"),
    (dict(add_space_prefix="no"), "add_space_prefix", "must be a bool"),
])
def test_malformed_metadata(change, key, words):
    msg = error(small(**change))
    assert (key is None or K + key in msg) and words in msg, msg


def test_optional_keys_may_be_absent():
    tok = Tokenizer(small(token_type=None, bos_token_id=None, eos_token_id=None,
                          add_bos_token=None), PATH)
    assert (tok.bos, tok.eos, tok.add_bos) == (None, None, False)
    assert tok.encode("a", add_bos=True) == [3]
    assert Tokenizer(small(merges=[]), PATH).encode("ab") == [3, 4]  # empty merges: bytes


def test_merges_split_like_llama_cpp():
    # word.find(' ', 1): the first part may itself start with a space
    md = small(tokens=["<unk>", " a", "b", " ab", "a"], token_type=None, merges=[" a b"],
               bos_token_id=None, eos_token_id=None)
    Tokenizer(md, PATH)
    md[K + "merges"] = ["a b c"]  # 'a' + 'b c' ('b c' is not a token)
    assert "'b c'" in error(md)


def test_real_file_with_broken_entries(real):
    md = dict(real)
    md[K + "merges"] = list(real[K + "merges"])
    md[K + "merges"][123] = "Ġ zzzzqqqq"
    assert K + "merges[123]" in error(md)
    md = dict(real)
    md[K + "tokens"] = list(real[K + "tokens"])
    md[K + "tokens"][40000] = 40000
    assert K + "tokens[40000]" in error(md)
    md = dict(real)
    md[K + "eos_token_id"] = len(real[K + "tokens"])
    assert K + "eos_token_id" in error(md)


def test_decode_checks_ids():
    tok = Tokenizer(small(), PATH)
    assert tok.decode(np.array([5, 3], dtype=np.int64)) == "aba"
    for bad in (7, -1, 2 ** 70):
        with pytest.raises(ValueError, match=f"token id {bad} is out of range"):
            tok.decode([3, bad])


def test_values_of_subclassed_types_pass_the_checks_as_before():
    """check_vocab passes lists of plain str, int and float in one pass over their types;
    values of other types that the checks accept (a str subclass, numpy's float64) take the
    per-item checks and pass as they did, and give the same tokenizer."""
    import numpy as np

    class Text(str):
        pass

    plain = small(scores=[0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
    other = dict(plain)
    other[K + "tokens"] = [Text(t) for t in plain[K + "tokens"]]
    other[K + "scores"] = [np.float64(s) for s in plain[K + "scores"]]
    a, b = Tokenizer(plain, PATH), Tokenizer(other, PATH)
    assert a.tokens == b.tokens and a.encode("ab a") == b.encode("ab a")
