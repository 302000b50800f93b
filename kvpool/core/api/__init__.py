"""The front door's contract, shared by the OpenAI HTTP API and gRPC Generate.

Owns the checks of one generation request's fields, what a client may read
of a backend's failure, and the context a cluster serves.
"""
