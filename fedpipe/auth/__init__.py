"""Who may do what: per-round session tokens (:mod:`~fedpipe.auth.tokens`), signed control
calls (:mod:`~fedpipe.auth.calls`) and TLS certificates for tests and trials
(:mod:`~fedpipe.auth.certs`). Pure crypto: no gRPC, no torch."""
