import subprocess
import sys

import unpack_trainer


def test_every_public_name_resolves():
    for name in unpack_trainer.__all__:
        assert getattr(unpack_trainer, name) is not None, name
    assert sorted(dir(unpack_trainer)) == sorted(unpack_trainer.__all__)


def test_import_is_light_and_patches_nothing():
    code = (
        "import sys, unpack_trainer; "
        "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
