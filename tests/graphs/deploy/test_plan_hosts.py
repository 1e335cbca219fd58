"""Planning across hosts (graphs/deploy/plan_hosts.py, `ggraph plan --hosts`): the host list and link
syntax, per-host sums of the device plan, and the bytes and time on each host link."""
from __future__ import annotations

import json

import pytest

from ggraph.graphs.deploy.plan_hosts import parse_hosts, parse_rate, parse_time, plan_hosts
from ggraph.graphs.deploy.presets import header_model


def test_host_lists():
    hosts = parse_hosts("2x(2x24GiB)")
    assert [[d.name for d in h] for h in hosts] == [["h0.CUDA0", "h0.CUDA1"],
                                                    ["h1.CUDA0", "h1.CUDA1"]]
    mixed = parse_hosts("(8x80GiB), (24GiB,12GiB)")
    assert [len(h) for h in mixed] == [8, 2] and mixed[1][1].memory == 12 << 30
    for bad, why in (("2x8x24GiB", "cannot read"), ("(cuda)", "sizes"), ("", "at least one"),
                     ("0x(24GiB)", "positive")):
        with pytest.raises(ValueError, match=why):
            parse_hosts(bad)


def test_rates_and_times():
    assert parse_rate("25GB/s") == 25e9
    assert parse_rate("100Gbit/s") == parse_rate("100Gbps") == 12.5e9
    assert parse_rate("1GiB/s") == 2 ** 30
    assert parse_time("20us") == pytest.approx(2e-5) and parse_time("0.5ms") == 5e-4
    for bad in ("fast", "100G", "-1GB/s", "0GB/s"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_two_hosts_of_one_device(tmp_path):
    """The tiny llama on two hosts of one device each: the activations (and the mask and
    positions, once per host) cross h0 -> h1, one row comes back to the host's output layer
    (the last hidden state) or sampling (logits), and the time per token is latency per
    transfer plus bytes over bandwidth."""
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

    hp_ = TinyLlama(n_layer=2, n_embd=64)
    model, _ = header_model(write_tiny_llama(tmp_path / "t.gguf", hp_))
    hp = plan_hosts(model, "tiny", parse_hosts("2x(1GiB)"), 1e9, 1e-5, 64, n_ubatch=16)
    assert [[hp.dp.devices[i].name for i in g] for g in hp.hosts] == [["h0.CUDA0", "CPU"],
                                                                      ["h1.CUDA0"]]
    links = {(lk.src, lk.dst): lk for lk in hp.links}
    assert set(links) == {(0, 1), (1, 0)}
    back = links[(1, 0)]
    # tied output: the output matmul runs by its weight, token_embd, on the host CPU
    assert back.bytes_token in (model.hp.n_embd * 4, model.hp.n_vocab * 4)
    assert back.copies_token == 1
    fwd = links[(0, 1)]
    assert fwd.bytes_token >= hp_.n_embd * 4  # the residual stream at least
    for lk in hp.links:
        assert lk.s_token == pytest.approx(lk.copies_token * 1e-5 + lk.bytes_token / 1e9)
    assert hp.link_s_token == pytest.approx(fwd.s_token + back.s_token)
    assert sum(hp.dp.devices[i].weights for g in hp.hosts for i in g) == \
        sum(d.weights for d in hp.dp.devices)


def test_cli_prints_hosts_and_links(capsys):
    from ggraph.cli import main

    assert main(["plan", "--preset", "deepseek-r1", "-c", "8192", "-ub", "256", "--hosts",
                 "2x(8x80GiB)", "--link", "25GB/s", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in data["hosts"]] == [0, 1] and len(data["hosts"][1]["devices"]) == 8
    assert {(lk["src"], lk["dst"]) for lk in data["links"]} == {(0, 1), (1, 0)}
    assert data["link_s_token"] > 0 and data["link_bandwidth"] == 25e9
    assert main(["plan", "--preset", "deepseek-r1", "--hosts", "2x(8x80GiB)", "--devices",
                 "2x24GiB"]) == 1
    assert "not both" in capsys.readouterr().err
