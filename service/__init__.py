"""collapse-monitor service: HTTP API, storage, background scoring, metrics, alerts."""
