"""Test session setup: a private kernel cache, so tests never read or write ~/.cache/tpp."""
import os
import tempfile

os.environ.setdefault("TPP_CACHE_DIR", tempfile.mkdtemp(prefix="tpp-test-cache-"))
