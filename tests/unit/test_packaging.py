"""The wheel installs `callbacks/` as `lightning_dist.callbacks` and no top-level `callbacks` package."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("lightning_dist-*.whl")
    return path


def test_wheel_maps_callbacks_into_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_dist/callbacks/__init__.py" in names
    assert "lightning_dist/strategies/hsdp.py" in names and "lightning_dist/mesh.py" in names
    assert not any(n.startswith("callbacks/") for n in names), [n for n in names if n.startswith("callbacks/")]
    assert not any(n.startswith("tests/") or n.startswith("examples/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "lightning-dist = lightning_dist.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_editable_install_imports_callbacks_from_the_source_tree(tmp_path):
    # run outside the checkout, so only what is installed can be imported
    code = (
        "import pathlib, lightning_dist.callbacks as cb; print(pathlib.Path(cb.__file__).resolve().parent)\n"
        "try:\n    import callbacks\nexcept ModuleNotFoundError:\n    print('no-top-level')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    where, leak = out.stdout.split()
    assert Path(where) == ROOT / "callbacks"
    assert leak == "no-top-level"
