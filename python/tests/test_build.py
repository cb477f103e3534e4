import shutil
import subprocess

import pytest

import trainscale


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_extension_uses_the_shared_libstdcxx():
    # A statically linked libstdc++ gives _C.so its own std::locale facet ids; inside Python,
    # next to the shared libstdc++ torch loaded, its iostreams then crash (python/CMakeLists.txt).
    out = subprocess.run(["nm", "-DC", "--defined-only", trainscale._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    ids = [line for line in out.splitlines() if line.endswith("::id") and " std::" in line]
    assert not ids, f"{len(ids)} libstdc++ locale ids defined in {trainscale._C.__file__}: {ids[:3]}"
