"""Specs for networks written out as fields (``simddp.models.netspec``: ``--network
'nvlink:GBps=...,gpus-per-node=8,nic:GBps=...'`` and spec files) and for the DGX-1 P100 and PCIe
server presets."""

from __future__ import annotations

import dataclasses
import json

import pytest

from simddp.cli import main
from simddp.models import Contention, Network, PRESETS, load_network_spec, parse_network
from simddp.models.netspec import FIELDS, is_spec, network_spec, spec_of, split_networks

SIZES = (1 << 10, 1 << 20, 25 << 20, 1 << 30)


def same_costs(a: Network, b: Network) -> bool:
    return all(a.collective_time(op, s, n) == b.collective_time(op, s, n)
               for op in ("all_reduce", "all_gather", "broadcast") for s in SIZES
               for n in (2, 8, 16, 64))


def test_fields_set_the_network_they_name_in_their_units() -> None:
    net = parse_network("nvlink:GBps=120,gpus-per-node=8,nic:Gbps=100,nics-per-node=4,"
                        "nic:us=7,nvlink:us=1.5,algorithm=ring,name=mine")
    assert (net.intra_bandwidth_GBps, net.gpus_per_node, net.bandwidth_GBps,
            net.nics_per_node, net.latency_us, net.intra_latency_us, net.algorithm,
            net.name) == (120.0, 8, 12.5, 4, 7.0, 1.5, "ring", "mine")
    # without a preset: IB-class step latency and NCCL's algorithm choice
    plain = parse_network("nic:GBps=25")
    assert (plain.latency_us, plain.algorithm, plain.gpus_per_node) == (5.0, "auto", None)
    assert plain.name == "nic:GBps=25"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_written_as_fields_is_the_same_network(name: str) -> None:
    preset = Network.preset(name)
    spec = spec_of(preset)
    rebuilt = parse_network(spec)
    assert dataclasses.replace(rebuilt, name=name) == preset
    assert same_costs(rebuilt, preset)


def test_a_preset_with_fields_overrides_them_as_the_python_api_does() -> None:
    net = parse_network("dgx-a100,nic:Gbps=100,nics-per-node=4")
    assert net == Network.preset("dgx-a100", bandwidth_GBps=12.5, nics_per_node=4,
                                 name="dgx-a100,nic:Gbps=100,nics-per-node=4")
    assert parse_network("dgx-h100,nvls:GBps=none").nvls_bandwidth_GBps is None
    # a flat preset with gpus-per-node gets NVLink inside, as Network.preset(..., gpus_per_node=8)
    assert same_costs(parse_network("ib-ndr,gpus-per-node=8"),
                      Network.preset("ib-ndr", gpus_per_node=8))
    c = parse_network("dgx-a100,contention:slowdown=1.2,contention:us=8.4").contention
    assert (c.slowdown, c.per_collective_us) == (1.2, 8.4)


def test_fewer_nics_per_node_make_inter_node_all_reduce_slower() -> None:
    four = parse_network("nvlink:GBps=120,gpus-per-node=8,nic:Gbps=100,nics-per-node=4")
    eight = parse_network("nvlink:GBps=120,gpus-per-node=8,nic:Gbps=100,nics-per-node=8")
    assert four.collective_time("all_reduce", 1 << 28, 32) > \
        eight.collective_time("all_reduce", 1 << 28, 32)
    assert four.collective_time("all_reduce", 1 << 28, 8) == \
        eight.collective_time("all_reduce", 1 << 28, 8)  # inside one node: NVLink alone


