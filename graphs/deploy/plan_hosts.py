"""Planning a deployment across hosts: several machines, each with its own devices, joined by
network links. All hosts' devices are planned as one device list (plan_devices.py: the same
schedule a run would make), then grouped by host: per host its devices' weights, KV cache and
compute buffers; per pair of hosts the bytes the schedule's copies move across the link, per
worst-case ubatch and per generated token, and the time they take at the link's bandwidth and
latency. The host CPU (inputs, output layer, sampling) belongs to the first host.

    2x(8x24GiB)              two hosts of eight 24 GiB devices
    (8x80GiB),(4x24GiB)      one host of eight 80 GiB devices and one of four 24 GiB
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ggraph.ir.types import MIB

from ggraph.graphs.deploy.placement import Device, parse_devices
from ggraph.graphs.deploy.plan_devices import GIB, DeploymentPlan, plan_devices

_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_hosts(spec: str, max_devices: int | None = None) -> list[list[Device]]:
    """Hosts of virtual devices: `2x(8x24GiB)`, `(8x80GiB),(4x24GiB)`, `2x(24GiB,24GiB)`.
    Devices are named h<host>.<device> (h0.CUDA0, h1.CUDA3). More than `max_devices`
    devices in all (a model's n_layer + 1) are refused before any is made."""
    hosts: list[list[Device]] = []
    total = 0
    rest = spec.strip()
    while rest:
        m = re.match(r"(?:(\d+)\s*[xX]\s*)?\(([^()]*)\)\s*(?:,\s*|$)", rest)
        if not m:
            raise ValueError(f"cannot read the host list {spec!r} at {rest!r}; write hosts as "
                             f"(devices) with an optional count, e.g. 2x(8x24GiB) or "
                             f"(8x80GiB),(4x24GiB)")
        if len(m.group(1) or "") > 18:
            raise ValueError(f"host count {m.group(1)[:20]}... is too large in --hosts "
                             f"{spec[:60]!r}")
        n = int(m.group(1) or 1)
        if n <= 0:
            raise ValueError(f"host count must be positive in {m.group(0).strip()!r}")
        devs = parse_devices(m.group(2), max_devices, "--hosts: the host")
        if any(d.kind != "virtual" for d in devs):
            raise ValueError(f"--hosts {spec!r}: give device sizes for planning (24GiB), not "
                             f"backends")
        total += n * len(devs)
        if max_devices is not None and total > max_devices:
            raise ValueError(f"--hosts {spec[:60]!r}: {total} or more devices for a model that "
                             f"can use at most {max_devices} (its layers and its output "
                             f"layer; more stages than layers leave some empty)")
        hosts.extend([devs] * n)
        rest = rest[m.end():].strip()
    if not hosts:
        raise ValueError("give at least one host, e.g. --hosts 2x(8x24GiB)")
    return [[Device(f"h{h}.{d.name}", d.kind, d.memory) for d in devs]
            for h, devs in enumerate(hosts)]


def parse_rate(text: str) -> float:
    """A link's bandwidth in bytes/s: '25GB/s', '12.5GiB/s', '100Gbit/s', '100Gbps' (B bytes,
    b or bit bits)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)(B|b|bit|Bit|byte|Byte)(?:/s|ps)"
                     r"\s*", text)
    if not m:
        raise ValueError(f"cannot read the bandwidth {text!r}; write e.g. 25GB/s, 12.5GiB/s, "
                         f"100Gbit/s or 100Gbps")
    power = " kmgt".index(m.group(2).lower() or " ")
    scale = (1024 if m.group(3) else 1000) ** power
    rate = float(m.group(1)) * scale / (8 if m.group(4) in ("b", "bit", "Bit") else 1)
    if not rate > 0:
        raise ValueError(f"the bandwidth {text!r} must be positive")
    return rate


def parse_time(text: str) -> float:
    """'20us', '0.1ms', '1e-5' (seconds) -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?\d+)?)\s*([a-zµ]*)\s*", text.lower())
    if not m or (m.group(2) or "s") not in _TIMES:
        raise ValueError(f"cannot read the time {text!r}; write e.g. 20us or 0.1ms")
    return float(m.group(1)) * _TIMES[m.group(2) or "s"]


@dataclass
class LinkTraffic:
    """Bytes one host sends another per worst-case ubatch and per generated token, and the
    seconds they take on the link (a transfer per copied tensor: latency + bytes/bandwidth)."""
    src: int
    dst: int
    bytes_ubatch: int
    bytes_token: int
    copies_ubatch: int
    copies_token: int
    s_ubatch: float
    s_token: float


@dataclass
class HostsPlan:
    dp: DeploymentPlan
    hosts: list[list[int]]       # host -> indices into dp.devices (the CPU is in host 0)
    links: list[LinkTraffic]
    bandwidth: float             # bytes/s of every host link
    latency: float               # seconds per transfer
    local_bytes_ubatch: int      # copies between devices of one host
    local_bytes_token: int

    @property
    def link_s_token(self) -> float:
        """Seconds a generated token spends on host links (its stages run one after the
        other, so their transfers add up)."""
        return sum(lk.s_token for lk in self.links)

    @property
    def link_s_ubatch(self) -> float:
        return sum(lk.s_ubatch for lk in self.links)


