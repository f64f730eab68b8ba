"""Wire formats shared by the command line and the HTTP API, by what they carry: ``inputs`` (what clients
send, and its acknowledgements), ``results`` (a batch's stored results), ``reads`` (what pages and read
endpoints return), ``alerts`` (alert settings and alerts), ``rows`` (stored rows into answers).

Must not import fastapi: the CLI uses these models without a server.
"""
