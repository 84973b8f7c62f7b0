"""Networks written out on the command line or in a small spec file, with the fields of the
presets (:mod:`simddp.models.presets`).

A spec is comma-separated ``KEY=VALUE`` items, optionally after a preset name whose fields they
override::

    >>> net = parse_network("nvlink:GBps=120,gpus-per-node=8,nic:Gbps=100,nics-per-node=4")
    >>> net.intra_bandwidth_GBps, net.bandwidth_GBps, net.nics_per_node, net.latency_us
    (120.0, 12.5, 4, 5.0)
    >>> parse_network("dgx-a100,nic:Gbps=100").bandwidth_GBps   # DGX A100 with 100 Gb/s NICs
    12.5

Keys (:data:`FIELDS`): ``nic:GBps`` / ``nic:Gbps`` (bandwidth per NIC, gigabytes or gigabits
per second; on a flat fabric, per rank), ``nic:us`` (latency of one algorithm step between
nodes), ``nics-per-node``, ``gpus-per-node``, ``nvlink:GBps`` / ``nvlink:us`` (the link inside
a node: NCCL bus bandwidth and step latency; ``pcie:`` is the same field, for boxes without
NVLink), ``nvls:GBps`` (NVLink SHARP), ``algorithm`` (ring, tree, nvls, auto), ``name``,
``contention:slowdown`` / ``contention:us`` (:class:`~simddp.models.Contention`) and
``preset``. A value ``none`` unsets an optional field (``nvls:GBps=none``). Without a preset,
``nic:us`` defaults to 5 µs (InfiniBand, as "ib-hdr"), ``nvlink:us`` to 2 µs and the algorithm
to NCCL's choice ("auto").

A spec file (``.toml``, or ``.json`` without ``"measurements"``, which would make it a
``simddp calibrate`` file) holds the same keys, or tables of them::

    preset = "dgx1-v100"
    nics-per-node = 2
    [nic]
    Gbps = 25
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .contention import Contention
from .network import Network

__all__ = ["FIELDS", "parse_network", "load_network_spec", "network_spec", "split_networks",
           "is_spec", "spec_of"]


@dataclass(frozen=True)
class _Field:
    target: str  # the Network field it sets ("contention.slowdown": a Contention field)
    kind: Callable[[str], Any]
    meaning: str


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("not an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("not a number") from None


def _gbit(text: str) -> float:
    return _float(text) / 8.0


def _bool(text: str) -> bool:
    low = text.lower()
    if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError("not true or false")
    return low in ("true", "1", "yes", "on")


def _tiers(text: str) -> tuple:
    """``NAME:GPUS:OVERSUBSCRIPTION`` items joined by ``+``, innermost first."""
    from .placement import Tier

    out = []
    for item in text.split("+"):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"not NAME:GPUS:OVERSUBSCRIPTION ({item!r}), e.g. su:256:1")
        out.append(Tier(parts[0], _int(parts[1]), _float(parts[2])))
    return tuple(out)


def _tiers_text(tiers: tuple) -> str:
    return "+".join(f"{t.name}:{t.gpus}:{t.oversubscription}" for t in tiers)


FIELDS: dict[str, _Field] = {
    "preset": _Field("preset", str, "a preset to start from (simddp.Network.preset)"),
    "nic:GBps": _Field("bandwidth_GBps", _float, "bandwidth per NIC, GB/s"),
    "nic:Gbps": _Field("bandwidth_GBps", _gbit, "bandwidth per NIC, Gb/s (÷ 8 = GB/s)"),
    "nic:us": _Field("latency_us", _float, "latency of one algorithm step between nodes, µs"),
    "nics-per-node": _Field("nics_per_node", _int, "NICs sharing a node's inter-node traffic"),
    "gpus-per-node": _Field("gpus_per_node", _int, "ranks per node"),
    "nvlink:GBps": _Field("intra_bandwidth_GBps", _float,
                          "bus bandwidth inside a node (NVLink), GB/s"),
    "nvlink:us": _Field("intra_latency_us", _float, "step latency inside a node, µs"),
    "pcie:GBps": _Field("intra_bandwidth_GBps", _float,
                        "bus bandwidth inside a node without NVLink, GB/s"),
    "pcie:us": _Field("intra_latency_us", _float, "step latency inside a node, µs"),
    "nvls:GBps": _Field("nvls_bandwidth_GBps", _float, "NVLink SHARP all_reduce bandwidth, GB/s"),
    "algorithm": _Field("algorithm", str, "ring, tree, nvls or auto"),
    "name": _Field("name", str, "the label tables show"),
    "nccl": _Field("nccl", _bool, "whether the fabric runs NCCL (its tuning model; true/false)"),
    "gpu": _Field("gpu", str, "the nodes' GPU (v100, a100, h100...): NCCL's constants, SM share"),
    "intra-link": _Field("intra_link", str, "nvlink or pci, the link inside a node"),
    "collnet": _Field("collnet", _bool, "in-network reduction (SHARP): NCCL's CollNet"),
    "tiers": _Field("tiers", _tiers, "switch tiers above the node, NAME:GPUS:OVERSUB joined by +"),
    "contention:slowdown": _Field("contention.slowdown", _float,
                                  "compute slowdown while a collective runs (>= 1)"),
    "contention:us": _Field("contention.per_collective_us", _float,
                            "compute-stream cost of issuing a collective, µs"),
}

_OPTIONAL = {"nics_per_node", "gpus_per_node", "intra_bandwidth_GBps", "intra_latency_us",
             "nvls_bandwidth_GBps", "contention", "gpu"}
# without a preset: IB-class α, NCCL's algorithm choice and tuning model
_DEFAULTS = {"latency_us": 5.0, "algorithm": "auto", "nccl": True}


def _accepted() -> str:
    return ", ".join(FIELDS)


def split_networks(text: str) -> list[str]:
    """The networks of a ``--network`` list: an item without ``=`` (a preset name or a file)
    starts a network, items with ``=`` belong to the one before them; ``;`` always separates
    (for a spec without a preset after another network).

    >>> split_networks("ib-ndr,dgx-a100,nic:Gbps=100,gpus-per-node=8,100gbe")
    ['ib-ndr', 'dgx-a100,nic:Gbps=100,gpus-per-node=8', '100gbe']
    >>> split_networks("ib-ndr;nic:Gbps=25,nic:us=10")
    ['ib-ndr', 'nic:Gbps=25,nic:us=10']
    """
    out: list[str] = []
    for group in text.split(";"):
        start = len(out)
        for item in (x.strip() for x in group.split(",")):
            if not item:
                continue
            if "=" in item and len(out) > start and not _is_file(out[-1]):
                out[-1] += "," + item
            else:
                out.append(item)
    return out


def _is_file(text: str) -> bool:
    return text.endswith((".json", ".toml"))


def is_spec(text: str) -> bool:
    """Whether ``text`` is a spec (``KEY=VALUE`` items) or a spec file, rather than a preset
    name or a ``simddp calibrate --json`` file (what :func:`~simddp.whatif.whatif`
    takes as they are)."""
    if "=" in text:
        return True
    if text.endswith(".toml"):
        return True
    if text.endswith(".json") and os.path.isfile(text):
        with open(text) as f:
            doc = json.load(f)
        return isinstance(doc, dict) and "measurements" not in doc
    return False


def network_spec(text: str, *, gpus_per_node: int | None = None) -> Network | str:
    """What ``--network`` item ``text`` names: a :class:`Network` for a spec or a spec file,
    ``text`` itself for a preset name or a ``simddp calibrate --json`` file. ``gpus_per_node``
    (the ``--gpus-per-node`` flag) applies to a spec that does not set it; one that sets a
    different value is an error."""
    if not is_spec(text):
        return text
    if _is_file(text):
        return load_network_spec(text, gpus_per_node=gpus_per_node)
    return parse_network(text, gpus_per_node=gpus_per_node)


def parse_network(text: str, *, gpus_per_node: int | None = None) -> Network:
    """The :class:`Network` of spec ``text`` (the module docstring's grammar)."""
    items: dict[str, str] = {}
    for i, item in enumerate(x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            if i == 0:
                key, value = "preset", item
            else:
                raise ValueError(f"network spec {text!r}: item {item!r} is not KEY=VALUE (only "
                                 f"the first item may be a bare preset name); accepted keys: "
                                 f"{_accepted()}")
        items[key.strip()] = value.strip()
    return _build(items, text, gpus_per_node)


def load_network_spec(path: str | os.PathLike, *, gpus_per_node: int | None = None) -> Network:
    """The :class:`Network` of a ``.toml`` or ``.json`` spec file: the keys of
    :data:`FIELDS`, at top level or in tables (``[nic] Gbps = 25`` is ``nic:Gbps``)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        doc = tomllib.load(f) if path.endswith(".toml") else json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"network spec file {path!r} must hold a table of fields "
                         f"({_accepted()}), got {type(doc).__name__}")
    items: dict[str, str] = {}

    def flatten(prefix: str, table: Mapping[str, Any]) -> None:
        for k, v in table.items():
            key = f"{prefix}:{k}" if prefix else str(k)
            if isinstance(v, Mapping):
                flatten(key, v)
            else:
                items[key] = "none" if v is None else str(v)

    flatten("", doc)
    items.setdefault("name", os.path.basename(path))
    return _build(items, path, gpus_per_node)


def spec_of(net: Network) -> str:
    """``net`` written as a spec (every field it sets), to edit or to pass as ``--network``.

    >>> spec_of(Network.preset("dgx1-p100"))
    'nic:GBps=12.5,nic:us=5.0,algorithm=auto,gpus-per-node=8,nvlink:GBps=72.0,nvlink:us=2.0,name=dgx1-p100,nics-per-node=4,gpu=p100'
    """
    first = {}  # the first key of each target: nic:GBps over nic:Gbps, nvlink: over pcie:
    for key, f in FIELDS.items():
        first.setdefault(f.target, key)
    items = []
    for target in ("bandwidth_GBps", "latency_us", "algorithm", "gpus_per_node",
                   "intra_bandwidth_GBps", "intra_latency_us", "name", "nics_per_node",
                   "nvls_bandwidth_GBps"):
        value = getattr(net, target)
        if value is not None:
            items.append(f"{first[target]}={value}")
    if not net.nccl:
        items.append("nccl=false")
    if net.gpu is not None:
        items.append(f"gpu={net.gpu}")
    if net.intra_link != "nvlink":
        items.append(f"intra-link={net.intra_link}")
    if net.collnet:
        items.append("collnet=true")
    if net.tiers:
        items.append(f"tiers={_tiers_text(net.tiers)}")
    if net.contention is not None:
        items += [f"contention:slowdown={net.contention.slowdown}",
                  f"contention:us={net.contention.per_collective_us}"]
    return ",".join(items)


def _build(items: dict[str, str], where: str, gpus_per_node: int | None) -> Network:
    fields: dict[str, Any] = {}
    contention: dict[str, float] = {}
    preset = None
    for key, text in items.items():
        spec = FIELDS.get(key)
        if spec is None:
            raise ValueError(f"network spec {where!r}: unknown field {key!r}; accepted fields: "
                             f"{_accepted()}")
        if text.lower() == "none":
            if spec.target not in _OPTIONAL and not spec.target.startswith("contention"):
                raise ValueError(f"network spec {where!r}: {key} cannot be none (it is "
                                 f"required: {spec.meaning})")
            value = None
        else:
            try:
                value = spec.kind(text)
            except ValueError as e:
                raise ValueError(f"network spec {where!r}: {key}={text!r} is {e}; {key} is "
                                 f"the {spec.meaning}") from None
        if spec.target == "preset":
            preset = value
        elif spec.target.startswith("contention."):
            if value is not None:
                contention[spec.target.split(".", 1)[1]] = value
        else:
            if spec.target in fields and fields[spec.target] != value:
                raise ValueError(f"network spec {where!r}: {key} sets {spec.target} again "
                                 f"(to {value!r}); give it once")
            fields[spec.target] = value
    if items.get("contention:slowdown", "").lower() == "none":
        fields["contention"] = None
    elif contention:
        fields["contention"] = Contention(**contention, source=f"network spec {where}")
    if gpus_per_node is not None:
        given = fields.setdefault("gpus_per_node", gpus_per_node)
        if given != gpus_per_node:
            raise ValueError(f"network spec {where!r} sets gpus-per-node={given} but "
                             f"--gpus-per-node is {gpus_per_node}; give one of them")
    fields.setdefault("name", where)
    try:
        if preset is not None:
            return Network.preset(preset, **fields)
        if "bandwidth_GBps" not in fields:
            raise ValueError(f"network spec {where!r} needs nic:GBps (or nic:Gbps), the "
                             f"bandwidth between nodes (on a flat fabric: per rank), or a "
                             f"preset to start from, e.g. 'dgx-a100,nic:Gbps=100'")
        return Network(**{**_DEFAULTS, **fields})
    except ValueError as e:
        msg = str(e)
        if msg.startswith("network spec") or msg.startswith("unknown network preset"):
            raise
        keys = [k for k, f in FIELDS.items() if f"Network.{f.target}" in msg]
        hint = f" (spec field {' / '.join(keys)})" if keys else ""
        raise ValueError(f"network spec {where!r}: {msg}{hint}") from None
