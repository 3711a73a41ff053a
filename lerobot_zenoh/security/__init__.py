"""TLS certificates and Zenoh access control generated from a manifest (docs/security.md)."""
