"""Event tests run against both index backends (the same fixture as the index contract)."""
from tests.index.conftest import index  # noqa: F401