def _traffic(sch: Any, host_of: Sequence[int]) -> tuple[dict[tuple[int, int], list[int]], int]:
    """(src host, dst host) -> [bytes, transfers] over host links, and the bytes copied between
    devices of one host, for one run of the scheduled graph. A tensor crosses to a host once,
    however many of its devices read it (the mask and positions reach every device; the host
    that receives them copies them on locally), and the graph's outputs (logits) cross back to
    the first host, where sampling runs."""
    links: dict[tuple[int, int], list[int]] = {}
    local = 0
    crossed: set[tuple[Any, int]] = set()

    def cross(src: int, dst: int, nbytes: int) -> None:
        agg = links.setdefault((src, dst), [0, 0])
        agg[0] += nbytes
        agg[1] += 1

    for (t, d), c in sch.copies.items():
        src, dst = host_of[sch.device_of(t)], host_of[d]
        if src == dst or (t, dst) in crossed:
            local += c.nbytes
            continue
        crossed.add((t, dst))
        cross(src, dst, c.nbytes)
    for t in sch.graph.nodes:
        if t.is_output and host_of[sch.device_of(t)] != 0:
            cross(host_of[sch.device_of(t)], 0, t.nbytes)
    return links, local


def plan_hosts(model: Any, source: str, hosts: Sequence[Sequence[Device]], bandwidth: float,
               latency: float, n_ctx: int, **kw: Any) -> HostsPlan:
    """plan_devices over every host's devices, grouped by host, with the link traffic."""
    if bandwidth <= 0 or latency < 0:
        raise ValueError("a link needs a positive bandwidth and a latency >= 0")
    devices = [d for h in hosts for d in h]
    host_of = [h for h, devs in enumerate(hosts) for _ in devs] + [0]  # the CPU: host 0
    dp = plan_devices(model, source, devices, n_ctx, **kw)
    ub, ub_local = _traffic(dp.schedule, host_of)
    tok, tok_local = _traffic(dp.schedule_token, host_of)
    links = []
    for key in sorted(set(ub) | set(tok)):
        bu, cu = ub.get(key, [0, 0])
        bt, ct = tok.get(key, [0, 0])
        links.append(LinkTraffic(key[0], key[1], bu, bt, cu, ct,
                                 cu * latency + bu / bandwidth, ct * latency + bt / bandwidth))
    groups = [[i for i, h in enumerate(host_of) if h == g] for g in range(len(hosts))]
    return HostsPlan(dp, groups, links, bandwidth, latency, ub_local, tok_local)


def _h(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.2f} MiB"


def _rate(r: float) -> str:
    return f"{r / 1e9:,.2f} GB/s ({r * 8 / 1e9:,.0f} Gbit/s)"


def format_lines(hp: HostsPlan, device_lines: Sequence[str]) -> list[str]:
    """The per-device plan's lines (plan_devices.format_lines), then per host and per link."""
    dp = hp.dp
    lines = list(device_lines)
    lines.append(f"{len(hp.hosts)} hosts, links of {_rate(hp.bandwidth)} and "
                 f"{hp.latency * 1e6:g} us per transfer")
    lines.append(f"{'host':<6} {'devices':>7} {'weights':>12} {'KV cache':>12} "
                 f"{'compute':>12} {'total':>12}  fits")
    for h, idx in enumerate(hp.hosts):
        ds = [dp.devices[i] for i in idx]
        cpu = " + CPU" if any(i == len(dp.devices) - 1 for i in idx) else ""
        fits = all(d.fits is not False for d in ds)
        lines.append(f"{'h' + str(h):<6} {len([i for i in idx if i < len(dp.devices) - 1]):>7}"
                     f" {_h(sum(d.weights for d in ds)):>12} {_h(sum(d.kv for d in ds)):>12} "
                     f"{_h(sum(d.compute for d in ds)):>12} {_h(sum(d.total for d in ds)):>12}"
                     f"  {'yes' if fits else 'NO'}{cpu}")
    if not hp.links:
        lines.append("no copies cross a host link (every layer on one host)")
    for lk in hp.links:
        lines.append(f"link h{lk.src} -> h{lk.dst}: {_h(lk.bytes_ubatch)} in {lk.copies_ubatch} "
                     f"copies per ubatch of {dp.n_tokens} tokens ({lk.s_ubatch * 1e3:,.2f} ms), "
                     f"{lk.bytes_token / 1024:,.1f} KiB in {lk.copies_token} copies per token "
                     f"({lk.s_token * 1e6:,.1f} us)")
    lines.append(f"between devices of one host: {_h(hp.local_bytes_ubatch)} per ubatch, "
                 f"{hp.local_bytes_token / 1024:,.1f} KiB per token (not timed: device links)")
    lines.append(f"time on host links: {hp.link_s_token * 1e3:,.3f} ms per generated token "
                 f"(at most {1 / hp.link_s_token if hp.link_s_token else float('inf'):,.0f} "
                 f"tokens/s from the links alone), {hp.link_s_ubatch * 1e3:,.2f} ms per ubatch")
    return lines


def to_json(hp: HostsPlan, devices_json: dict[str, Any]) -> dict[str, Any]:
    dp = hp.dp
    return {**devices_json,
            "hosts": [{"host": h, "devices": [dp.devices[i].name for i in idx],
                       "weights": sum(dp.devices[i].weights for i in idx),
                       "kv": sum(dp.devices[i].kv for i in idx),
                       "compute": sum(dp.devices[i].compute for i in idx)}
                      for h, idx in enumerate(hp.hosts)],
            "links": [vars(lk) for lk in hp.links],
            "link_bandwidth": hp.bandwidth, "link_latency_s": hp.latency,
            "link_s_token": hp.link_s_token, "link_s_ubatch": hp.link_s_ubatch,
            "local_bytes_ubatch": hp.local_bytes_ubatch,
            "local_bytes_token": hp.local_bytes_token}
