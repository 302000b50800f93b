"""Tenants and roles: who shares what, and who may call what.

Owns the scoping of session keys and chunk hashes by tenant, tenants' rates
and metric labels, their weighted shares of a capacity, and the control
plane's role policy over mutual-TLS peers.
"""
