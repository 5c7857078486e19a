"""Hardware profiles: presets load, bad values are rejected naming the field, tables interpolate
monotonically, calibrated copies are preferred and round-trip."""

import dataclasses

import numpy as np
import pytest
import yaml

from rpeg_jax.config.base import ConfigError
from rpeg_jax.costmodel import hardware as H


@pytest.mark.parametrize("name", ["gh200", "h100", "h200", "cpu"])
def test_presets_load(name):
    p = H.load_hardware(name, calibrated=False)
    assert p.name == name and p.device.peak_flops > 0 and p.hbm_bytes > 0


def test_preset_numbers_match_the_published_specs():
    # GH200 on Alps (CSCS, JSC JUPITER pages): 989 TFLOP/s dense bf16, 96 GB HBM3 at 4 TB/s, 4 GPUs
    # per node with 150 GB/s per direction per pair, a 25 GB/s Slingshot-11 NIC per GPU; DGX H100:
    # 900 GB/s bidirectional NVLink, 8 x 400 Gb/s ConnectX-7.
    gh = H.load_hardware("gh200", calibrated=False)
    assert gh.device.peak_flops == pytest.approx(989e12)
    assert gh.device.memory_gb == 96 and gh.device.memory_bw == pytest.approx(4e12)
    assert gh.node.devices == 4 and gh.node.topology == "mesh" and gh.node.link_bw == pytest.approx(150e9)
    assert gh.network.nic_bw == pytest.approx(25e9)
    h100 = H.load_hardware("h100", calibrated=False)
    assert h100.node.devices == 8 and h100.node.link_bw * 2 == pytest.approx(900e9)
    assert h100.network.nic_bw == pytest.approx(400e9 / 8)  # 400 Gb/s per GPU, in bytes/s


def test_mesh_node_ring_bandwidth():
    gh = H.load_hardware("gh200", calibrated=False)
    # K4 mesh: k-1 disjoint rings of 150 GB/s; a switch node gives the link rate at any k.
    np.testing.assert_allclose(gh.node_bw([2, 4]), [150e9, 450e9])
    h = H.load_hardware("h100", calibrated=False)
    np.testing.assert_allclose(h.node_bw([2, 8]), [450e9, 450e9])


def _data(name="gh200"):
    with open(H.profile_path(name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("device", "memory_bw"), -1.0, "device.memory_bw"),
        (("node", "devices"), 0, "node.devices"),
        (("network", "global_taper"), 0.5, "network.global_taper"),
        (("efficiency", "overlap"), 1.5, "efficiency.overlap"),
    ],
)
def test_bad_values_name_the_field(path, value, field):
    d = _data()
    d[path[0]][path[1]] = value
    with pytest.raises(ConfigError) as e:
        H.from_dict(d)
    assert field in str(e.value) and repr(value) in str(e.value)


def test_unknown_key_and_profile():
    d = _data()
    d["device"]["peak_flop"] = 1.0
    with pytest.raises(ConfigError, match="peak_flop.*did you mean 'peak_flops'"):
        H.from_dict(d)
    with pytest.raises(ConfigError, match="unknown hardware profile"):
        H.load_hardware("a100x", calibrated=False)


def test_table_rejects_time_going_backwards():
    d = _data()
    # 4x the size with 8x the efficiency: the larger message would be faster.
    d["efficiency"]["inter_node"] = [[1.0e6, 0.1], [4.0e6, 0.8]]
    with pytest.raises(ConfigError, match="inter_node"):
        H.from_dict(d)
    d["efficiency"]["inter_node"] = [[1.0e6, 0.1], [1.0e6, 0.2]]
    with pytest.raises(ConfigError, match="sizes must increase"):
        H.from_dict(d)


def test_interpolation_time_monotone_and_clamped():
    gh = H.load_hardware("gh200", calibrated=False)
    for table in (gh.efficiency.inter_node, gh.efficiency.intra_node, gh.efficiency.matmul):
        sizes = np.logspace(2, 12, 400)
        eff = H.interp_eff(table, sizes)
        assert np.all(np.diff(sizes / eff) >= -1e-9 * sizes[1:] / eff[1:])
        assert H.interp_eff(table, 1.0) == pytest.approx(table[0][1])
        assert H.interp_eff(table, 1e15) == pytest.approx(table[-1][1])
        s, e = table[1]
        assert H.interp_eff(table, s) == pytest.approx(e)
    # Between two rows the efficiency is the geometric (log-log) interpolation.
    t = ((1e6, 0.1), (1e8, 0.4))
    assert H.interp_eff(t, 1e7) == pytest.approx(0.2)


def test_save_load_roundtrip_and_calibrated_preferred(tmp_path, monkeypatch):
    monkeypatch.setenv("RPEG_CACHE", str(tmp_path))
    base = H.load_hardware("cpu", calibrated=False)
    fitted = dataclasses.replace(
        base,
        device=dataclasses.replace(base.device, peak_flops=1.234e10),
        calibrated={"matmul_peak_measured": 1.234e10},
    )
    path = H.save_hardware(fitted, H.calibrated_path("cpu"))
    assert path.startswith(str(tmp_path))
    again = H.load_hardware("cpu", calibrated=True)
    assert again == fitted and again.source == path
    assert H.load_hardware("cpu").source == H.profile_path("cpu")  # asked for nothing: the shipped one
    assert H.load_hardware("cpu", calibrated=False).device.peak_flops == base.device.peak_flops
