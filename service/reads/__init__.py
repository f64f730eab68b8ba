"""Read models: what the API and the pages return (runs, the overview, series, a step's matrix).

Reading decisions live here once: which runs a page holds and its limits, a run's status light and main
sampler, a stored result read into typed values. Handlers parse, call a read and respond; ingest imports a
read to answer a write. Functions of a Session (callers own the transaction), except the series, which
opens its own. Must not import fastapi.
"""
