"""fedfusion: every device trains what it can hold, and one large model learns from all of them."""

from pathlib import Path

__version__ = "0.1.0"

# strategies/, clients/ and recipes/ sit beside this folder in a source tree and in a Flower app bundle
# (which `flwr run` puts first on sys.path); installs map them in as sub-packages. Let the source-tree
# layout resolve ``fedfusion.strategies`` etc. too.
_root = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "strategies").is_dir() and (_root / "strategies" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 - __path__ is the package's own search path
