"""fedpipe's benchmarks: the ``fedpipe bench`` commands, outside the installed product.

Each module here registers its command through the ``fedpipe.bench`` entry point group
(pyproject.toml); the product never imports this package.
"""
