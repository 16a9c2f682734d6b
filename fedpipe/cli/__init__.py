"""fedpipe's command line: ``fedpipe server | client | simulate | run | bench ...``."""

from fedpipe.cli.main import config_from_args, describe_error, main

__all__ = ["config_from_args", "describe_error", "main"]
