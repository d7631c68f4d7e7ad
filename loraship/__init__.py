"""loraship: one resumable pipeline from base model + data to a proven GGUF."""

import sys
from importlib.util import spec_from_file_location
from pathlib import Path

__version__ = "0.1.0"

_CHECKOUT = Path(__file__).resolve().parent.parent
# Folder of each subpackage in the source tree (pyproject's package-dir installs them there).
_CHECKOUT_SUBPACKAGES = {"loraship.stages": _CHECKOUT / "tasks", "loraship.flows": _CHECKOUT / "flows"}


class _CheckoutSubpackages:
    """Import hook for a source checkout on PYTHONPATH with nothing installed (the stage images'
    /opt/loraship, the GPU machine): tasks/ and flows/ sit next to loraship/, so it maps them to
    the names a wheel or an editable install gives them."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        folder = _CHECKOUT_SUBPACKAGES.get(fullname)
        if folder is None:
            return None
        return spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


# An installed wheel has loraship/stages itself; an editable install's setuptools finder (earlier
# on sys.meta_path) maps it first. Appended last, the hook only fills in when nothing else does.
if not (Path(__file__).resolve().parent / "stages").is_dir() and (_CHECKOUT / "tasks" / "__init__.py").is_file():
    sys.meta_path.append(_CheckoutSubpackages)
