"""What an installed gradsync needs is in the wheel that installs it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_the_c_kernels_source(tmp_path: Path) -> None:
    # gradsync.compress.native compiles native.c where the package is installed: without it every
    # installed user would run the slow torch ops (after a warning), and no test in a checkout sees it.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("gradsync-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gradsync/compress/native.c" in names and "gradsync/compress/native.py" in names
