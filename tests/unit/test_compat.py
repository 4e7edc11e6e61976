"""Version gates (`lightning_dist._compat`) and the small work-arounds they switch on, each tested on its own."""

import warnings

import pytest
import torch

from lightning_dist import _compat


def _fake_versions(monkeypatch, torch_version: str, lightning_version: str = "2.6.1") -> None:
    from packaging.version import Version

    installed = {"torch": torch_version, "lightning": lightning_version}
    monkeypatch.setattr(
        _compat, "compare_version", lambda pkg, op, version: op(Version(installed[pkg]), Version(version))
    )


def test_supported_versions_pass_silently(monkeypatch):
    for version in ("2.11.0", "2.13.0+cpu", "2.14.1"):
        _fake_versions(monkeypatch, version)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _compat.check_versions()


def test_torch_below_the_range_is_refused_with_the_fix(monkeypatch):
    _fake_versions(monkeypatch, "2.10.0")
    with pytest.raises(ImportError, match=r"torch>=2\.11\.0.*pip install 'torch>=2\.11\.0'"):
        _compat.check_versions()


def test_lightning_outside_the_range_is_refused(monkeypatch):
    for version in ("2.5.5", "2.7.0"):
        _fake_versions(monkeypatch, "2.13.0", version)
        with pytest.raises(ImportError, match=r"lightning>=2\.6\.0,<2\.7\.0"):
            _compat.check_versions()


def test_torch_above_the_tested_range_warns(monkeypatch):
    _fake_versions(monkeypatch, "2.15.0")
    with pytest.warns(UserWarning, match=r"tested on torch 2\.11\.0 to 2\.14\.x.*make test-compat"):
        _compat.check_versions()


def test_pyproject_states_the_same_torch_range():
    from pathlib import Path

    import tomllib

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={_compat.TORCH_MIN[:-2]},<{_compat._next_minor(_compat.TORCH_MAX_TESTED)[:-2]}" in deps
    lo, hi = _compat.LIGHTNING_RANGE
    assert f"lightning>={lo[:-2]},<{hi[:-2]}" in deps


def test_repack_makes_values_and_gradients_dense():
    from lightning_dist.parallelize.tp.apply import _repack, _RepackGrad

    strided = torch.randn(6, 4).t()
    assert not strided.is_contiguous() and _repack(strided).is_contiguous()
    assert torch.equal(_repack(strided), strided)
    # the gradient arriving through a transpose is strided; the identity hands it on densely packed
    x = torch.randn(4, 6, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.is_contiguous()))
    (_RepackGrad.apply(x).t() * torch.randn(6, 4)).sum().backward()
    assert seen == [True]
    y = torch.randn(4, 6, requires_grad=True)  # the control: without it the gradient stays strided
    seen.clear()
    y.register_hook(lambda g: seen.append(g.is_contiguous()))
    (y.t() * torch.randn(6, 4)).sum().backward()
    assert seen == [False]