@pytest.mark.parametrize("spec, words", [
    ("dgx-a100,nic:GBs=3", ["unknown field 'nic:GBs'", "accepted fields: preset, nic:GBps"]),
    ("nic:GBps=fast", ["nic:GBps='fast' is not a number", "bandwidth per NIC"]),
    ("nic:GBps=25,gpus-per-node=2.5", ["gpus-per-node='2.5' is not an integer"]),
    ("nic:GBps=-1", ["Network.bandwidth_GBps must be a finite number > 0",
                     "spec field nic:GBps"]),
    ("gpus-per-node=8", ["needs nic:GBps (or nic:Gbps)", "e.g. 'dgx-a100,nic:Gbps=100'"]),
    ("nic:GBps=none", ["nic:GBps cannot be none"]),
    ("nic:GBps=25,nic:Gbps=100", ["sets bandwidth_GBps again"]),
    ("nic:GBps=25,ib-ndr", ["item 'ib-ndr' is not KEY=VALUE"]),
    ("dgx-z100,nic:Gbps=100", ["unknown network preset 'dgx-z100'", "dgx1-p100"]),
    ("nic:GBps=25,algorithm=nvls", ["needs NVLink SHARP"]),
    ("dgx-a100,contention:slowdown=0.5", ["Contention.slowdown must be"]),
])
def test_a_wrong_field_is_named_with_what_is_accepted(spec: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_network(spec)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_gpus_per_node_flag_fills_a_spec_and_a_conflict_is_refused() -> None:
    assert parse_network("nic:GBps=25", gpus_per_node=4).gpus_per_node == 4
    assert parse_network("nic:GBps=25,gpus-per-node=4", gpus_per_node=4).gpus_per_node == 4
    with pytest.raises(ValueError, match="sets gpus-per-node=8 but --gpus-per-node is 4"):
        parse_network("nic:GBps=25,gpus-per-node=8", gpus_per_node=4)


def test_spec_files_hold_the_same_fields_flat_or_in_tables(tmp_path) -> None:
    toml = tmp_path / "p100.toml"
    toml.write_text('preset = "dgx1-p100"\nnics-per-node = 2\n[nic]\nGbps = 25\nus = 8\n')
    js = tmp_path / "p100.json"
    js.write_text(json.dumps({"preset": "dgx1-p100", "nics-per-node": 2,
                              "nic:Gbps": 25, "nic": {"us": 8}}))
    a, b = load_network_spec(toml), load_network_spec(js)
    assert (a.bandwidth_GBps, a.latency_us, a.nics_per_node, a.name) == (3.125, 8.0, 2,
                                                                         "p100.toml")
    assert dataclasses.replace(b, name="p100.toml") == a
    bad = tmp_path / "bad.toml"
    bad.write_text("[nic]\nGBs = 3\n")
    with pytest.raises(ValueError, match="unknown field 'nic:GBs'"):
        load_network_spec(bad)


def test_a_calibrate_file_and_a_preset_name_pass_through_unchanged(tmp_path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"measurements": [
        {"op": "all_reduce", "world_size": 2, "bytes": 1024, "seconds": 1e-4}]}))
    assert not is_spec(str(cal)) and network_spec(str(cal)) == str(cal)
    assert network_spec("ib-ndr", gpus_per_node=8) == "ib-ndr"
    assert isinstance(network_spec("ib-ndr,gpus-per-node=8"), Network)


def test_network_lists_split_at_names_and_semicolons() -> None:
    assert split_networks("ib-ndr,100gbe") == ["ib-ndr", "100gbe"]
    assert split_networks("nic:GBps=25,nic:us=9,dgx-a100,nic:Gbps=100") == \
        ["nic:GBps=25,nic:us=9", "dgx-a100,nic:Gbps=100"]
    assert split_networks("cal.json,nic:GBps=3") == ["cal.json", "nic:GBps=3"]
    assert split_networks("dgx-a100;nic:GBps=3") == ["dgx-a100", "nic:GBps=3"]


def test_every_field_is_documented_with_its_meaning() -> None:
    assert all(f.meaning for f in FIELDS.values())
    assert {f.target for f in FIELDS.values()} >= {
        f.name for f in dataclasses.fields(Network)} - {"contention", "crossing"}
    # crossing is set by Network.placed (a communicator's tiers), never written by a user


# -- the presets -----------------------------------------------------------------------------------


def test_dgx1_p100_is_nvlink1_cube_mesh_with_four_edr_hcas() -> None:
    net = Network.preset("dgx1-p100")
    assert (net.gpus_per_node, net.nics_per_node, net.bandwidth_GBps) == (8, 4, 12.5)
    assert net.intra_bandwidth_GBps == 4 * 18.0 and net.nvls_bandwidth_GBps is None
    v100 = Network.preset("dgx1-v100")
    big = 1 << 30
    assert net.collective_time("all_reduce", big, 8) > v100.collective_time("all_reduce", big, 8)
    # the same NICs: between nodes the two DGX-1s differ only by their NVLink stage
    assert net.collective_time("all_reduce", big, 64) >= v100.collective_time("all_reduce", big, 64)


def test_pcie_server_is_slower_inside_a_node_than_any_nvlink_node() -> None:
    pcie = Network.preset("pcie-server")
    assert (pcie.gpus_per_node, pcie.nics_per_node, pcie.intra_bandwidth_GBps) == (8, 1, 12.0)
    big = 1 << 30
    inside = {n: Network.preset(n).collective_time("all_reduce", big, 8)
              for n in ("pcie-server", "dgx1-p100", "dgx1-v100", "dgx-a100")}
    assert max(inside, key=inside.get) == "pcie-server"
    # a ring at the bus bandwidth: 2(n-1)/n · S / 12 GB/s, plus 14 steps of 3 µs
    assert inside["pcie-server"] == pytest.approx(1.75 * big / 12e9 + 14 * 3e-6, rel=1e-6)
    assert parse_network("pcie-server,nic:Gbps=25").collective_time("all_reduce", big, 16) > \
        pcie.collective_time("all_reduce", big, 16)


# -- the command line ------------------------------------------------------------------------------


def test_whatif_takes_a_spec_and_a_preset_with_fields(capsys) -> None:
    rc = main(["whatif", "mlp", "--world-size", "16", "--no-progress", "--network",
               "pcie-server,nic:Gbps=25;nvlink:GBps=72,gpus-per-node=8,nic:Gbps=100,"
               "nics-per-node=4"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.strip().startswith("16")]
    assert len(rows) == 2


def test_whatif_refuses_a_wrong_field_as_a_bad_argument(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["whatif", "mlp", "--world-size", "2", "--network", "dgx-a100,nics=4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown field 'nics'" in err and "nics-per-node" in err
