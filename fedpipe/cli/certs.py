"""``fedpipe certs``: test certificates for TLS and mutual TLS on the stage link."""

from __future__ import annotations

import argparse

from fedpipe.auth.certs import make_test_certificates

__all__ = ["cmd_certs"]


def cmd_certs(args: argparse.Namespace) -> int:
    clients = args.client or ["serverapp", "device-0", "device-1"]
    files = make_test_certificates(args.out, hosts=args.host or [], clients=clients, days=args.days)
    print(f"CA                {files.ca}  (devices: --tls-ca; StageServer: server.tls_client_ca)")
    print(f"server            {files.server_cert} {files.server_key}  (server.tls_cert, tls_key)")
    for name, (cert, key) in files.clients.items():
        print(f"client {name:<10} {cert} {key}")
    return 0
